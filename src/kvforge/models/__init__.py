"""Decoder implementations (plain PyTorch) and their loaders."""

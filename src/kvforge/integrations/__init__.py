"""Bridges to other libraries. Each submodule imports its library only when imported itself
(`kvforge.integrations.transformers` needs `transformers`)."""

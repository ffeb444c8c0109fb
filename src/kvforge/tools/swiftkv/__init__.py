"""SwiftKV tooling: initialisation from a base model, distillation, export, evaluation and
FLOP accounting. The model itself (its forward, checkpoint format and the dense reference
forward) lives in kvforge.models."""

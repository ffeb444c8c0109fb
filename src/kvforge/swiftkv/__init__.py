"""SwiftKV: checkpoints (init/load), the dense reference forward and FLOP accounting.
The engine-side model lives in kvforge.models.llama_swiftkv."""

"""Analyses behind the methods, `kvforge analyze <kind>`: layer-input similarity by depth
(SwiftKV), key/value/input singular-value spectra and chunk landmark quality (ShadowKV),
K/V outlier channels (KIVI).

capture.py (one passage's activations through hooks and a cache-write tap), similarity.py,
spectra.py, channels.py (the numbers), plots.py (the figures), run.py (the Python API:
`analyze(model, token_ids, out_dir, ...)`), cli.py. Kept free of heavy imports.
"""

KINDS = ("layer-similarity", "key-spectra", "kv-channels")

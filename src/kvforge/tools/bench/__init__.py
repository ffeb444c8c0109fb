"""`kvforge bench prefill | decode | throughput`: kvforge against itself (other cache
configurations) and against transformers on the same weights, dtype, threads and prompts.

Modules: `cli` (arguments, dispatch), `common` (context, engines), `systems` and `compare`
(the systems measured, `--compare`), `measure` (rounds, timing rule), `flops`
(analytic FLOPs and bytes), `peak` (machine peak measured in the same run), `hf_peer`
(transformers, eager) and `hf_static_peer` (transformers, static cache compiled), `prefill`, `decode`, `throughput` (one benchmark each), `report` (JSON,
table, ratios) and `plot` (the PNG beside the JSON).
"""

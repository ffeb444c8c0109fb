"""The tooling above the engine: benchmarks, evaluations, reports, analyses, GPU checks,
SwiftKV initialisation and distillation, and the demo.

Everything here drives the engine (`kvforge.engine`, `kvforge.models`, `kvforge.cache`,
`kvforge.serve`) through its public entry points; nothing in the engine imports from here,
so the engine can be imported and tested without it.
"""

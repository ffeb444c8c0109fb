"""Quality evaluations run side by side on identical samples: `kvforge eval ppl | niah`.

compare.py (systems from --cache/--compare, the baseline), context.py (models and caches),
perplexity.py, passkey.py (sample generation and scoring), niah.py, report.py, cli.py.
"""

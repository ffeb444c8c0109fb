"""The `--prepack-weights` policies (kernels/cpu_prepack.py says what each does), apart from
that module so that the command-line parsers can name them without importing torch."""

PREPACK_POLICIES = ("auto", "on", "off")

"""Models built on the meta device only for their shapes (the parameter count of `kvforge
info`, the dummy weights' names) skip the random initialisation: a meta tensor's `normal_`
runs through torch._refs, whose first call imports torch._dynamo, 2 of `kvforge info`'s
6 seconds on a 2-core EPYC, to draw nothing."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from kvforge.models.loader import load_model_config, resolve_model_source
from kvforge.models.registry import num_parameters
from kvforge.models.dummy_weights import DummyState
config = load_model_config(resolve_model_source("llama-3.1-8b", "dummy"))
print(num_parameters(config), len(DummyState(config)), "torch._dynamo" in sys.modules)
"""


def test_counting_parameters_and_naming_dummy_weights_import_no_compiler():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    count, names, dynamo = done.stdout.split()
    assert int(count) == 8_030_261_248 and int(names) == 291  # Llama-3.1-8B: 8.03 B parameters, 32 x 9 + 3 tensors
    assert dynamo == "False"

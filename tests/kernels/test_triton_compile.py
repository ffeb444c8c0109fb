"""Every Triton kernel compiles for an H100/H200 (sm_90) here, without a GPU: Triton's
interpreter, which the kernels' parity tests run in, accepts code the GPU compiler refuses
(sm90_compile.py runs the whole compile pipeline, ptxas included, in a process of its own).
Each kernel's shared memory must fit an H100/H200 block (227 KiB), ShadowKV's kernels
read and write each sequence's tensors, addressed through its pointer table, in vector
accesses, and the paged decode kernels of `full` and KIVI read their pages in vector
accesses."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SHARED_MEMORY_PER_BLOCK = 227 * 1024  # H100 and H200 (sm_90), opt-in maximum


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every kernel compiled once for the module's tests."""
    return _compile_all(tmp_path_factory.mktemp("triton-cache"))


def _compile_all(tmp_path: Path) -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the `triton` package is not installed (pip install 'kvforge[triton]')")
    ptxas = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"this triton has no bundled ptxas ({ptxas}) to compile for a GPU with")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2] / "src"), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_every_triton_kernel_compiles_for_sm90(compiled):
    found = compiled
    assert sorted(found["kernels"]) == found["defined"], "sm90_compile.KERNELS must name every kernel defined"
    failed = {name: result["error"] for name, result in found["kernels"].items() if result["error"]}
    assert not failed, "\n\n".join(f"{name}:\n{error}" for name, error in failed.items())
    failed = {name: result["error"] for name, result in found["variants"].items() if result["error"]}
    assert not failed, "\n\n".join(f"{name}:\n{error}" for name, error in failed.items())
    too_big = {name: result["shared"] for name, result in (*found["kernels"].items(), *found["variants"].items())
               if result["shared"] > SHARED_MEMORY_PER_BLOCK}
    assert not too_big, f"shared memory per block above {SHARED_MEMORY_PER_BLOCK} bytes: {too_big}"
    assert len(found["kernels"]) >= 15


def test_shadowkv_reads_and_writes_its_pointer_table_tensors_in_vector_accesses(compiled):
    """A pointer loaded from memory has no known alignment, so without `table_pointer`'s
    hint (pointer_table.py) every bf16 of a key or value row moves in a 2-byte access of its
    own: 66 such loads in the attention kernel at these shapes, and 2-byte stores in the key
    rebuild and value writes. With it, the rows move in 16-byte accesses; what stays 2-byte
    is the step's own token (a [head_dim] row: one element per thread)."""
    found = compiled["kernels"]
    widths = {name.rsplit(".", 1)[1]: found[name]["widths"] for name in found}
    attention = widths["_attention_kernel"]
    assert attention.get("ld2", 0) <= 2 and attention.get("st2", 0) <= 2 and attention.get("ld16", 0) >= 2, attention
    for kernel in ("_rebuild_kernel", "_values_kernel", "_values_in_place_kernel"):
        assert widths[kernel].get("st2", 0) == 0 and widths[kernel].get("st16", 0) >= 1, (kernel, widths[kernel])
    # the in-place value read takes its rows from host memory at an address it is given
    in_place = widths["_values_in_place_kernel"]
    assert in_place.get("ld2", 0) == 0 and in_place.get("ld16", 0) >= 1, in_place


def test_paged_decode_kernels_read_their_pages_in_vector_accesses(compiled):
    """The decode kernels of `full` and KIVI (and the fused RMSNorm, RoPE and SiLU), compiled as a launch at Llama-3.1-8B's shapes
    specialises them: key and value rows move in 8- and 16-byte accesses (loads, or the
    asynchronous copies of a pipelined loop). KIVI's tiles are aligned to its pages, so a
    channel's 2-bit key codes of a tile are 8 consecutive bytes and a token's value codes 32;
    reading them per element took 64 one-byte loads, and each channel gathering its value
    scale 64 two-byte loads. What stays 2-byte is the step's own token and KIVI's key
    scales ([head_dim] rows: one element per thread)."""
    found = compiled["kernels"]
    widths = {name.rsplit(".", 1)[1]: found[name]["widths"] for name in found}
    kivi, full = widths["_kivi_decode_kernel"], widths["_paged_decode_kernel"]
    assert kivi.get("ld1", 0) == 0 and kivi.get("ld2", 0) <= 6 and kivi.get("cp16", 0) >= 8, kivi
    assert full.get("ld2", 0) <= 2 and full.get("cp16", 0) >= 8, full
    for kernel in ("_rms_norm_kernel", "_rope_kernel", "_gate_mul_kernel",  # the fused layer ops: rows only
                   "_rope_store_kernel"):
        assert widths[kernel].get("ld2", 0) == widths[kernel].get("st2", 0) == 0, (kernel, widths[kernel])

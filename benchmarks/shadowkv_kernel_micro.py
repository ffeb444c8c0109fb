"""Where ShadowKV's fused CPU decode step spends its time, per phase, at a long context:
selection (landmark scores + top-k), rebuild, fetch and attention, in thread-ms per
(sequence, KV head) pair and layer, from the kernel's own counters.

    python benchmarks/shadowkv_kernel_micro.py [--context 32704] [--batch 4] [--threads 1]
        [--repeats 15] [--baseline-source OLD.cpp] [--json PATH]

Geometry defaults to gemma3-270m's global layers (1 KV head, 4 query heads, head_dim 256),
with its ShadowKV defaults at 32K: rank 150 (energy 0.999 gives 110-190), 48 outlier
chunks, a budget of 512 tokens (64 chunks of 8). Sequences are compressed from random keys
and values by the method's own `compress_layer`; each of `--layers` layers has its own
chunk store, so landmarks come from memory as in a real step (4 MiB per sequence and layer
at 32K: 48 MiB over the default 4 sequences and 3 layers, more than this machine's 32 MiB L3). After one step to fill the reuse slots, every call selects the same chunks (all
hits): the steps time selection and attention, which every decode step pays.

`--baseline-source` also times another version of `cache/shadowkv/cpu_decode.cpp` (e.g.
`git show HEAD~1:src/kvforge/cache/shadowkv/cpu_decode.cpp > /tmp/old.cpp`), built under a
renamed operator namespace; both are called in turn on the same inputs, so a load change
on the shared machine hits both alike, and their outputs are checked equal.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvforge.cache.shadowkv.compress import compress_layer
from kvforge.cache.shadowkv.cpu_decode import cpu_shadowkv_kernel_available
from kvforge.cache.shadowkv.sparse import SparseAttention, SparseGroup
from kvforge.cache.shadowkv.state import CompressedSequence, buffer_rows
from kvforge.cache.shadowkv.stats import ShadowKVStats
from kvforge.cache.shadowkv.store import ChunkStore
from kvforge.config import RopeConfig
from kvforge.kernels.build import CppKernel
from kvforge.rope import RotaryEmbedding

PHASES = ("selection", "rebuild", "fetch", "attention")
WINDOW = 288  # local 32 + generated_window 256: the defaults' exact tail capacity


def baseline_op(path: Path) -> Callable[..., Any]:
    """The kernel of another version of the source, under the namespace kvforge_cpu_shadowkv_baseline."""
    text = re.sub(r"\bkvforge_cpu_shadowkv\b", "kvforge_cpu_shadowkv_baseline", path.read_text(encoding="utf-8"))
    copy = Path(tempfile.mkdtemp()) / "cpu_decode_baseline.cpp"
    copy.write_text(text, encoding="utf-8")
    kernel = CppKernel(name="kvforge_cpu_shadowkv_baseline", source=copy, namespace="kvforge_cpu_shadowkv_baseline",
                       op="shadowkv_decode", what="baseline ShadowKV kernel", fallback="nothing")
    assert kernel.available(), "the baseline source did not build"
    return torch.ops.kvforge_cpu_shadowkv_baseline.shadowkv_decode


def compressed_layers(options: argparse.Namespace) -> list[tuple[SparseAttention, list[CompressedSequence]]]:
    """Per layer: its chunk store and the batch's compressed sequences (random keys with a
    shared direction, so landmarks differ in scale as real ones do)."""
    generator = torch.Generator().manual_seed(options.seed)
    rope = RotaryEmbedding(options.dim, RopeConfig(theta=10000.0)).at(torch.arange(1), torch.float32)
    chunk, heads, dim = options.chunk, options.kv_heads, options.dim
    count = (options.context - options.local) // chunk
    layers = []
    for _ in range(options.layers):
        store = ChunkStore(1, heads, dim, chunk, count * options.batch, torch.float32, torch.device("cpu"), "memory",
                           None)
        states = []
        for b in range(options.batch):
            base = torch.randn(heads, 1, dim, generator=generator)
            keys = base + torch.randn(heads, options.context, dim, generator=generator)
            values = torch.randn(heads, options.context, dim, generator=generator)
            layer, data = compress_layer(keys, values, rope, count * chunk, lambda _: options.rank, chunk,
                                         options.outliers, WINDOW, options.budget // chunk, torch.float16)
            table = torch.arange(b * count, (b + 1) * count)
            store.write(0, table, data.landmarks, data.values)
            outliers = layer.outliers.shape[1]
            states.append(CompressedSequence(
                pages=table.tolist(), page_table=table, window=options.context - count * chunk,
                chunks_per_step=options.budget // chunk, num_outliers=outliers,
                slots_start=buffer_rows(outliers, chunk, WINDOW, options.budget // chunk)[0], fixed_bytes=0,
                layers=[layer]))
        layers.append((SparseAttention(store, chunk, ShadowKVStats(), reuse=True, device=torch.device("cpu"),
                                       kernel=True), states))
    return layers


def captured_calls(options: argparse.Namespace) -> list[tuple[Any, ...]]:
    """The kernel's arguments of one decode step per layer, as SparseAttention passes them
    (the step's own token already in the buffers); one step is run first to fill the slots."""
    calls: list[tuple[Any, ...]] = []
    op = torch.ops.kvforge_cpu_shadowkv.shadowkv_decode

    def record(*args: Any) -> Any:
        calls.append(args)
        return op(*args)

    generator = torch.Generator().manual_seed(options.seed + 1)
    heads = options.kv_heads * options.group
    q = torch.randn(options.batch, 1, heads, options.dim, generator=generator)
    own = torch.randn(options.batch, 1, options.kv_heads, options.dim, generator=generator)
    rope = RotaryEmbedding(options.dim, RopeConfig(theta=10000.0)).at(torch.arange(1), torch.float32)
    for sparse, states in compressed_layers(options):
        group = SparseGroup.build(states, list(range(options.batch)), 1, True, options.chunk, torch.device("cpu"),
                                  True)
        sparse.attend(0, group, q, own, own, rope, options.dim ** -0.5)  # fills the reuse slots
        torch.ops.kvforge_cpu_shadowkv.shadowkv_decode = record  # type: ignore[attr-defined]
        try:
            sparse.attend(0, group, q, own, own, rope, options.dim ** -0.5)
        finally:
            torch.ops.kvforge_cpu_shadowkv.shadowkv_decode = op  # type: ignore[attr-defined]
    return calls


def measure(ops: dict[str, Callable[..., Any]], calls: list[tuple[Any, ...]], repeats: int
            ) -> dict[str, dict[str, float]]:
    """Median thread-ms per (sequence, KV head) pair and layer of each phase. Each op runs
    over every layer's arguments in turn (the layers together exceed the last-level cache,
    so no op reads landmarks another op just brought in), the op that goes first rotating
    from one repeat to the next; outputs are checked equal between ops."""
    pairs = calls[0][0].shape[0] * calls[0][1].shape[0]
    names = list(ops)
    samples: dict[str, dict[str, list[float]]] = {name: {p: [] for p in PHASES} for name in names}
    for repeat in range(repeats):
        outputs: dict[str, list[torch.Tensor]] = {}
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            outputs[name] = []
            for args in calls:
                out, counters = ops[name](*args)
                outputs[name].append(out)
                totals = counters.sum(dim=0).tolist()
                for index, phase in enumerate(PHASES):
                    samples[name][phase].append(totals[2 + index] * 1e3 / pairs)
        for name in names[1:]:
            for mine, first in zip(outputs[name], outputs[names[0]]):
                torch.testing.assert_close(mine, first, rtol=1e-5, atol=1e-5, msg=f"{name} differs")
    return {name: {p: statistics.median(v) for p, v in phases.items()} for name, phases in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32704)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=3, help="layers, each with its own store (gemma3: 3 global)")
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--rank", type=int, default=150)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--outliers", type=int, default=48)
    parser.add_argument("--budget", type=int, default=512, help="selected tokens per KV head")
    parser.add_argument("--local", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-source", default=None, help="another cache/shadowkv/cpu_decode.cpp to time too")
    parser.add_argument("--json", default=None, help="write the medians here")
    options = parser.parse_args()
    assert cpu_shadowkv_kernel_available(), "the CPU ShadowKV kernel did not build"
    torch.set_num_threads(options.threads)
    ops: dict[str, Callable[..., Any]] = {"current": torch.ops.kvforge_cpu_shadowkv.shadowkv_decode}
    if options.baseline_source:
        ops["baseline"] = baseline_op(Path(options.baseline_source))
    calls = captured_calls(options)
    medians = measure(ops, calls, options.repeats)
    print(f"thread-ms per (sequence, KV head) pair and layer, median of {options.repeats} x {len(calls)} calls; "
          f"context {options.context}, batch {options.batch}, D {options.dim}, group {options.group}, "
          f"{options.threads} thread(s)")
    print(f"{'kernel':<10}" + "".join(f"{p:>11}" for p in PHASES) + f"{'total':>11}")
    for name, phases in medians.items():
        print(f"{name:<10}" + "".join(f"{phases[p]:>11.4f}" for p in PHASES) + f"{sum(phases.values()):>11.4f}")
    if options.json:
        Path(options.json).write_text(json.dumps({"settings": vars(options), "thread_ms_per_pair": medians},
                                                 indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

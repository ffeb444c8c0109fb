"""Does this CPU overlap memory reads with the arithmetic of kvforge's decode kernels?

    python benchmarks/overlap_probe.py [--threads 2] [--rounds 7] [--json OUT]

A decode step can reach its read-bandwidth roofline only if each kernel's loads stream while
it computes: time = max(compute, memory). If they do not overlap, time = compute + memory,
and the roofline fraction is capped below 1 by the kernels' own arithmetic. For each case
this measures, alternated round by round (medians):

- `cache`: the kernel on data that stays in the caches (the same weights, or the same KV
  layer, used again and again): its compute time alone;
- `stream`: the same work on data far larger than the caches, each byte read once: compute
  plus whatever memory time is not hidden;
- `memory`: the streamed bytes over the read bandwidth measured in the same rounds
  (`torch.sum` over 256 MiB, as `kvforge bench` probes it).

`overlap` = (cache + memory - stream) / min(cache, memory): 1 when the stream costs
max(compute, memory), 0 when it costs their sum (below 0: worse than serial).
`stream/cache` needs no bandwidth probe: how much slower the kernel runs from memory than
from the caches (the probe itself moved between 28 and 51 GB/s within minutes here). Cases: the
small-M bf16 linear at M = 1, 4, 8, 16 rows over smollm2-135m's [3072, 576]-sized weights,
and the bf16 paged attention of a batch of 16 x 1,024 tokens (smollm2-135m's heads).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode_attention import make_case  # noqa: E402

from kvforge.cache.full.cpu_decode import cpu_kernels_available, paged_decode_attention_cpu  # noqa: E402
from kvforge.kernels import cpu_linear  # noqa: E402
from kvforge.tools.bench.peak import READ_BYTES  # noqa: E402
from kvforge.tools.report.provenance import provenance  # noqa: E402

HIDDEN = 576
STREAM_MATRICES = 24  # 24 x [3072, 576] bf16 = 85 MB, well past a 32 MB last-level cache
CACHE_ROWS = 1536  # [1536, 576] bf16 = 1.8 MB: about 0.9 MB a core on two cores
LAYERS = 30


def linear_cases(rows: int) -> tuple[Callable[[], object], Callable[[], object], int]:
    """(streamed call, in-cache call with the same arithmetic, bytes the streamed call reads)."""
    x = torch.randn(rows, HIDDEN).to(torch.bfloat16)
    streamed = [torch.randn(3072, HIDDEN).to(torch.bfloat16) for _ in range(STREAM_MATRICES)]
    cached = torch.randn(CACHE_ROWS, HIDDEN).to(torch.bfloat16)
    op = torch.ops.kvforge_cpu_linear.small_m_linear_many
    none = [None] * STREAM_MATRICES
    return (lambda: op(x, streamed, none), lambda: op(x, [cached] * (2 * STREAM_MATRICES), none + none),
            sum(w.numel() * w.element_size() for w in streamed))


def attention_cases() -> tuple[Callable[[], object], Callable[[], object], int]:
    """Batch 16 x 1,024 tokens, all 30 layers once (streamed: 377 MB), against the same calls
    on one layer whose 16 sequences all list the first sequence's pages (cached: 0.8 MB of
    pages, which the two cores' L2 caches hold; the same arithmetic and call overhead)."""
    c = make_case(16, 1024, 3, 9, 64, 16, LAYERS, torch.bfloat16, "ascending")
    shared_table = c["table"][:1].expand_as(c["table"]).contiguous()

    def layer(i: int, table: torch.Tensor) -> None:
        paged_decode_attention_cpu(c["q"], c["k_self"], c["v_self"], c["k_store"][i], c["v_store"][i], table,
                                   c["first"], c["visible_from"], c["visible_to"], 0.125)

    def streamed() -> None:
        for i in range(LAYERS):
            layer(i, c["table"])

    def cached() -> None:
        for _ in range(LAYERS):
            layer(0, shared_table)
    store = c["k_store"]
    return streamed, cached, 2 * store.numel() * store.element_size()


def read_seconds_per_byte() -> Callable[[], float]:
    data = torch.ones(READ_BYTES // 4, dtype=torch.float32)

    def probe() -> float:
        start = time.perf_counter()
        data.sum()
        return (time.perf_counter() - start) / READ_BYTES
    return probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None, help="also write the table (and the load averages) to this file")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    load_before = os.getloadavg()
    assert cpu_linear.small_m_linear_available() and cpu_kernels_available(), "a CPU kernel did not build"
    cases = {f"linear M={m}": linear_cases(m) for m in (1, 4, 8, 16)}
    cases["attention B=16 x 1024"] = attention_cases()
    probe = read_seconds_per_byte()
    probe()
    for streamed, cached, _ in cases.values():  # warm-up: thread pool, allocator, kernel build
        streamed()
        cached()
    times: dict[str, dict[str, list[float]]] = {name: {"stream": [], "cache": []} for name in cases}
    per_byte: list[float] = []
    for r in range(options.rounds):
        per_byte.append(probe())
        names = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in names:
            streamed, cached, _ = cases[name]
            for kind, fn in (("stream", streamed), ("cache", cached)):
                start = time.perf_counter()
                fn()
                times[name][kind].append(time.perf_counter() - start)
    load_after = os.getloadavg()
    seconds_per_byte = statistics.median(per_byte)
    print(f"read bandwidth {1 / seconds_per_byte / 1e9:.1f} GB/s (median of {options.rounds} probes, "
          f"{options.threads} threads)")
    print(f"{'case':24s} {'cache ms':>9s} {'memory ms':>10s} {'stream ms':>10s} {'max':>7s} {'sum':>7s} "
          f"{'stream GB/s':>12s} {'overlap':>8s} {'stream/cache':>13s}")
    rows = []
    for name, (_, _, streamed_bytes) in cases.items():
        cache = statistics.median(times[name]["cache"])
        stream = statistics.median(times[name]["stream"])
        memory = streamed_bytes * seconds_per_byte
        overlap = (cache + memory - stream) / min(cache, memory)
        print(f"{name:24s} {cache * 1e3:9.2f} {memory * 1e3:10.2f} {stream * 1e3:10.2f} "
              f"{max(cache, memory) * 1e3:7.2f} {(cache + memory) * 1e3:7.2f} "
              f"{streamed_bytes / stream / 1e9:12.1f} {overlap:8.2f} {stream / cache:13.2f}")
        rows.append({"case": name, "cache_ms": cache * 1e3, "memory_ms": memory * 1e3, "stream_ms": stream * 1e3,
                     "stream_gbps": streamed_bytes / stream / 1e9, "overlap": overlap,
                     "stream_over_cache": stream / cache,
                     "stream_ms_all": [t * 1e3 for t in times[name]["stream"]],
                     "cache_ms_all": [t * 1e3 for t in times[name]["cache"]]})
    if options.json:
        Path(options.json).write_text(json.dumps({
            "benchmark": "overlap_probe", "threads": options.threads,
            "rounds": options.rounds, "read_gbps": 1 / seconds_per_byte / 1e9,
            "read_gbps_all": [1 / x / 1e9 for x in per_byte], "load_before": load_before,
            "load_after": load_after, "torch": torch.__version__, "rows": rows,
            "provenance": {**provenance(), "command": "python " + " ".join(shlex.quote(a) for a in sys.argv)}},
            indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Host time of what ShadowKV's Triton decode builds each step before its kernels run: the
pointer tables of every global layer (pointer_table.pointer_tables) and the padded chunk page
table (state.padded_page_tables), at a long-context serving shape (defaults: Llama-3.1-8B's
32 layers, 24 sequences of 32K tokens in chunks of 8). The tensors are CPU stand-ins: only
their addresses and sizes are read. The first call derives every row; later calls reuse them,
as steps do until a fold replaces a sequence's tensors.

    python benchmarks/shadowkv_pointer_tables.py [--layers 32] [--sequences 24] [--chunks 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvforge.cache.shadowkv.pointer_table import pointer_tables
from kvforge.cache.shadowkv.state import CompressedSequence, LayerState, padded_page_tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--sequences", type=int, default=24)
    parser.add_argument("--chunks", type=int, default=4096, help="chunk pages per sequence")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    heads, batch = args.kv_heads, args.sequences

    def small(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    layers = [[LayerState(basis=small(4, heads * 8), coefficients=small(2, 8, 4),
                          outliers=small(heads, 1, dtype=torch.long), keys=small(heads, 4, 8),
                          values=small(heads, 4, 8), slot_ids=small(heads, 2, dtype=torch.long),
                          candidates=small(heads, 2, dtype=torch.bool)) for _ in range(batch)]
              for _ in range(args.layers)]
    sequences = [CompressedSequence(pages=list(range(b * args.chunks, (b + 1) * args.chunks)), page_table=small(0),
                                    window=0, chunks_per_step=1, num_outliers=0, slots_start=0, fixed_bytes=0)
                 for b in range(batch)]
    meta = torch.zeros((batch, 3), dtype=torch.long)
    for name, build in (("pointer tables", lambda: pointer_tables(layers, meta)),
                        ("page table", lambda: padded_page_tables(sequences, batch, args.chunks))):
        start = time.perf_counter()
        build()
        first = time.perf_counter() - start
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            build()
            times.append(time.perf_counter() - start)
        print(f"{name}: first {first * 1e3:.2f} ms, then median {statistics.median(times) * 1e3:.2f} ms "
              f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}; {args.layers} layers x {batch} sequences, "
              f"{args.chunks} chunks each)")


if __name__ == "__main__":
    main()

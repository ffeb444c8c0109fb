"""Random inputs of batched paged decode attention, shared by the tests of its paths."""

from __future__ import annotations

import torch


def make_case(lengths: list[int], kv_heads: int, group: int, dim: int, block: int = 4,
              storage: torch.dtype = torch.float32, window: int | None = None, padding: int = 2,
              seed: int = 0) -> dict:
    """Random decode inputs. Storage is the view store[1] of a 5-D [layers, kv_heads, pages,
    block, dim] tensor, like FullCache's. With a window, sequence b keeps only pages from
    the one holding position lengths[b] - window + 1 (first_page_position > 0), and sees
    positions from there; every table row gets `padding` extra random (valid) page ids."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // block) for n in lengths) + 8
    shape = (3, kv_heads, num_pages, block, dim)
    k_store = torch.randn(shape, generator=gen).to(storage)
    v_store = torch.randn(shape, generator=gen).to(storage)
    pages = torch.randperm(num_pages, generator=gen).tolist()
    tables, first, visible_from = [], [], []
    for n in lengths:
        start = 0 if window is None else max(0, n - window + 1)
        first_page = start // block
        needed = -(-n // block) - first_page
        tables.append([pages.pop() for _ in range(max(0, needed))])
        first.append(first_page * block)
        visible_from.append(start)
    width = max(len(t) for t in tables) + padding
    table = [t + torch.randint(num_pages, (width - len(t),), generator=gen).tolist() for t in tables]
    batch, heads = len(lengths), kv_heads * group
    return dict(
        q=torch.randn(batch, heads, dim, generator=gen), k_self=torch.randn(batch, kv_heads, dim, generator=gen),
        v_self=torch.randn(batch, kv_heads, dim, generator=gen), k_pages=k_store[1], v_pages=v_store[1],
        page_table=torch.tensor(table, dtype=torch.long).reshape(batch, width),
        first_page_position=torch.tensor(first), visible_from=torch.tensor(visible_from),
        visible_to=torch.tensor(lengths), scale=dim ** -0.5)

"""Chunk reuse of one layer of a sparse group: which picks hit a reuse slot, which slots
the misses go to, and the one copy to the host that the value fetch needs.

Shared by the PyTorch path (sparse.py) and the Triton path (`SparseAttention._attend_triton`): both place
misses exactly alike, so their slot ids agree step after step. Every tensor has a shape
fixed by the group (B sequences, H KV heads, `slots` = the group's largest k), so nothing
here waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.host_sync import HostCopy


@dataclass(frozen=True)
class SlotMatch:
    new_ids: torch.Tensor  # [B, H, slots] chunk of each slot after the step, -1: none selected in it
    filled: torch.Tensor  # [B, H, slots] slots that receive a miss
    # [B x H x slots] flat slot indices (b x H + h) x slots + j, slots receiving a miss first,
    # in (sequence, head, slot) order: the order of the fetched values.
    order: torch.Tensor
    # miss and hit counts, then the head and the page of every slot in `order`
    to_host: HostCopy

    @property
    def total(self) -> int:
        return self.new_ids.numel()


def match_slots(held: torch.Tensor, picks: torch.Tensor, valid: torch.Tensor, table: torch.Tensor,
                reuse: bool) -> SlotMatch:
    """held [B, H, slots] chunk ids in the slots (-1 empty, -2 beyond a sequence's own k);
    picks/valid [B, H, k'] this step's chunks (best first); table [B, Cmax] page ids.

    A valid pick already held is a hit and stays in its slot; misses go to the free slots
    (not kept, within the sequence's k) in order: the r-th miss of a (sequence, head) takes
    its r-th free slot. Without `reuse` every pick is a miss."""
    batch, heads, slots = held.shape
    if not reuse:
        held = held.clamp(max=-1)  # forget everything: every pick is a miss
    same = (picks[..., :, None] == held[..., None, :]) & valid[..., :, None]  # [B, H, k', slots]
    hit = same.any(dim=-1)
    kept = same.any(dim=-2)  # slots holding a chunk picked again
    miss = valid & ~hit
    free = ~kept & (held > -2)
    free_order = torch.argsort((~free).to(torch.int8), dim=-1, stable=True)
    rank = (miss.cumsum(dim=-1) - 1).clamp(min=0)
    # Picks that are not misses write into a spare column past the slots, which is dropped.
    target = torch.where(miss, free_order.gather(-1, rank), slots)  # [B, H, k']
    spare = held.new_full((batch, heads, 1), -1)
    new_ids = torch.cat((held.masked_fill(~kept, -1), spare), dim=-1).scatter_(-1, target, picks)[..., :slots]
    filled = new_ids.new_zeros((batch, heads, slots + 1), dtype=torch.bool)
    filled = filled.scatter_(-1, target, miss)[..., :slots]
    pages = table.gather(1, new_ids.clamp(min=0).reshape(batch, -1)).view(batch, heads, slots)
    order = torch.argsort((~filled).reshape(-1).to(torch.int8), stable=True)
    head_of = torch.arange(heads, device=picks.device)[None, :, None].expand(batch, heads, slots)
    counts = torch.stack((miss.sum(), hit.sum()))
    to_host = HostCopy(torch.cat((counts, head_of.reshape(-1)[order], pages.view(-1)[order])))
    return SlotMatch(new_ids, filled, order, to_host)


def miss_pairs(host: list[int], misses: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(heads, pages) of the misses from the host copy of a `SlotMatch`, as host tensors."""
    return torch.tensor(host[2:2 + misses]), torch.tensor(host[2 + total:2 + total + misses])

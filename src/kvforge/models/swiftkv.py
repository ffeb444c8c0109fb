"""SwiftKV (Qiao et al., Snowflake): SingleInputKV + AcrossKV on any kvforge decoder.

`SwiftKVForCausalLM` is mixed into an architecture's CausalLM (`LlamaSwiftKVForCausalLM`,
`Gemma3SwiftKVForCausalLM`), which supplies its layers, norms and embedding.

With l = `num_key_value_layers` and g = `key_value_group_size`:
- layers < l are the architecture's ordinary layers and run on every token of the step;
- then `x = norm_swiftkv(h)` and ONE fused GEMM gives the K/V of every group leader
  (later layers l, l + g, ...) from x; the cache stores them in the leader's cache layer;
- the hidden states are cut down to the rows that need logits, and layers >= l run only
  on those rows: queries from `q_proj_swiftkv`, attention over the group's cache layer,
  o_proj and MLP as usual. They have no K/V projection of their own.
A prompt chunk that does not end its prompt therefore costs only the first l layers plus
the K/V GEMM. Parameter names follow the authors' checkpoints (`model.norm_swiftkv`,
`self_attn.q_proj_swiftkv`, leaders' `self_attn.k_proj_swiftkv`/`v_proj_swiftkv`).
With QK-norm (Gemma3) each later layer's `q_norm` normalises its queries and each leader's
`k_norm` its group's keys; `norm_swiftkv` is the architecture's norm (Gemma: (1 + w)).
Each group keeps its leader's attention kind: window and RoPE (all of a group's layers are
of one kind, `SwiftKVConfig.check_layer_types`).

Invariant: the cache layer of a group is written (by the fused GEMM) before any later
layer of the step attends to it, and later layers attend only for `batch.logit_rows`.

Early exit (paper App. E, off unless `early_exit_threshold` is set on a model with an
early-exit head): a decode row whose early-exit distribution, from the input of layer l,
has a top probability >= the threshold takes those logits and skips the later layers. Its
later-layer K/V are already cached (SingleInputKV computes them from the same input), so
the sequences that follow are unaffected in structure. Prompt rows never exit early.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvforge.batch import ForwardBatch
from kvforge.cache.base import CacheMethod, StepMetadata
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.config import ModelConfig, SwiftKVConfig
from kvforge.errors import require
from kvforge.kernels.cpu_linear import linear
from kvforge.models.causal_lm import CausalLM
from kvforge.models.layers import GemmaRMSNorm
from kvforge.rope import PositionedRope


class SwiftKVAttention(nn.Module):
    """Attention of a later layer: its own queries, its group's cache layer for K/V.

    With QK-norm (`config.qk_norm`: Gemma3) it keeps the layer's `q_norm`, and a
    leader its `k_norm`, applied to its group's keys (`norm_keys`) by the model's fused K/V
    write; a non-leader has no `k_norm` (its keys are its leader's)."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c, swift = config, config.swiftkv
        leader = swift.is_leader(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.cache_layer = swift.cache_layer_of(layer)
        kw = dict(dtype=dtype, device=device)
        self.q_proj_swiftkv = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias, **kw)
        if leader:  # applied by the model's fused K/V GEMM, not here
            kv = c.num_kv_heads * c.head_dim
            self.k_proj_swiftkv = nn.Linear(c.hidden_size, kv, bias=c.attention_bias, **kw)
            self.v_proj_swiftkv = nn.Linear(c.hidden_size, kv, bias=c.attention_bias, **kw)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_out_bias, **kw)
        qk_norm = c.qk_norm
        self.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps, **kw) if qk_norm else None
        self.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps, **kw) if qk_norm and leader else None

    def norm_keys(self, k: torch.Tensor) -> torch.Tensor:
        """A leader's keys [rows, kv_heads, head_dim] as its group's cache stores them."""
        return self.k_norm(k) if self.k_norm is not None else k

    def forward(self, x: torch.Tensor, cache: CacheMethod, meta: StepMetadata, rope: PositionedRope,
                rows_rope: PositionedRope, rows: torch.Tensor) -> torch.Tensor:
        """x: the rows `rows` of the step only (its logit rows, less early exits); `rope`
        covers the whole step, `rows_rope` those rows."""
        n = x.shape[0]
        q = linear(x, self.q_proj_swiftkv.weight, self.q_proj_swiftkv.bias).view(n, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        out = cache.attend_rows(self.cache_layer, meta, rows_rope.apply(q), rope, rows)
        return linear(out.reshape(n, self.num_heads * self.head_dim), self.o_proj.weight, self.o_proj.bias)


@dataclass
class EarlyExitCounts:
    """Decode rows that were offered the early exit, and those that took it."""

    decode_rows: int = 0
    exited: int = 0

    def add(self, rows: int, exited: int) -> None:
        self.decode_rows += rows
        self.exited += exited


@dataclass(frozen=True)
class _EarlyExits:
    """The logit rows of one step split into early exits and rows that go on."""

    num_rows: int
    kept: torch.Tensor  # [K] indices into the logit rows that run the later layers
    exited: torch.Tensor  # [E] indices of the rows that exit
    exit_logits: torch.Tensor  # [E, vocab]
    candidates: torch.Tensor  # [C] the decode rows among the logit rows (E of them exit)
    top: torch.Tensor  # [C] early-exit top probability of each candidate
    early_argmax: torch.Tensor  # [C]

    def merge(self, kept_logits: torch.Tensor) -> torch.Tensor:
        if not self.exited.numel():
            return kept_logits
        out = kept_logits.new_empty((self.num_rows, kept_logits.shape[-1]))
        out[self.kept] = kept_logits
        out[self.exited] = self.exit_logits.to(out.dtype)
        return out


class SwiftKVForCausalLM(CausalLM):
    """The SwiftKV wiring, mixed in before an architecture's CausalLM (which supplies
    `make_norm`, `embed` and, through `make_base_layer`, its decoder layers)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if config.swiftkv is None:
            raise ValueError(f"{type(self).__name__} needs config.swiftkv")
        super().__init__(config, dtype=dtype, device=device)
        self.model.norm_swiftkv = self.make_norm(config.hidden_size, dtype, device)
        if config.swiftkv.early_exit_head:
            self.model.early_exit_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False, dtype=dtype,
                                                   device=device)
        self._fused_kv: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None
        # Early exit at decode: None (off) or the top-probability threshold; and what it did.
        # A list in `early_exit_probe` collects, for every decode row, (early top probability,
        # early argmax, final argmax); with threshold None nothing exits while it observes.
        self.early_exit_threshold: float | None = None
        self.early_exit_counts = EarlyExitCounts()
        self.early_exit_probe: list[tuple[float, int, int]] | None = None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> SwiftKVForCausalLM:
        # The fused K/V weight is a copy of the leaders' projections: a move or cast makes it
        # stale (and a freed weight's address may be reused, fooling the version key), so drop it.
        self._fused_kv = None
        return super()._apply(fn, recurse)

    @property
    def swiftkv(self) -> SwiftKVConfig:
        return self.config.swiftkv

    def make_layer(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        if not self.config.swiftkv.is_later(layer):
            return super().make_layer(layer, dtype, device)
        attention = SwiftKVAttention(self.config, layer, dtype, device)
        return self.make_base_layer(layer, dtype, device, attention)

    @abstractmethod
    def make_base_layer(self, layer: int, dtype: torch.dtype, device: torch.device | str,
                        attention: nn.Module) -> nn.Module:
        """The architecture's decoder layer `layer` with `attention` as its self_attn."""

    @classmethod
    def layout_for(cls, config: ModelConfig) -> CacheLayout:
        """l + (L - l) / g cache layers: AcrossKV groups share one (the memory saving)."""
        swift = config.swiftkv
        owners: dict[int, int] = {}  # cache layer -> first model layer reading it
        for layer in range(config.num_layers):
            owners.setdefault(swift.cache_layer_of(layer), layer)
        specs = [CacheLayerSpec(config.num_kv_heads, config.head_dim, config.attention_scale,
                                config.window_of(owners[c])) for c in range(len(owners))]
        return CacheLayout(tuple(swift.cache_layer_of(i) for i in range(config.num_layers)), tuple(specs))

    # -- forward ----------------------------------------------------------------------
    def decode_reads_nothing_on_host(self) -> bool:
        return self.early_exit_threshold is None and self.early_exit_probe is None

    def forward_step(self, cache: CacheMethod, meta: StepMetadata) -> torch.Tensor:
        batch = meta.batch
        first_later = self.swiftkv.num_key_value_layers
        hidden = self.embed(batch.token_ids)
        ropes = [rotary.at(batch.positions, hidden.dtype) for rotary in self.rotaries]
        layers = self.model.layers
        # The earlier layers are the architecture's own (fused where the family can).
        hidden = self.run_layers(hidden, cache, meta, ropes, 0, first_later)
        if first_later < len(layers):
            self._write_later_kv(hidden, cache, meta, ropes)
            hidden = hidden[batch.logit_rows]
            watching = self.early_exit_threshold is not None or self.early_exit_probe is not None
            exits = self._early_exits(hidden, batch) if watching else None
            rows = batch.logit_rows
            if exits is not None and exits.exited.numel():
                hidden, rows = hidden[exits.kept], rows[exits.kept]
            start = first_later
            if not watching:  # early exit keeps the eager layers (its rows are chosen per step on the host)
                hidden, done = self.fused_later_layers(hidden, cache, meta, ropes, start)
                start += done
            if hidden.shape[0] and start < len(layers):
                rows_positions = batch.positions[rows]
                rows_ropes = [rotary.at(rows_positions, hidden.dtype) for rotary in self.rotaries]
                for index in range(start, len(layers)):
                    r = self.rope_index[index]
                    hidden = layers[index](hidden, cache, meta, ropes[r], rows_ropes[r], rows)
            logits = self.logits(hidden)
            if exits is not None:
                logits = exits.merge(logits)
                if self.early_exit_probe is not None:
                    final = logits[exits.candidates].argmax(dim=-1)
                    self.early_exit_probe.extend(zip(exits.top.tolist(), exits.early_argmax.tolist(),
                                                     final.tolist()))
        else:
            logits = self.logits(hidden[batch.logit_rows])
        return logits

    def fused_later_layers(self, hidden: torch.Tensor, cache: CacheMethod, meta: StepMetadata,
                           ropes: list[PositionedRope], start: int) -> tuple[torch.Tensor, int]:
        """(hidden after the later layers from `start` that one fused op computed, their
        number); hidden: the step's logit rows, their K/V already stored. The default fuses
        none; a family with a fused path overrides this (bitwise what the layers compute)."""
        del cache, meta, ropes, start
        return hidden, 0

    # -- early exit -------------------------------------------------------------------
    def set_early_exit(self, threshold: float | None) -> None:
        """Exit decode rows whose early top probability is >= `threshold` (None: off)."""
        if threshold is not None:
            require(self.swiftkv.early_exit_head, "early_exit", threshold,
                    "needs a SwiftKV model with an early-exit head (distill one with --early-exit-head)")
            require(0.0 < threshold <= 1.0, "early_exit", threshold, "must be a probability in (0, 1]")
        self.early_exit_threshold = threshold

    def early_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the early-exit head for hidden states at the input of layer l:
        lm_head(final_norm(early_exit_proj(h)))."""
        return self.logits(self.model.early_exit_proj(hidden))

    def _early_exits(self, hidden: torch.Tensor, batch: ForwardBatch) -> _EarlyExits | None:
        """Which logit rows (decode rows only) exit early; None when none does and no probe
        observes."""
        decode_rows = {span.query_end - 1 for span in batch.spans if span.decode}
        logit_rows = batch.logit_row_list if batch.logit_row_list is not None else tuple(batch.logit_rows.tolist())
        candidates = [i for i, row in enumerate(logit_rows) if row in decode_rows]
        if not candidates:
            return None
        index = torch.tensor(candidates, device=hidden.device)
        early = self.early_logits(hidden[index])
        top = torch.softmax(early.float(), dim=-1).amax(dim=-1)
        if self.early_exit_threshold is None:  # observing only
            confident = torch.zeros_like(top, dtype=torch.bool)
        else:
            confident = top >= self.early_exit_threshold
        exited = confident.tolist()  # a host sync: the rows that go on are chosen on the host
        self.early_exit_counts.add(len(candidates), sum(exited))
        leaving = {c for c, e in zip(candidates, exited) if e}
        if not leaving and self.early_exit_probe is None:
            return None  # every row goes on: nothing to split or merge
        kept = [i for i in range(len(logit_rows)) if i not in leaving]
        return _EarlyExits(len(logit_rows), torch.tensor(kept, dtype=torch.long, device=hidden.device),
                           index[confident], early[confident], index, top, early.argmax(dim=-1))

    def _write_later_kv(self, hidden: torch.Tensor, cache: CacheMethod, meta: StepMetadata,
                        ropes: list[PositionedRope]) -> None:
        """SingleInputKV: every leader's K/V from norm_swiftkv(h_l), in one GEMM."""
        rows = hidden.shape[0]
        weight, bias = self.fused_kv_projection()
        kv = linear(self.model.norm_swiftkv(hidden), weight, bias)
        heads, dim = self.config.num_kv_heads, self.config.head_dim
        per_leader = kv.view(rows, -1, 2, heads, dim)
        for slot, leader in enumerate(self.swiftkv.leaders(self.config.num_layers)):
            k, v = self.model.layers[leader].self_attn.norm_keys(per_leader[:, slot, 0]), per_leader[:, slot, 1]
            cache.write(self.swiftkv.cache_layer_of(leader), meta, k, v, ropes[self.rope_index[leader]])

    def leader_attentions(self) -> list[SwiftKVAttention]:
        return [self.model.layers[i].self_attn for i in self.swiftkv.leaders(self.config.num_layers)]

    def prefill_linear_weights(self) -> list[torch.Tensor]:
        """A prompt runs the layers before l and the fused K/V GEMM over all its rows; the
        later layers' own projections see its logit rows only."""
        earlier = self.model.layers[:self.swiftkv.num_key_value_layers]
        weights = [module.weight for module in earlier.modules() if isinstance(module, nn.Linear)]
        if not self.leader_attentions():  # l = L: no later layer, no fused K/V GEMM
            return weights
        with torch.no_grad():  # the cached fused weight, which the engine's steps use
            return [*weights, self.fused_kv_projection()[0]]

    def fused_kv_projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[leaders x (k, v) x kv_heads x head_dim, hidden] weight (and bias) of the fused GEMM.

        Rebuilt whenever a projection changed (in-place version counters) and on every call
        while gradients flow (so training reaches the per-layer parameters)."""
        params = []
        for attn in self.leader_attentions():
            params += [attn.k_proj_swiftkv, attn.v_proj_swiftkv]
        tensors = [p.weight for p in params] + [p.bias for p in params if p.bias is not None]
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        key = tuple((t.data_ptr(), t._version) for t in tensors)
        if needs_grad:
            weight = torch.cat([p.weight for p in params], dim=0)
            return weight, torch.cat([p.bias for p in params]) if params[0].bias is not None else None
        if self._fused_kv is None or self._fused_kv[0] != key:
            # A normal (not inference-mode) tensor, so the cached copy stays usable outside
            # the engine's inference_mode too.
            with torch.inference_mode(False), torch.no_grad():
                weight = torch.cat([p.weight for p in params], dim=0)
                bias = torch.cat([p.bias for p in params]) if params[0].bias is not None else None
            self._fused_kv = (key, weight, bias)
        return self._fused_kv[1], self._fused_kv[2]

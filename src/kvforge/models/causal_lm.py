"""The decoder skeleton shared by every architecture: embed -> layers -> norm -> logits.

Parameter names mirror Hugging Face (`model.embed_tokens`, `model.layers.N...`,
`model.norm`, `lm_head`), so HF state dicts load by name. Subclasses supply the decoder
layer, the norm and the embedding scale.

`forward(batch, cache)` runs one engine step over a flattened batch of several sequences
and returns logits only for `batch.logit_rows` (the final norm and the vocabulary
projection, often the largest matmul, run on those rows only).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from kvforge.batch import ForwardBatch
from kvforge.cache.base import CacheMethod, StepMetadata
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.config import ModelConfig, RopeConfig
from kvforge.errors import ModelLoadError
from kvforge.kernels.cpu_prepack import drop_packed
from kvforge.kernels.vocab_logits import vocab_logits
from kvforge.rope import PositionedRope, RotaryEmbedding


class DecoderStack(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        kw = dict(dtype=dtype, device=device)
        embed = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        layers = [self.make_layer(i, dtype, device) for i in range(config.num_layers)]
        self.model = DecoderStack(embed, layers, self.make_norm(config.hidden_size, dtype, device))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **kw)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # One rotary table per distinct RoPE configuration (Gemma3: local and global).
        ropes: list[RopeConfig] = []
        self.rope_index: list[int] = []
        for layer in range(config.num_layers):
            rope = config.rope_of(layer)
            if rope not in ropes:
                ropes.append(rope)
            self.rope_index.append(ropes.index(rope))
        # A module list, so the tables follow `.to()` like the weights (they hold no state-dict key).
        self.rotaries = nn.ModuleList(RotaryEmbedding(config.head_dim, rope, device) for rope in ropes)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype, read from them so that it follows `.to(dtype)`."""
        return self.lm_head.weight.dtype

    # -- architecture hooks -----------------------------------------------------------
    @abstractmethod
    def make_layer(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        """Decoder layer `layer`, whose forward is (h, cache, meta, rope) -> h."""

    @abstractmethod
    def make_norm(self, dim: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module: ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    # -- cache ------------------------------------------------------------------------
    def cache_layout(self) -> CacheLayout:
        """The layout the engine's cache is built for: no sequence longer than the model's
        maximum length (LLM lowers it to an engine's `max_model_len`)."""
        return replace(self.layout_for(self.config), max_sequence_tokens=self.config.max_position_embeddings)

    @classmethod
    def layout_for(cls, config: ModelConfig) -> CacheLayout:
        """One cache layer per model layer (SwiftKV/AcrossKV models override this)."""
        specs = [CacheLayerSpec(config.num_kv_heads, config.head_dim, config.attention_scale,
                                config.window_of(layer)) for layer in range(config.num_layers)]
        return CacheLayout.one_per_layer(specs)

    # -- forward ----------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, cache: CacheMethod) -> torch.Tensor:
        meta = cache.begin_step(batch)
        logits = self.forward_step(cache, meta)
        cache.end_step(meta)
        return logits

    def forward_step(self, cache: CacheMethod, meta: StepMetadata) -> torch.Tensor:
        """The logits of `meta.batch`'s logit rows: the step between `begin_step` and
        `end_step`, which a static decode step runs on fixed buffers (engine/decode_graphs.py)."""
        batch = meta.batch
        hidden = self.embed(batch.token_ids)
        ropes = [rotary.at(batch.positions, hidden.dtype) for rotary in self.rotaries]
        hidden = self.run_layers(hidden, cache, meta, ropes, 0, len(self.model.layers))
        return self.logits(hidden[batch.logit_rows])

    def decode_reads_nothing_on_host(self) -> bool:
        """Whether `forward_step` of a decode-only step depends on no device value read on
        the host, so that a CUDA graph can capture it (SwiftKV's early exit cannot)."""
        return True

    def run_layers(self, hidden: torch.Tensor, cache: CacheMethod, meta: StepMetadata,
                   ropes: list[PositionedRope], start: int, stop: int) -> torch.Tensor:
        """Layers [start, stop) on every row of the step, one by one (families with a fused
        path override this and fall back to it)."""
        for index in range(start, stop):
            hidden = self.model.layers[index](hidden, cache, meta, ropes[self.rope_index[index]])
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # float32 logits, unrounded, whatever the model's dtype (kernels/vocab_logits.py): a
        # bf16 rounding would tie candidates the model ranks apart
        logits = vocab_logits(self.model.norm(hidden), self.lm_head.weight, self.lm_head.bias)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- weights ----------------------------------------------------------------------
    def prefill_linear_weights(self) -> list[torch.Tensor]:
        """The weights of the linear products a prefill step runs over all its rows, which the
        engine may prepack (kernels/cpu_prepack.py): every nn.Linear of the decoder layers. The
        vocabulary projection is left out: it runs on the logit rows only."""
        return [module.weight for module in self.model.layers.modules() if isinstance(module, nn.Linear)]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> CausalLM:
        # A move or cast replaces the weights' data: packed copies of the old data are stale
        # (they would not be used: cpu_prepack checks), so free them now.
        drop_packed(self.parameters())
        return super()._apply(fn, recurse)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors; every parameter must be present exactly once."""
        state = dict(state)
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expected = {name for name, _ in self.named_parameters()}
        missing = sorted(expected - state.keys())
        unexpected = sorted(state.keys() - expected)
        if missing or unexpected:
            raise ModelLoadError(
                f"checkpoint does not match {type(self).__name__}: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                f"{' ...' if len(unexpected) > 5 else ''}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(self.get_parameter(name).shape):
                raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, the model "
                                     f"expects {tuple(self.get_parameter(name).shape)}")
        self.load_state_dict(state, strict=False)

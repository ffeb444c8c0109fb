"""LlamaSwiftKVForCausalLM for vLLM: kvforge's SwiftKV (SingleInputKV + AcrossKV) on
vLLM's Llama layers. Imports vLLM; loaded lazily by vLLM's model registry.

One forward step, with l = num_key_value_layers and g = key_value_group_size:
1. layers 0 .. l-1 (vLLM's LlamaDecoderLayer) run on every token of the step;
2. x = norm_swiftkv(h) with h the output of layer l-1; ONE fused GEMM gives the K/V of
   every AcrossKV group leader from x; K gets RoPE; each group's K/V is written, for every
   token, into the cache of the group's owner attention (layout.py);
3. the rows that need logits are taken (vLLM's `kv_sharing_fast_prefill` metadata of the
   later layers names them; without it, all rows) and layers l .. L-1 run on those rows
   only: queries from `q_proj_swiftkv`, attention over the group's cache (the later
   layers' Attention shares the owner's cache and writes nothing), o_proj and the MLP;
4. the final norm of those rows is scattered back into the step's hidden states, which
   vLLM then indexes with the same logits indices.

Under vLLM's torch.compile (any run without enforce_eager) steps 1-2's layers and GEMM form
one compiled piece (`SwiftKVPrefix`) and step 3's layers another (`SwiftKVSuffix`), as vLLM
does for Gemma3n's YOCO halves; the cache writes, the row gather and the scatter run eagerly
between them.

Pipeline parallelism: a stage runs vLLM's split of the decoder layers. Only the last
stage holds later layers (layout.SwiftKVCacheLayout.pipeline_stage refuses other splits), so
it runs steps 2-4 on the (hidden states, residual) the previous stage handed on; an earlier
stage runs its early layers and hands those on, as vLLM's Llama does.

Invariants: the owners' caches are written (step 2) before any later layer attends
(step 3); rows that do not need logits never reach a later layer when fast prefill is on;
every SwiftKV tensor of the checkpoint is loaded (or belongs to another stage) or
`load_weights` raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from vllm.compilation.backends import set_model_tag
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_pp_group
from vllm.distributed.utils import get_pp_indices
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaMLP
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata

from kvforge.integrations.vllm.hf_config import swiftkv_of
from kvforge.integrations.vllm.layout import CACHE_OWNERS, SwiftKVCacheLayout, SwiftKVStage
from kvforge.integrations.vllm.weights import FUSED_KV, required_swiftkv_names, weight_target


def _attention_bias(config) -> bool:
    return bool(getattr(config, "attention_bias", False) or getattr(config, "bias", False))


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _last_stage_only(stage: SwiftKVStage, make: Callable[[], nn.Module]) -> nn.Module:
    """`make()` on the last pipeline stage, a PPMissingLayer (its tensors skipped) on another."""
    return make() if stage.is_last else PPMissingLayer()


def _pipeline_stage(layout: SwiftKVCacheLayout) -> SwiftKVStage:
    """This worker's stage of vLLM's layer split (the whole model without pipeline parallelism)."""
    group = get_pp_group()
    size, rank = group.world_size, group.rank_in_group
    start, end = get_pp_indices(layout.num_layers, rank, size)
    return layout.pipeline_stage(start, end, rank, size, get_pp_indices(layout.num_layers, size - 1, size)[0])


class SwiftKVCacheOwner(nn.Module):
    """Owns one AcrossKV group's cache layer. The model writes K/V into it; it never attends."""

    def __init__(self, config, cache_config: CacheConfig | None, prefix: str) -> None:
        super().__init__()
        head_dim = _head_dim(config)
        self.num_kv_heads, self.head_dim = config.num_key_value_heads, head_dim
        self.attn = Attention(config.num_attention_heads, head_dim, head_dim ** -0.5,
                              num_kv_heads=config.num_key_value_heads, cache_config=cache_config,
                              prefix=f"{prefix}.attn")

    def write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store [tokens, kv_heads * head_dim] K (RoPE applied) and V at this step's slots."""
        key = key.view(-1, self.num_kv_heads, self.head_dim)
        value = value.view(-1, self.num_kv_heads, self.head_dim)
        if self.attn.use_direct_call:
            unified_kv_cache_update(key, value, self.attn.layer_name)
        else:
            torch.ops.vllm.unified_kv_cache_update(key, value, _encode_layer_name(self.attn.layer_name))


class SwiftKVAttention(nn.Module):
    """Attention of a later layer: its own queries, its group's cache for K/V."""

    def __init__(self, config, cache_config: CacheConfig | None, kv_sharing_target: str, prefix: str) -> None:
        super().__init__()
        head_dim = _head_dim(config)
        self.num_heads = config.num_attention_heads
        bias = _attention_bias(config)
        self.q_proj_swiftkv = ColumnParallelLinear(config.hidden_size, self.num_heads * head_dim, bias=bias,
                                                   prefix=f"{prefix}.q_proj_swiftkv")
        self.o_proj = RowParallelLinear(self.num_heads * head_dim, config.hidden_size, bias=bias,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(head_dim, max_position=getattr(config, "max_position_embeddings", 8192),
                                   is_neox_style=True, rope_parameters=getattr(config, "rope_parameters", None))
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, num_kv_heads=config.num_key_value_heads,
                              cache_config=cache_config, prefix=f"{prefix}.attn",
                              kv_sharing_target_layer_name=kv_sharing_target)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, _ = self.q_proj_swiftkv(hidden_states)
        q, _ = self.rotary_emb(positions, q, None)
        output, _ = self.o_proj(self.attn(q, None, None))
        return output


class SwiftKVDecoderLayer(nn.Module):
    """A later layer; runs only on the rows that need logits."""

    def __init__(self, config, cache_config: CacheConfig | None, kv_sharing_target: str, prefix: str) -> None:
        super().__init__()
        self.self_attn = SwiftKVAttention(config, cache_config, kv_sharing_target, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                            hidden_act=config.hidden_act, bias=getattr(config, "mlp_bias", False),
                            prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0,
                                         "inputs_embeds": 0})
class SwiftKVPrefix(nn.Module):
    """Compiled piece: embeddings (first stage), this stage's layers < l, then on the last
    stage norm_swiftkv, the fused K/V GEMM and K's RoPE. Returns (layer l-1's output, K with
    RoPE, V), K and V [tokens, groups * kv_heads * head_dim], on the last stage; the
    (hidden states, residual) to hand on on an earlier one. Owns no parameters."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: LlamaSwiftKVModel) -> None:
        super().__init__()
        self._model = [model]  # boxed: the layers stay registered (and named) under the model only

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | IntermediateTensors:
        model = self._model[0]
        hidden_states, residual = model.stage_input(input_ids, intermediate_tensors, inputs_embeds)
        early = model.stage.early
        for layer in model.layers[early.start:early.stop]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not model.stage.is_last:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        if residual is not None:
            hidden_states = hidden_states + residual  # layer l-1's output
        kv, _ = model.swiftkv_kv_proj(model.norm_swiftkv(hidden_states))
        half = model.layout.num_groups * model.kv_size
        # all groups' K heads in one call (the returned tensor: in place or not, by backend)
        keys, _ = model.swiftkv_rotary_emb(positions, kv[:, :half], None)
        return hidden_states, keys, kv[:, half:]


@support_torch_compile(dynamic_arg_dims={"positions": 0, "hidden_states": 0})
class SwiftKVSuffix(nn.Module):
    """Compiled piece: layers >= l and the final norm, on the rows that need logits."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: LlamaSwiftKVModel) -> None:
        super().__init__()
        self._model = [model]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        model = self._model[0]
        residual = None
        for layer in model.layers[model.layout.first_later:]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = model.norm(hidden_states, residual)
        return hidden_states


class LlamaSwiftKVModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config = vllm_config.cache_config
        self.config = config
        self.swift = swiftkv_of(config)
        self.layout = SwiftKVCacheLayout(config.num_hidden_layers, self.swift, prefix=prefix)
        self.stage = stage = _pipeline_stage(self.layout)
        first_later = self.layout.first_later
        head_dim = _head_dim(config)
        self.kv_size = config.num_key_value_heads * head_dim

        # A module another stage holds is a PPMissingLayer: its checkpoint tensors are skipped.
        if stage.is_first or (config.tie_word_embeddings and stage.is_last):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = PPMissingLayer()
        # Creation order is the layout's invariant: early attentions, cache owners, later attentions.
        layers: list[nn.Module] = [LlamaDecoderLayer(vllm_config=vllm_config, prefix=f"{prefix}.layers.{i}")
                                   if stage.runs(i) else PPMissingLayer() for i in range(first_later)]
        owners = {self.layout.owner_module(j).rsplit(".", 1)[1]:
                  SwiftKVCacheOwner(config, cache_config, self.layout.owner_module(j))
                  for j in range(self.layout.num_groups) if stage.holds_later}
        setattr(self, CACHE_OWNERS, nn.ModuleDict(owners))
        layers += [SwiftKVDecoderLayer(config, cache_config, self.layout.kv_sharing_target(i),
                                       f"{prefix}.layers.{i}") if stage.runs(i) else PPMissingLayer()
                   for i in range(first_later, config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm_swiftkv = _last_stage_only(stage, lambda: RMSNorm(config.hidden_size, eps=config.rms_norm_eps))
        self.norm = _last_stage_only(stage, lambda: RMSNorm(config.hidden_size, eps=config.rms_norm_eps))
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size)
        self._later_attention_name = self.layout.layer_attention_name(first_later) if stage.holds_later else None
        if self.layout.num_groups:
            # Rows: K of every group, then V of every group (weights.fused_kv_block).
            self.swiftkv_kv_proj = _last_stage_only(stage, lambda: ReplicatedLinear(
                config.hidden_size, 2 * self.layout.num_groups * self.kv_size, bias=_attention_bias(config),
                prefix=FUSED_KV))
            self.swiftkv_rotary_emb = get_rope(head_dim, max_position=getattr(config, "max_position_embeddings", 8192),
                                               is_neox_style=True,
                                               rope_parameters=getattr(config, "rope_parameters", None))
            with set_model_tag("swiftkv_prefix"):
                self.prefix_runner = SwiftKVPrefix(vllm_config=vllm_config, prefix=f"{prefix}.prefix_runner",
                                                   model=self)
            if stage.holds_later:
                with set_model_tag("swiftkv_suffix"):
                    self.suffix_runner = SwiftKVSuffix(vllm_config=vllm_config, prefix=f"{prefix}.suffix_runner",
                                                       model=self)

    @property
    def cache_owners(self) -> list[SwiftKVCacheOwner]:
        return list(getattr(self, CACHE_OWNERS).values())

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def stage_input(self, input_ids: torch.Tensor | None, intermediate_tensors: IntermediateTensors | None,
                    inputs_embeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states, residual) this stage starts from: the embeddings on the first
        stage, what the previous stage handed on otherwise."""
        if self.stage.is_first:
            return (inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)), None
        assert intermediate_tensors is not None  # vLLM hands every later stage its predecessor's output
        return intermediate_tensors["hidden_states"], intermediate_tensors["residual"]

    def _logits_rows(self) -> tuple[torch.Tensor | None, int | None]:
        """(padded row indices, how many are real) of the rows needing logits this step, from
        the later layers' fast-prefill metadata; (None, None) means every row (dummy and
        profiling runs, fast prefill off)."""
        if self._later_attention_name is None or not is_forward_context_available():
            return None, None
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # speculative decoding: [0] is the base model's
            metadata = metadata[0] if metadata else None
        if not isinstance(metadata, dict):
            return None, None
        layer_metadata = metadata.get(self._later_attention_name)
        if not isinstance(layer_metadata, KVSharingFastPrefillMetadata):
            return None, None
        if layer_metadata.logits_indices_padded is None or layer_metadata.num_logits_indices is None:
            return None, None
        return layer_metadata.logits_indices_padded, int(layer_metadata.num_logits_indices)

    def _write_later_kv(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """SingleInputKV + AcrossKV: store every group's K (roped) and V for every token."""
        for group, owner in enumerate(self.cache_owners):
            block = slice(group * self.kv_size, (group + 1) * self.kv_size)
            owner.write(keys[:, block], values[:, block])

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        if self.layout.num_groups == 0:  # l = L: a plain Llama
            hidden_states, residual = self.stage_input(input_ids, intermediate_tensors, inputs_embeds)
            for layer in self.layers[self.stage.start:self.stage.end]:
                hidden_states, residual = layer(positions, hidden_states, residual)
            if not self.stage.is_last:
                return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
            hidden_states, _ = self.norm(hidden_states, residual)
            return hidden_states
        prefix = self.prefix_runner(input_ids, positions, intermediate_tensors, inputs_embeds)
        if isinstance(prefix, IntermediateTensors):  # an earlier stage: no later layer here
            return prefix
        hidden_states, keys, values = prefix
        self._write_later_kv(keys, values)
        rows, num_rows = self._logits_rows()
        if rows is None:
            return self.suffix_runner(positions, hidden_states)
        later = self.suffix_runner(positions[rows], hidden_states[rows])
        # Rows that need no logits keep layer l-1's output: vLLM never reads them.
        out = hidden_states.clone()
        out[rows[:num_rows]] = later[:num_rows]
        return out


class LlamaSwiftKVForCausalLM(nn.Module, SupportsPP):
    """vLLM entry point for `architectures: ["LlamaSwiftKVForCausalLM"]` checkpoints."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = LlamaSwiftKVModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if self.model.stage.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.logits_processor = LogitsProcessor(config.vocab_size, scale=getattr(config, "logit_scale", 1.0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the authors' layout (weights.py); raises if a SwiftKV tensor is missing."""
        config, swift = self.config, self.model.swift
        num_layers = config.num_hidden_layers
        params = dict(self.named_parameters())
        kv_size = self.model.kv_size
        loaded: set[str] = set()
        seen: set[str] = set()
        fused_blocks: dict[str, set[int]] = {}
        for name, tensor in weights:
            seen.add(name)
            target = weight_target(name, num_layers, swift, bool(config.tie_word_embeddings))
            if target is None:
                continue
            if target.param not in params:
                if is_pp_missing_parameter(target.param, self):  # another pipeline stage's tensor
                    continue
                raise ValueError(f"checkpoint tensor {name} has no place in LlamaSwiftKVForCausalLM "
                                 f"(expected parameter {target.param})")
            param = params[target.param]
            if target.fused_block is not None:
                rows = slice(target.fused_block * kv_size, (target.fused_block + 1) * kv_size)
                if tuple(tensor.shape) != tuple(param.data[rows].shape):
                    raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(param.data[rows].shape)}")
                param.data[rows].copy_(tensor)
                fused_blocks.setdefault(target.param, set()).add(target.fused_block)
                continue
            if target.shard is not None:
                param.weight_loader(param, tensor, target.shard)
            else:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target.param)
        missing = [n for n in required_swiftkv_names(num_layers, swift, _attention_bias(config)) if n not in seen]
        if missing:
            raise ValueError(f"SwiftKV checkpoint (num_key_value_layers={swift.num_key_value_layers}, "
                             f"key_value_group_size={swift.key_value_group_size}) lacks {len(missing)} "
                             f"tensor(s), e.g. {', '.join(missing[:3])}")
        for param_name, blocks in fused_blocks.items():
            if len(blocks) == 2 * self.model.layout.num_groups:
                loaded.add(param_name)
        return loaded

"""Record what a model computes for one passage: every layer's input hidden states, and
every layer's pre-RoPE keys, post-RoPE keys and values.

The model runs unchanged through the engine's path (ModelRunner, full cache, the whole
passage in one prefill step). Two model-agnostic taps collect the tensors:
- a forward pre-hook on each decoder layer sees its input hidden states (and a forward
  hook on the last layer its output, the input of the final norm); one on each layer's
  `self_attn` sees the normed input the q/k/v projections read (HF module names, which
  every kvforge decoder mirrors);
- a thin wrapper around the cache's `write` sees exactly what the model hands the cache:
  `k_pre` (after k_proj, and after k_norm for models with QK-norm such as Gemma3), `v`,
  and the step's RoPE tables, from which the post-RoPE keys follow as `rope.apply(k_pre)`
  (the rotation every RoPE-storing cache method applies).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvforge.cache.base import CacheMethod, StepMetadata
from kvforge.cache.registry import create_cache
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.errors import ConfigError, require
from kvforge.models.causal_lm import CausalLM
from kvforge.rope import PositionedRope


@dataclass(frozen=True)
class Activations:
    """Float32 copies of one passage's activations, on the CPU whatever the model's device
    (the analyses run there); T = passage tokens.

    `hidden[l]` is the input of layer l [T, hidden] for l < L, and `hidden[L]` the last
    layer's output (before the final norm). `attention_inputs[l]` [T, hidden] is layer l's
    input after its input norm: the rows K and V are projected from. `keys_pre[l]`, `keys_post[l]`, `values[l]` are
    [T, kv_heads, head_dim] for model layer l."""

    hidden: list[torch.Tensor]
    attention_inputs: list[torch.Tensor]
    keys_pre: list[torch.Tensor]
    keys_post: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def num_layers(self) -> int:
        return len(self.keys_pre)

    @property
    def num_tokens(self) -> int:
        return self.hidden[0].shape[0]


@dataclass
class _KVRecord:
    keys_pre: dict[int, torch.Tensor]
    keys_post: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]


@contextmanager
def _recording_writes(cache: CacheMethod) -> Iterator[_KVRecord]:
    """Wrap `cache.write` on this instance only; the class and other caches are untouched."""
    record = _KVRecord({}, {}, {})
    original = cache.write

    def write(cache_layer: int, meta: StepMetadata, k_pre: torch.Tensor, v: torch.Tensor,
              rope: PositionedRope) -> None:
        if cache_layer in record.keys_pre:
            raise ConfigError("cache_layer", cache_layer, "analysis expects one write per cache layer "
                              "(one prefill step of a model with one cache layer per layer)")
        record.keys_pre[cache_layer] = k_pre.detach().float().to("cpu", copy=True)
        record.keys_post[cache_layer] = rope.apply(k_pre).detach().float().to("cpu", copy=True)
        record.values[cache_layer] = v.detach().float().to("cpu", copy=True)
        original(cache_layer, meta, k_pre, v, rope)

    cache.write = write  # type: ignore[method-assign]
    try:
        yield record
    finally:
        del cache.write  # drops the instance attribute: the class method shows through again


def capture_activations(model: CausalLM, token_ids: Sequence[int]) -> Activations:
    """Run `token_ids` (one sequence, positions 0..T-1) through `model` in one prefill step
    with a full cache and return the recorded activations."""
    require(len(token_ids) >= 1, "token_ids", len(token_ids), "must hold at least one token")
    layout = model.cache_layout()
    num_layers = model.config.num_layers
    # A SwiftKV model's later layers have no K/V of their own and run on the logit rows only,
    # so neither per-layer K/V nor per-layer hidden states of every token exist there.
    require(model.config.swiftkv is None and layout.layer_to_cache == tuple(range(num_layers)), "model",
            type(model).__name__, "analysis needs a model whose every layer computes its own K/V for every "
            "token (SwiftKV models are not supported; analyse the base model)")
    dtype = next(model.parameters()).dtype
    cache = create_cache("full", layout, passage_budget_bytes(model, len(token_ids)), dtype,
                         next(model.parameters()).device)
    hidden: list[torch.Tensor | None] = [None] * (num_layers + 1)
    attention_inputs: list[torch.Tensor | None] = [None] * num_layers
    handles = []
    for index, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(_keeper(hidden, index)))
        handles.append(layer.self_attn.register_forward_pre_hook(_keeper(attention_inputs, index)))

    def keep_output(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        hidden[num_layers] = output.detach().float().to("cpu", copy=True)
    handles.append(model.model.layers[num_layers - 1].register_forward_hook(keep_output))
    try:
        with _recording_writes(cache) as record:
            ModelRunner(model, cache).step([StepItem(0, list(token_ids), num_logits=1)])
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i in range(num_layers) if i not in record.keys_pre]
    require(not missing and all(h is not None for h in hidden + attention_inputs), "model",
            type(model).__name__, f"every layer must run and write its K/V once (missing cache layers {missing})")
    return Activations(hidden=[h for h in hidden if h is not None],
                       attention_inputs=[x for x in attention_inputs if x is not None],
                       keys_pre=[record.keys_pre[i] for i in range(num_layers)],
                       keys_post=[record.keys_post[i] for i in range(num_layers)],
                       values=[record.values[i] for i in range(num_layers)])


def _keeper(store: list[torch.Tensor | None], index: int) -> Callable[[torch.nn.Module, tuple], None]:
    """Forward pre-hook storing a float32 CPU copy of the module's first argument at `index`."""
    def keep(module: torch.nn.Module, args: tuple) -> None:
        store[index] = args[0].detach().float().to("cpu", copy=True)
    return keep


def passage_budget_bytes(model: CausalLM, num_tokens: int) -> int:
    """Room for the passage with slack for block rounding (full cache, model dtype)."""
    config = model.config
    element = next(model.parameters()).element_size()
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * element
    return 2 * per_token * (num_tokens + 1024)

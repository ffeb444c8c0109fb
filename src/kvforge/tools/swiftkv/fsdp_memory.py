"""Device memory of one process of a sharded (`--fsdp`) distillation, from the config alone.

What `kvforge swiftkv memory` prints, to size a run before renting GPUs. The model follows
how `kvforge.tools.swiftkv.sharding` runs:

- every parameter (frozen base and SwiftKV tensors) is stored once, in float32, split over
  the N processes; the SwiftKV tensors also have float32 gradients and two AdamW moments,
  split the same way;
- in the forward and backward one unit (a layer, or the SwiftKV input unit) is gathered
  whole at the compute dtype, plus the next one FSDP prefetches; the embedding, final norm
  and head (the stack's own parameters) stay gathered from the forward until the backward;
- activations: the student keeps, per later layer, its input (with activation
  checkpointing) or about (6 x hidden + 3 x intermediate) values per token (without), plus
  the later layers' K/V; the loss materialises `kl_chunk_tokens` rows of vocabulary logits
  for teacher and student (about four float32 copies).

It is an estimate: the CUDA context, allocator fragmentation and attention workspaces are
not counted (leave 2-4 GB per GPU), and the tokens per step set the activation term.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.config import ModelConfig, SwiftKVConfig
from kvforge.errors import require

GIB = 2**30


@dataclass(frozen=True)
class FSDPMemory:
    """Bytes per process, by part."""

    sharded_parameters: float
    gradients_and_adam: float
    gathered_parameters: float
    activations: float
    loss: float

    @property
    def total(self) -> float:
        return (self.sharded_parameters + self.gradients_and_adam + self.gathered_parameters + self.activations
                + self.loss)

    def rows(self) -> list[tuple[str, float]]:
        return [("parameters, float32, 1/N of base + SwiftKV", self.sharded_parameters),
                ("SwiftKV gradients + AdamW moments, 1/N", self.gradients_and_adam),
                ("gathered: stack + 2 units, compute dtype", self.gathered_parameters),
                ("activations kept for the backward", self.activations),
                ("loss chunk (vocabulary logits)", self.loss),
                ("total (estimate)", self.total)]


def layer_parameters(config: ModelConfig) -> int:
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)
    return attention + 3 * h * config.intermediate_size + 2 * h


def stack_parameters(config: ModelConfig) -> int:
    """Embedding, final norm and (when not tied) the head."""
    head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return config.vocab_size * config.hidden_size + config.hidden_size + head


def swiftkv_parameters(config: ModelConfig, swift: SwiftKVConfig) -> tuple[int, int]:
    """(all SwiftKV parameters, those of the SwiftKV input unit: norm + leaders' K/V)."""
    h, d = config.hidden_size, config.head_dim
    later = config.num_layers - swift.num_key_value_layers
    leaders = len(swift.leaders(config.num_layers))
    inputs = h + leaders * 2 * h * config.num_kv_heads * d
    return inputs + later * h * config.num_heads * d, inputs


def fsdp_memory(config: ModelConfig, swift: SwiftKVConfig, processes: int, tokens_per_micro_batch: int,
                mixed_precision: str = "bfloat16", activation_checkpointing: bool = True,
                kl_chunk_tokens: int = 256) -> FSDPMemory:
    swift.check_layers(config.num_layers)
    require(processes >= 1, "processes", processes, "must be >= 1")
    require(tokens_per_micro_batch >= 1, "tokens", tokens_per_micro_batch, "must be >= 1")
    compute = 2 if mixed_precision == "bfloat16" else 4
    base = stack_parameters(config) + config.num_layers * layer_parameters(config)
    trained, input_unit = swiftkv_parameters(config, swift)
    later = config.num_layers - swift.num_key_value_layers
    h, i = config.hidden_size, config.intermediate_size
    largest_unit = max(layer_parameters(config) + h * config.num_heads * config.head_dim, input_unit)
    per_token_layer = h if activation_checkpointing else 6 * h + 3 * i
    later_kv = len(swift.leaders(config.num_layers)) * 2 * config.num_kv_heads * config.head_dim
    activations = tokens_per_micro_batch * compute * (later * per_token_layer + later_kv + 2 * h)
    return FSDPMemory(
        sharded_parameters=4 * (base + trained) / processes,
        gradients_and_adam=3 * 4 * trained / processes,
        gathered_parameters=compute * (stack_parameters(config) + 2 * largest_unit),
        activations=float(activations),
        loss=4 * 4 * min(kl_chunk_tokens, tokens_per_micro_batch) * config.vocab_size,
    )


def format_fsdp_memory(memory: FSDPMemory, title: str) -> str:
    lines = [title]
    lines += [f"  {name:<46} {value / GIB:8.2f} GiB" for name, value in memory.rows()]
    return "\n".join(lines)

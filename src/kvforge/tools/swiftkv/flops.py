"""FLOPs per prompt token by part, for a base model and its SwiftKV variants (the
accounting of the SwiftKV paper's Table 1).

Conventions (the same as kvforge.tools.bench.flops): a multiply-add is 2 FLOPs; norms, RoPE,
activations and softmax are ignored; attention is Q.K^T plus P.V, 2 * 2 * heads * head_dim
FLOPs per (query, visible key) pair and layer. A "prompt token" is the average token of a
prompt of `context` tokens, so it sees (context + 1) / 2 keys on average in a global layer
(min(p + 1, window) in a sliding one). The vocabulary projection is counted for every token
as in the paper's table, although an engine computes it only for the last prompt token.

SwiftKV with l = num_key_value_layers and g = key_value_group_size: layers < l cost what
they did; for layers >= l a prompt token pays only the K/V projection of each group
leader (from norm_swiftkv(h_l)); Q/O, MLP and attention of later layers run only for the
tokens that need logits, which a per-prompt-token figure leaves out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvforge.config import ModelConfig, SwiftKVConfig
from kvforge.tools.bench.flops import causal_pairs

PARTS = ("vocab", "kv", "qo", "mlp", "attention")


@dataclass(frozen=True)
class TokenFlops:
    vocab: float
    kv: float
    qo: float
    mlp: float
    attention: float

    @property
    def total(self) -> float:
        return self.vocab + self.kv + self.qo + self.mlp + self.attention

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def prompt_token_flops(config: ModelConfig, context: int, swiftkv: SwiftKVConfig | None = None) -> TokenFlops:
    """Average FLOPs of one token of a `context`-token prompt (baseline when swiftkv is None)."""
    h = config.hidden_size
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    layers = config.num_layers
    if swiftkv is not None:
        swiftkv.check_layers(layers)
        full_layers = list(range(swiftkv.num_key_value_layers))
        kv_projections = len(full_layers) + len(swiftkv.leaders(layers))
    else:
        full_layers = list(range(layers))
        kv_projections = layers
    per_pair = 2 * 2 * config.num_heads * config.head_dim
    attention = sum(per_pair * causal_pairs(context, config.window_of(layer)) / context for layer in full_layers)
    return TokenFlops(
        vocab=2.0 * h * config.vocab_size,
        kv=2.0 * h * 2 * kv_width * kv_projections,
        qo=2.0 * 2 * h * q_width * len(full_layers),
        mlp=2.0 * 3 * h * config.intermediate_size * len(full_layers),
        attention=float(attention),
    )


def flops_table(config: ModelConfig, context: int, settings: list[SwiftKVConfig]) -> list[dict]:
    """Rows for the baseline and each setting: GFLOP per prompt token by part, and ratio."""
    baseline = prompt_token_flops(config, context)
    rows = [{"setting": "baseline", **{k: v / 1e9 for k, v in baseline.as_dict().items()}, "ratio": 1.0}]
    for swift in settings:
        flops = prompt_token_flops(config, context, swift)
        skipped = 1 - swift.num_key_value_layers / config.num_layers
        label = f"SwiftKV l={swift.num_key_value_layers} ({skipped:.0%} skipped)"
        if swift.key_value_group_size > 1:
            label += f" + {swift.key_value_group_size}-way AcrossKV"
        rows.append({"setting": label, **{k: v / 1e9 for k, v in flops.as_dict().items()},
                     "ratio": flops.total / baseline.total})
    return rows


def format_flops_table(rows: list[dict], context: int) -> str:
    header = f"GFLOP per prompt token (context {context})"
    lines = [header, "", "| setting | " + " | ".join(PARTS) + " | total | vs baseline |",
             "|---|" + "---:|" * (len(PARTS) + 2)]
    for row in rows:
        cells = " | ".join(f"{row[p]:.2f}" for p in PARTS)
        lines.append(f"| {row['setting']} | {cells} | {row['total']:.2f} | {row['ratio']:.3f} |")
    return "\n".join(lines)

"""`kvforge verify`: the same weights in kvforge and in transformers, compared.

Loads the model twice in the same dtype (float32 by default; kvforge's own implementation
and transformers' reference), then
1. scores a 256-token passage of held-out text: kvforge prefills the first part in chunks
   and decodes the rest token by token through the paged cache, so both the prefill and
   the decode paths are compared with transformers' logits for the same positions;
2. generates greedily for three prompts (kvforge batches them in one set of steps;
   transformers runs each alone) and checks the continuations are identical.

In float32 the two agree to ~1e-3 in the logits and exactly in argmax and greedy text. In
bfloat16/float16 each implementation rounds at different points (kvforge's decode linear and
attention accumulate in float32 and round once; transformers rounds after every op), so the
logits differ by bf16 noise and a greedy continuation may fork at a near-tie. There the
report adds each implementation's argmax agreement with transformers in float32 (loaded a
third time): which of the two low-precision runs stays closer to the full-precision model.
Low-precision logits often tie exactly (top-1 and top-2 round to the same bf16 value, and
argmax then takes the lower id), so each agreement is also given tie-aware
(`argmax_agreement_ties`): a position agrees when the two sets of exactly tied maxima meet.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvforge.cache.registry import create_cache
from kvforge.devices import resolve_device
from kvforge.engine.greedy import greedy_generate
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.errors import ConfigError
from kvforge.models.loader import ModelSource, load_model, parse_dtype, resolve_model_source
from kvforge.models.tokenizer import encode_prompt, has_chat_template, load_tokenizer
from kvforge.tools.text_data import heldout_text

VERIFY_PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "The three primary colours are",
)
PASSAGE_TOKENS = 256
DECODED_TOKENS = 64  # last tokens of the passage that go through decode steps
PREFILL_CHUNK = 64
GENERATED_TOKENS = 48


@dataclass
class VerifyReport:
    model: str
    source: str
    dtype: str
    passage_tokens: int
    max_abs_logit_diff: float
    prefill_max_abs_logit_diff: float
    decode_max_abs_logit_diff: float
    argmax_agreement: float
    # a position agrees when the sets of exactly tied maximal logits of the two intersect
    argmax_agreement_ties: float
    greedy_match: bool
    prompts: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    # below float32 only: argmax agreement of each implementation with transformers in float32
    float32_agreement: dict[str, float] = field(default_factory=dict)
    float32_agreement_ties: dict[str, float] = field(default_factory=dict)  # same, tie-aware

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _log(message: str) -> None:
    print(f"[verify] {message}", file=sys.stderr, flush=True)


def load_transformers_model(source: ModelSource, device: str | torch.device = "cpu",
                            dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers model on the same file, in `dtype`, on `device`."""
    from transformers import AutoModelForCausalLM

    if source.kind == "gguf":
        # Recent transformers keep a GGUF file's weights quantized when the `kernels` package
        # has a matmul kernel for the device; kvforge (and a user comparing with it) runs the
        # dequantized weights, so the reference and the benchmark peer must too.
        import transformers

        dense = getattr(transformers, "GgufConfig", None)
        extra = {} if dense is None else {"quantization_config": dense(dequantize=True)}
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                     dtype=dtype, local_files_only=True, **extra)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype, local_files_only=True)
    # Only the device: from_pretrained already made the weights `dtype`, and a further
    # `.to(dtype)` would also round the RoPE inverse frequencies, which transformers keeps in
    # float32 (bf16 ones move the angles of distant positions), so the reference would no
    # longer be transformers as users run it.
    return model.to(device=device).eval()


def argmax_agreement(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Fraction of positions (rows of [positions, vocab] logits) whose argmax is the same."""
    return (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()


def argmax_agreement_ties(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Tie-aware argmax agreement: a position agrees when some token has the exact maximal
    logit in both, i.e. the two sets of tied maxima intersect. In bf16 the top two logits
    often round to the same value and argmax picks the lower id, so plain argmax agreement
    counts as disagreements positions where either choice is equally right."""
    ours_top = ours == ours.amax(-1, keepdim=True)
    theirs_top = theirs == theirs.amax(-1, keepdim=True)
    return (ours_top & theirs_top).any(-1).float().mean().item()


def _passage_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Logits of every passage position: chunked prefill, then one token per step."""
    split = len(tokens) - DECODED_TOKENS
    rows = []
    for start in range(0, split, PREFILL_CHUNK):
        chunk = tokens[start:min(split, start + PREFILL_CHUNK)]
        rows.append(runner.step([StepItem(0, chunk, num_logits=len(chunk))]))
    for token in tokens[split:]:
        rows.append(runner.step([StepItem(0, [token])]))
    runner.release(0)
    return torch.cat(rows)


def run_verify(model_name: str, text_file: str | Path | None = None,
               passage_tokens: int = PASSAGE_TOKENS, kv_budget: int = 256 * 2**20,
               device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32") -> VerifyReport:
    from kvforge.preflight import check_within_context, model_context
    from kvforge.tools.text_data import read_text

    device = resolve_device(device)  # checked before anything loads, like the rest
    dtype = parse_dtype(dtype)
    if passage_tokens <= DECODED_TOKENS:
        raise ConfigError("passage_tokens", passage_tokens, f"must be > {DECODED_TOKENS}")
    check_within_context("passage_tokens", [passage_tokens], model_context(model_name), model_name)
    read_text(text_file)
    # The passage before any weights load: a text too short for it is refused at once.
    tokenizer = load_tokenizer(resolve_model_source(model_name))
    passage = tokenizer.encode(heldout_text(text_file))[:passage_tokens]
    if len(passage) <= DECODED_TOKENS:
        raise ConfigError("text_file", str(text_file or "the default text"),
                          f"its held-out part (what follows its first 80%) has {len(passage)} tokens; the passage needs more "
                          f"than {DECODED_TOKENS}")
    times: dict[str, float] = {}
    start = time.perf_counter()
    model, source = load_model(model_name, dtype=dtype, device=device)
    times["load_kvforge"] = time.perf_counter() - start
    _log(f"kvforge model loaded from {source.path} ({times['load_kvforge']:.1f}s)")
    start = time.perf_counter()
    reference = load_transformers_model(source, device, dtype)
    times["load_transformers"] = time.perf_counter() - start
    _log(f"transformers model loaded ({times['load_transformers']:.1f}s)")
    cache = create_cache("full", model.cache_layout(), kv_budget, dtype, device)
    runner = ModelRunner(model, cache)

    start = time.perf_counter()
    ours = _passage_logits(runner, passage)
    with torch.inference_mode():
        theirs = reference(torch.tensor([passage], device=device)).logits[0].float()
    times["passage"] = time.perf_counter() - start
    split = len(passage) - DECODED_TOKENS
    ours = ours.float()
    diff = (ours - theirs).abs().amax(dim=-1)
    agreement = argmax_agreement(ours, theirs)
    agreement_ties = argmax_agreement_ties(ours, theirs)
    _log(f"passage of {len(passage)} tokens: max |logit diff| {diff.max().item():.2e}, "
         f"argmax agreement {agreement:.4f} (tie-aware {agreement_ties:.4f})")
    float32_agreement: dict[str, float] = {}
    float32_agreement_ties: dict[str, float] = {}
    if dtype != torch.float32:
        full = load_transformers_model(source, device, torch.float32)
        with torch.inference_mode():
            truth = full(torch.tensor([passage], device=device)).logits[0].float()
        del full
        pairs = (("kvforge", ours), ("transformers", theirs))
        float32_agreement = {name: argmax_agreement(logits, truth) for name, logits in pairs}
        float32_agreement_ties = {name: argmax_agreement_ties(logits, truth) for name, logits in pairs}
        del truth
        _log("argmax agreement with transformers in float32: "
             + ", ".join(f"{name} {value:.4f} (tie-aware {float32_agreement_ties[name]:.4f})"
                         for name, value in float32_agreement.items()))

    chat = has_chat_template(tokenizer)
    prompts = [encode_prompt(tokenizer, p, chat=chat) for p in VERIFY_PROMPTS]
    stops = sorted(set(model.config.eos_token_ids) | {tokenizer.eos_token_id} - {None})
    start = time.perf_counter()
    ours_generated = greedy_generate(runner, prompts, GENERATED_TOKENS, stop_token_ids=stops,
                                     prefill_chunk=PREFILL_CHUNK)
    records = []
    for text, prompt, generated in zip(VERIFY_PROMPTS, prompts, ours_generated):
        with torch.inference_mode():
            output = reference.generate(torch.tensor([prompt], device=device), max_new_tokens=GENERATED_TOKENS,
                                        do_sample=False, eos_token_id=stops,
                                        pad_token_id=stops[0] if stops else None)
        expected = output[0, len(prompt):].tolist()
        records.append({"prompt": text, "match": generated == expected,
                        "kvforge": tokenizer.decode(generated), "transformers": tokenizer.decode(expected),
                        "kvforge_ids": generated, "transformers_ids": expected})
        _log(f"greedy {'match' if generated == expected else 'MISMATCH'}: {text!r} -> "
             f"{tokenizer.decode(generated)!r}")
    times["greedy"] = time.perf_counter() - start
    return VerifyReport(
        model=model_name,
        source=str(source.path),
        dtype=str(dtype).removeprefix("torch."),
        passage_tokens=len(passage),
        max_abs_logit_diff=diff.max().item(),
        prefill_max_abs_logit_diff=diff[:split].max().item(),
        decode_max_abs_logit_diff=diff[split:].max().item(),
        argmax_agreement=agreement,
        argmax_agreement_ties=agreement_ties,
        float32_agreement=float32_agreement,
        float32_agreement_ties=float32_agreement_ties,
        greedy_match=all(r["match"] for r in records),
        prompts=records,
        seconds=times,
    )

"""lm-evaluation-harness adapter: `--model kvforge` scores and generates through kvforge.

    kvforge lm-eval --model kvforge --model_args model=smollm2-135m,cache=kivi --tasks ...
    python -m kvforge.integrations.lm_eval --model kvforge --model_args ... --tasks ...

lm-eval 0.4.x finds a model name only in its own registry and loads no plugins, so plain
`lm_eval --model kvforge` cannot see this class unless something imported this module
first. The two commands above import it (which registers "kvforge"), then hand the
arguments unchanged to lm-eval's own command line. From Python, `import
kvforge.integrations.lm_eval` is enough for `simple_evaluate(model="kvforge", ...)`, or
pass a `KVForgeLM` instance as `model`.

model_args (also see `KVForgeLM.__init__`): model (name, .gguf or HF directory; alias
pretrained), cache (a spec such as `kivi:bits=2`; `;` may separate its options since lm-eval
splits model_args at commas), cache_opt (`k=v;k=v`), any other key that is an option of the
cache method (`cache=kivi,bits=2,residual=32`), swiftkv (checkpoint dir), dtype, kv_budget,
threads, max_batch_tokens, max_length, max_gen_toks, score_mode (prefill | cached | decode,
see kvforge.engine.loglikelihood), add_bos_token, seed. lm-eval's --batch_size is the number of
sequences per scoring step and per generation batch ("auto" -> 16); --device falls back to
the CPU when CUDA is missing (its default is cuda:0).

Requests are answered as lm-eval's Hugging Face model (`hf`) answers them: the same
context/continuation split (TemplateLM), BOS-or-EOS prefix for an empty context, left
truncation to max_length, rolling windows for loglikelihood_rolling, stop strings cut from
the generated text. Log-likelihoods come from the cache method under test
(`engine.loglikelihood.score_continuations` on the engine's runner and cache); generation is
`LLM.generate`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lm_eval.models  # noqa: F401  (the built-in names, before ours: see register)
import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from tqdm.auto import tqdm

from kvforge.engine.llm import LLM
from kvforge.engine.loglikelihood import SCORE_MODES, ScoreSettings, score_continuations
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import ConfigError, KVForgeError, require

logger = logging.getLogger(__name__)

MODEL_NAME = "kvforge"
AUTO_BATCH_SIZE = 16
# gen_kwargs keys lm-eval tasks use for the number of new tokens, in lm-eval's priority order.
MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "seed", "until")


@dataclass(frozen=True)
class LMEvalSettings:
    """The adapter's own settings (the engine's are validated by `LLM`)."""

    batch_size: int = AUTO_BATCH_SIZE
    max_batch_tokens: int = 1024
    max_length: int | None = None
    max_gen_toks: int = 256
    score_mode: str = "cached"
    add_bos_token: bool | None = None
    seed: int = 1234
    threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_batch_tokens", "max_gen_toks"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, name, value, "must be an integer >= 1")
        require(self.max_length is None or (isinstance(self.max_length, int) and self.max_length >= 2),
                "max_length", self.max_length, "must be an integer >= 2")
        require(self.score_mode in SCORE_MODES, "score_mode", self.score_mode, f"must be one of {list(SCORE_MODES)}")
        require(self.add_bos_token is None or isinstance(self.add_bos_token, bool), "add_bos_token",
                self.add_bos_token, "must be true, false or None (the tokenizer's default)")
        require(isinstance(self.seed, int) and self.seed >= 0, "seed", self.seed, "must be an integer >= 0")
        require(self.threads is None or (isinstance(self.threads, int) and self.threads >= 1), "threads",
                self.threads, "must be an integer >= 1")


def parse_batch_size(batch_size: int | str | None, max_batch_size: int | None = None) -> int:
    """lm-eval's --batch_size: an integer, or "auto"/"auto:N" (kvforge needs no probing:
    AUTO_BATCH_SIZE, capped by --max_batch_size)."""
    if batch_size is None or (isinstance(batch_size, str) and batch_size.startswith("auto")):
        return min(AUTO_BATCH_SIZE, max_batch_size or AUTO_BATCH_SIZE)
    try:
        return int(batch_size)
    except ValueError as exc:
        raise ConfigError("batch_size", batch_size, "must be an integer or auto") from exc


def resolve_device(device: str | None) -> str:
    if device is None:
        return "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        # lm-eval's command line passes cuda:0 unless told otherwise.
        logger.warning("kvforge: device %s requested but CUDA is not available; running on the CPU", device)
        return "cpu"
    return str(device)


def cache_options(cache: str, cache_opt: str | Sequence[str] | None, extra: dict[str, Any]) -> tuple[str, list[str]]:
    """(spec, options): `;` inside the spec separates options like `,` does; `cache_opt` is
    `k=v;k=v` or a list; `extra` are model_args that are not the adapter's own."""
    spec = str(cache).replace(";", ",")
    if cache_opt is None:
        listed: list[str] = []
    elif isinstance(cache_opt, str):
        listed = [p for p in cache_opt.split(";") if p.strip()]
    else:
        listed = [str(p) for p in cache_opt]
    for key, value in extra.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        listed.append(f"{key}={text}")
    return spec, listed


def sampling_from_gen_kwargs(gen_kwargs: dict[str, Any], default_max_tokens: int, seed: int
                             ) -> tuple[SamplingParams, list[str]]:
    """SamplingParams and stop strings for one generate_until request. As lm-eval
    normalises them: do_sample unset means sampling iff temperature > 0; do_sample false
    means greedy whatever the temperature."""
    kwargs = dict(gen_kwargs)
    until = kwargs.pop("until", None)
    stops = [until] if isinstance(until, str) else list(until or [])
    max_tokens = next((int(kwargs.pop(k)) for k in MAX_TOKEN_KEYS if kwargs.get(k) is not None), default_max_tokens)
    for key in MAX_TOKEN_KEYS:
        kwargs.pop(key, None)
    unknown = sorted(set(kwargs) - set(SAMPLING_KEYS))
    require(not unknown, "gen_kwargs", unknown, f"kvforge supports {sorted(SAMPLING_KEYS + MAX_TOKEN_KEYS)}")
    temperature = float(kwargs.get("temperature") or 0.0)
    do_sample = kwargs.get("do_sample")
    if do_sample is None:
        do_sample = temperature > 0
    if not do_sample:
        params = SamplingParams.greedy_params(max_tokens, stop=tuple(s for s in stops if s))
    else:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature if "temperature" in kwargs else 1.0,
                                top_p=float(kwargs.get("top_p", 1.0)), top_k=int(kwargs.get("top_k", 0)),
                                seed=int(kwargs.get("seed", seed)), stop=tuple(s for s in stops if s))
    return params, stops


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """The text before the first occurrence of each stop string, applied in turn (as lm-eval)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


class KVForgeLM(TemplateLM):
    """lm-eval's `LM` over a kvforge `LLM` (model + cache method + engine)."""

    backend = "causal"

    def __init__(self, model: str = "smollm2-135m", cache: str = "full", cache_opt: str | Sequence[str] | None = None,
                 swiftkv: str | None = None, dtype: str = "float32", kv_budget: str | int = "1GiB",
                 threads: int | None = None, batch_size: int | str | None = None, max_batch_size: int | None = None,
                 max_batch_tokens: int = 1024, max_length: int | None = None, max_gen_toks: int = 256,
                 score_mode: str = "cached", add_bos_token: bool | None = None, seed: int = 1234,
                 device: str | None = None, pretrained: str | None = None, **extra: Any) -> None:
        super().__init__()
        settings = LMEvalSettings(parse_batch_size(batch_size, max_batch_size), max_batch_tokens, max_length,
                                  max_gen_toks, score_mode, add_bos_token, seed, threads)
        spec, options = cache_options(cache, cache_opt, extra)
        if settings.threads:
            torch.set_num_threads(settings.threads)
        try:
            self.llm = LLM(model=pretrained or model, cache=spec, cache_options=options, dtype=dtype,
                           kv_budget=kv_budget, max_num_seqs=settings.batch_size, max_model_len=max_length,
                           device=resolve_device(device), swiftkv=swiftkv)
        except ConfigError as exc:
            if extra and exc.parameter.startswith("cache"):
                raise ConfigError("model_args", sorted(extra), f"neither a KVForgeLM argument nor a valid option of "
                                                               f"cache {spec!r}: {exc}") from exc
            raise
        self.settings = settings
        self.model_name = str(pretrained or model)
        self.dtype = str(dtype)
        self.swiftkv = swiftkv
        self.tokenizer = self.llm.tokenizer
        self._device = self.llm.engine.runner.device
        limit = self.llm.engine.max_model_len
        self._max_length = min(settings.max_length or limit, limit)

    # -- what lm-eval asks of a model ---------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self.settings.max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.settings.batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.model_name.replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        return {"kvforge_model": self.model_name, "kvforge_cache": str(self.llm.cache_spec),
                "kvforge_dtype": self.dtype, "kvforge_swiftkv": self.swiftkv,
                "kvforge_score_mode": self.settings.score_mode}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """As lm-eval's `hf`: the tokenizer's own special-token rule unless told otherwise,
        and no second BOS when the text already starts with it (chat templates)."""
        flag = add_special_tokens if add_special_tokens is not None else self.settings.add_bos_token
        if add_special_tokens is None:
            prefix = self.tokenizer.decode([self.prefix_token_id])
            if prefix and string.startswith(prefix):
                flag = False
        ids = self.tokenizer.encode(string) if flag is None else self.tokenizer.encode(string, add_special_tokens=flag)
        ids = [int(t) for t in ids]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # -- log-likelihoods ----------------------------------------------------------------
    def _truncate(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Keep the last max_length + 1 tokens (the model reads max_length of them), as `hf`."""
        require(len(continuation) <= self.max_length, "continuation", f"{len(continuation)} tokens",
                f"must fit max_length={self.max_length}")
        full = (context + continuation)[-(self.max_length + 1):]
        return full[:len(full) - len(continuation)], continuation

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        engine = self.llm.engine
        # Scoring borrows the engine's runner and cache, with sequence ids of its own.
        require(not engine.has_unfinished_requests(), "engine", "busy", "score only while no generation runs")
        pairs = [self._truncate(list(context), list(continuation)) for _, context, continuation in requests]
        settings = ScoreSettings(self.settings.score_mode, self.settings.batch_size, self.settings.max_batch_tokens)
        with tqdm(total=len(pairs), desc="kvforge loglikelihood", unit="req", disable=disable_tqdm) as bar:
            scores = score_continuations(engine.runner, pairs, settings, bar.update)
        answers = []
        for (request, _, _), score in zip(requests, scores):
            answer = (score.logprob, score.is_greedy)
            if request is not None:  # rolling windows have no key; loglikelihood_rolling caches the sum
                self.cache_hook.add_partial("loglikelihood", request, answer)
            answers.append(answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (text,) in (request.args for request in requests):
            pairs = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows += [(None, list(context), list(prediction)) for context, prediction in pairs]
            counts.append(len(pairs))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = []
        start = 0
        for request, count in zip(requests, counts):
            total = sum(logprob for logprob, _ in scores[start:start + count])
            start += count
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            totals.append(total)
        return totals

    # -- generation ---------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        prompts: list[list[int]] = []
        params: list[SamplingParams] = []
        stops: list[list[str]] = []
        for index, (context, gen_kwargs) in enumerate(request.args for request in requests):
            sampling, until = sampling_from_gen_kwargs(gen_kwargs, self.max_gen_toks, self.settings.seed + index)
            room = self.max_length - sampling.max_tokens
            require(room > 0, "max_gen_toks", sampling.max_tokens, f"must be < max_length={self.max_length}")
            prompts.append(self.tok_encode(context, left_truncate_len=room))
            params.append(sampling)
            stops.append(until)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = []
        for request, output, until in zip(requests, outputs, stops):
            if output.error:
                raise KVForgeError(f"kvforge generate_until: {output.error}")
            text = cut_at_stops(output.text, until)
            self.cache_hook.add_partial("generate_until", request.args, text)
            texts.append(text)
        return texts


def register() -> None:
    """Make `--model kvforge` known to lm-eval (idempotent). lm-eval's get_model imports its
    built-in models only into an empty registry, so they are imported first (at the top)."""
    from lm_eval.api import registry

    if MODEL_NAME not in registry.MODEL_REGISTRY:
        registry.register_model(MODEL_NAME)(KVForgeLM)


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's command line with "kvforge" registered; arguments as `lm_eval`'s."""
    from lm_eval.__main__ import cli_evaluate

    register()
    saved = sys.argv
    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


register()

if __name__ == "__main__":
    raise SystemExit(main())

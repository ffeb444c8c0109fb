"""The lm-evaluation-harness adapter (kvforge.integrations.lm_eval) on a tiny random Llama
with a character tokenizer: log-likelihoods equal transformers on the same tokens,
generate_until equals greedy generation cut at the stop strings, model_args parse, and
lm-eval runs the local tasks of tests/data/lm_eval_task through its Python API and through
`kvforge lm-eval`. A slow test compares with lm-eval's own `hf` model on SmolLM2."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from conftest import make_pair  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from kvforge.cli import main as kvforge_main  # noqa: E402
from kvforge.engine import llm as llm_module  # noqa: E402
from kvforge.engine.sampling import SamplingParams  # noqa: E402
from kvforge.errors import ConfigError  # noqa: E402
from kvforge.integrations.lm_eval import (  # noqa: E402
    KVForgeLM,
    cut_at_stops,
    parse_batch_size,
    sampling_from_gen_kwargs,
)
from kvforge.models.loader import ModelSource  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = REPO / "tests" / "data" / "lm_eval_task"
TASKS = ["kvforge_mc", "kvforge_gen", "kvforge_rolling"]
KIVI_ARGS = dict(cache="kivi", bits=2, group=8, residual=8)


class TinyTokenizer:
    """One id per character of ALPHABET (ids 3..95), BOS=1, EOS=2; never adds BOS itself."""

    ALPHABET = "\n" + "".join(chr(c) for c in range(32, 124))  # 93 characters
    bos_token_id = 1
    eos_token_id = 2
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.ALPHABET.index(c) + 3 if c in self.ALPHABET else 3 + 1 for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.ALPHABET[i - 3] for i in ids if i >= 3)


@pytest.fixture(scope="module")
def tiny_pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: thread wake-ups dominate otherwise
    yield make_pair("llama_gqa")
    torch.set_num_threads(threads)


@pytest.fixture
def tiny(tiny_pair, monkeypatch):
    """`LLM(model="tiny")` builds on the tiny kvforge model; returns (hf, tokenizer)."""
    hf, ours = tiny_pair
    source = ModelSource("hf_dir", Path("tiny"), "tiny")
    monkeypatch.setattr(llm_module, "load_model", lambda name, **kwargs: (ours, source))
    monkeypatch.setattr(llm_module, "load_tokenizer", lambda source: TinyTokenizer())
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return hf, TinyTokenizer()


def _logprob(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([context + continuation[:-1]])).logits[0, len(context) - 1:]
    logp = torch.log_softmax(logits.double(), dim=-1)
    target = torch.tensor(continuation)
    return float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def _instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


# -- helpers: hand cases ------------------------------------------------------------------
def test_gen_kwargs_become_sampling_params():
    params, stops = sampling_from_gen_kwargs({"until": ["\n", "."], "do_sample": False, "temperature": 0.7,
                                              "max_gen_toks": 9}, 256, seed=5)
    assert params.greedy and params.max_tokens == 9 and params.stop == ("\n", ".") and stops == ["\n", "."]
    params, stops = sampling_from_gen_kwargs({"until": "Q:", "max_new_tokens": 4}, 256, seed=5)
    assert params.greedy and params.max_tokens == 4 and stops == ["Q:"]
    params, _ = sampling_from_gen_kwargs({"temperature": 0.5, "top_p": 0.9}, 32, seed=5)
    assert (params.greedy, params.temperature, params.top_p, params.seed, params.max_tokens) == (False, 0.5, 0.9, 5, 32)
    params, _ = sampling_from_gen_kwargs({"do_sample": True}, 32, seed=1)
    assert params.temperature == 1.0 and not params.greedy
    with pytest.raises(ConfigError, match="gen_kwargs"):
        sampling_from_gen_kwargs({"num_beams": 4}, 32, seed=1)


def test_stops_and_batch_sizes():
    assert cut_at_stops("a b.\nc", ["\n", "."]) == "a b"
    assert cut_at_stops("abc", ["", "z"]) == "abc"
    assert parse_batch_size(8) == 8 and parse_batch_size("12") == 12
    assert parse_batch_size("auto") == 16 and parse_batch_size("auto:4", max_batch_size=6) == 6
    with pytest.raises(ConfigError, match="batch_size"):
        parse_batch_size("many")


def test_model_args_validate_and_fold_cache_options(tiny):
    lm = KVForgeLM(model="tiny", cache="kivi:bits=4;group=8", residual=16, batch_size="auto")
    assert str(lm.llm.cache_spec) == "kivi:bits=4,group=8,residual=16" and lm.batch_size == 16
    lm = KVForgeLM(model="tiny", cache="kivi", cache_opt="group=8;residual=8")
    assert str(lm.llm.cache_spec) == "kivi:group=8,residual=8"
    with pytest.raises(ConfigError, match="model_args"):
        KVForgeLM(model="tiny", cache="kivi", typo_arg=3)
    with pytest.raises(ConfigError, match="score_mode"):
        KVForgeLM(model="tiny", score_mode="sideways")


# -- requests --------------------------------------------------------------------------
@pytest.mark.parametrize("score_mode", ["prefill", "cached", "decode"])
def test_loglikelihood_matches_transformers(tiny, score_mode):
    hf, tok = tiny
    lm = KVForgeLM(model="tiny", score_mode=score_mode, batch_size=3)
    args = [("Question: what is it?\nAnswer:", " a cat"), ("The end ", "of it"), ("", "Hello there"),
            ("x", "y"), ("A much longer context, " * 4, " and the rest.")]
    results = lm.loglikelihood(_instances("loglikelihood", args), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(args, results):
        # lm-eval's split: trailing spaces of the context belong to the continuation;
        # an empty context becomes the BOS prefix
        body = context.rstrip()
        moved = context[len(body):] + continuation
        context_ids = tok.encode(body) if body else [tok.bos_token_id]
        expected = _logprob(hf, context_ids, tok.encode(moved))
        assert logprob == pytest.approx(expected[0], abs=1e-4)
        assert greedy == expected[1]


def test_is_greedy_and_left_truncation(tiny):
    hf, _ = tiny
    lm = KVForgeLM(model="tiny", max_length=12)
    context = [5, 17, 33, 60, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    greedy: list[int] = []
    with torch.inference_mode():
        for _ in range(4):  # the tokens transformers picks after the truncated context
            window = (context + greedy)[-12:]
            greedy.append(int(hf(input_ids=torch.tensor([window])).logits[0, -1].argmax()))
    requests = [(None, context, greedy[:1]), (None, context, [(greedy[0] + 1) % 96])]
    results = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [r[1] for r in results] == [True, False]
    # 14 + 1 tokens > max_length + 1: the model reads the last 12, as lm-eval's hf does
    assert results[0][0] == pytest.approx(_logprob(hf, context[-12:], greedy[:1])[0], abs=1e-4)


def test_loglikelihood_rolling_matches_transformers(tiny):
    hf, tok = tiny
    text = "The river rises in the hills to the north and flows south to the sea."
    for max_length in (128, 24):  # one window, then several
        lm = KVForgeLM(model="tiny", max_length=max_length)
        [total] = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            tok.encode(text), tok.bos_token_id, max_length, context_len=1)]
        assert (len(windows) == 1) == (max_length == 128)
        assert sum(len(p) for _, p in windows) == len(text)
        expected = sum(_logprob(hf, list(c), list(p))[0] for c, p in windows)
        assert total == pytest.approx(expected, abs=1e-4)


def _hf_greedy_text(hf, tok, prompt: str, max_new: int) -> str:
    ids = torch.tensor([tok.encode(prompt)])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1]:].tolist())


def test_generate_until_is_greedy_generation_cut_at_stops(tiny):
    hf, tok = tiny
    lm = KVForgeLM(model="tiny", batch_size=4)
    prompts = ["Question: what?\nAnswer:", "Once upon a time", "1, 2, 3,"]
    full = [_hf_greedy_text(hf, tok, p, 12) for p in prompts]
    # a stop string that occurs inside each greedy text (its 5th character), and one without stops
    stops = [[text[4], "never-there"] if len(text) > 4 else ["never-there"] for text in full]
    args = [(p, {"until": s, "do_sample": False, "max_gen_toks": 12}) for p, s in zip(prompts, stops)]
    args.append((prompts[0], {"until": [], "max_gen_toks": 12}))
    texts = lm.generate_until(_instances("generate_until", args), disable_tqdm=True)
    assert texts == [cut_at_stops(t, s) for t, s in zip(full, stops)] + [full[0]]
    assert all(len(t) < len(f) for t, f, s in zip(texts, full, stops) if len(s) == 2)
    # the same as kvforge's own LLM.generate
    direct = lm.llm.generate([p for p, _ in args], [SamplingParams.greedy_params(12, stop=tuple(s["until"]))
                                                     for _, s in args], use_tqdm=False)
    assert texts == [o.text for o in direct]


# -- lm-eval itself ----------------------------------------------------------------------
def test_simple_evaluate_runs_the_local_tasks(tiny, monkeypatch):
    monkeypatch.chdir(REPO)  # data_files in the task YAMLs are relative to the repository root
    results = simple_evaluate(model="kvforge", model_args="model=tiny,cache=kivi,bits=2,group=8,residual=8",
                              tasks=TASKS, task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
                              limit=4,
                              batch_size=4, device="cpu")
    metrics = results["results"]
    assert 0 <= metrics["kvforge_mc"]["acc,none"] <= 1
    assert 0 <= metrics["kvforge_gen"]["exact_match,strip"] <= 1
    assert math.isfinite(metrics["kvforge_rolling"]["word_perplexity,none"])
    assert metrics["kvforge_rolling"]["word_perplexity,none"] > 1
    assert results["config"]["kvforge_cache"] == "kivi:bits=2,group=8,residual=8"


class LocalTasksOnly(TaskManager):
    """lm-eval's TaskManager without its built-in task index (thousands of YAML files,
    ~9 s to scan on this machine, and not what these tests check)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "include_defaults": False})


def test_kvforge_lm_eval_command(tiny, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("lm_eval.tasks.TaskManager", LocalTasksOnly)  # the command imports it from there
    code = kvforge_main(["lm-eval", "--model", "kvforge", "--model_args", "model=tiny,cache=full",
                         "--tasks", "kvforge_mc", "--include_path", str(TASK_DIR), "--limit", "3",
                         "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert "kvforge_mc" in out and "acc" in out


@pytest.mark.slow
def test_smollm2_matches_lm_eval_hf_model():
    """Same (logprob, is_greedy), rolling log-likelihood and greedy text as lm-eval's `hf`
    model on transformers with the same weights."""
    from lm_eval.models.huggingface import HFLM

    from kvforge.tools.bench.hf_peer import load_hf_peer

    ours = KVForgeLM(model="smollm2-135m", batch_size=8, threads=2)
    reference = HFLM(pretrained=load_hf_peer(ours.llm.source, torch.float32), tokenizer=ours.tokenizer,
                     batch_size=8, device="cpu")
    pairs = [("Question: What is the capital of France?\nAnswer:", " Paris"), ("", "The quick brown fox"),
             ("The capital of Japan is ", "Tokyo"), ("1, 2, 3, 4,", " 5, 6")]
    ll = _instances("loglikelihood", pairs)
    for got, want in zip(ours.loglikelihood(ll, disable_tqdm=True), reference.loglikelihood(ll, disable_tqdm=True)):
        assert got[0] == pytest.approx(want[0], abs=2e-4) and got[1] == want[1]
    rolling = _instances("loglikelihood_rolling", [("The river rises in the hills to the north and flows south.",)])
    assert ours.loglikelihood_rolling(rolling, disable_tqdm=True) == pytest.approx(
        reference.loglikelihood_rolling(rolling, disable_tqdm=True), abs=5e-4)
    gen = _instances("generate_until", [("Question: What is 2 + 3?\nAnswer:", {"until": ["\n\n"], "max_gen_toks": 20}),
                                        ("The capital of France is", {"until": ["."], "max_gen_toks": 20})])
    assert ours.generate_until(gen, disable_tqdm=True) == reference.generate_until(gen, disable_tqdm=True)

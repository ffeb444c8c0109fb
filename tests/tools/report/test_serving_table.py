"""README's "Serve it" table: kvforge beside vLLM, read from the two committed comparisons."""

from __future__ import annotations

from kvforge.tools.report.serving_table import BURST, CHAT, serving_block


def _burst() -> dict:
    def system(name: str, kind: str, ttft: float, tps: float, itl: float) -> dict:
        return {"name": name, "kind": kind, "rates": [{"median_of_runs": {
            "ttft_ms_median": ttft, "output_token_throughput": tps, "itl_ms_median": itl}}]}

    return {"settings": {"num_prompts": 16, "input_len": "1000", "output_len": "64",
                         "vllm": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}},
            "systems": [system("kvforge[full]", "kvforge", 6000.0, 70.0, 50.0), system("vllm", "vllm", 7500.0, 60.0, 64.0)],
            "peer_ratios": {"vllm": {"inf": {"ttft_ms_median": 1.25, "output_token_throughput": 70 / 60,
                                             "itl_ms_median": 1.28}}}}


def _chat() -> dict:
    def system(name: str, kind: str, first: float, later: float) -> dict:
        return {"name": name, "kind": kind, "chat": {"first_turn_ttft_ms": first, "later_turns_mean_ttft_ms": later}}

    return {"settings": {"chat": {"turns": 6, "shared_prefix": 1500}},
            "systems": [system("kvforge[full]", "kvforge", 900.0, 50.0), system("vllm", "vllm", 1000.0, 75.0)],
            "peer_ratios": {"vllm": {"first_turn_ttft_ms": 1000 / 900, "later_turns_mean_ttft_ms": 1.5}}}


def test_the_table_puts_each_figure_beside_vllms_and_the_ratio():
    lines = serving_block({BURST: _burst(), CHAT: _chat()}).splitlines()
    assert lines[0] == "| workload | metric | kvforge | vLLM CPU (both cores) | kvforge better by |"
    assert "| median TTFT | 6.00 s | 7.50 s | 1.25x |" in lines[2]
    assert lines[3].endswith("| output tokens/s | 70.0 | 60.0 | 1.17x |")
    assert lines[4].endswith("| median inter-token latency | 50 ms | 64 ms | 1.28x |")
    assert lines[5].startswith("| chat: 6 turns over a 1500-token document") and "0.900 s | 1.000 s | 1.11x" in lines[5]
    assert lines[6].endswith("| TTFT, turns 2-6 | 0.050 s | 0.075 s | 1.50x |")


def test_a_missing_comparison_is_named():
    assert CHAT in serving_block({BURST: _burst()})


def test_the_header_names_vllms_version_when_the_result_recorded_it():
    burst = _burst()
    burst["settings"]["vllm"]["version"] = "0.32.0"
    header = serving_block({BURST: burst, CHAT: _chat()}).splitlines()[0]
    assert header == "| workload | metric | kvforge | vLLM 0.32.0 CPU (both cores) | kvforge better by |"

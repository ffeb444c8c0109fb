"""vLLM offline prefill throughput: SwiftKV (kvforge's vLLM plugin) vs the base model.

Run in the vLLM environment (one command; both engines stay up, measurements alternate):

    /work/vllm-venv/bin/python benchmarks/vllm_swiftkv_prefill.py \\
        --swiftkv /tmp/kvf/swiftkv-l15 --base /tmp/kvf/base \\
        --prepare-with /work/main/.venv/bin/python --json results.json

`--prepare-with PYTHON` builds missing directories with kvforge in that interpreter (the
vLLM environment need not have kvforge's GGUF dependencies): the SwiftKV one with
`kvforge swiftkv export --swiftkv models/swiftkv-smollm2-135m-l15`, the base one with
kvforge.integrations.vllm.base_checkpoint (the same dequantised weights kvforge runs).

Each measurement is one `LLM.generate` of --prompts prompts of --prompt-tokens random token
ids (fresh ids every time, prefix caching off) with max_tokens=1, so it times prefill
(plus one sampled token per prompt). Order per repeat alternates (ABBA...), the medians are
compared; the JSON records versions, machine load before and after, and every timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SWIFTKV = REPO / "models" / "swiftkv-smollm2-135m-l15"


def load_snapshot() -> dict[str, Any]:
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"uptime": uptime, "loadavg": list(os.getloadavg()), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def descendant_cpu_seconds() -> float:
    """CPU seconds used so far by this process's live descendants (vLLM's engine-core
    process): the load probe counts only itself and waited-for children as its own."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    me, total = os.getpid(), 0
    for pid in ticks:
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, me):
            ancestor = parents.get(ancestor)
        if ancestor == me:
            total += ticks[pid]
    return total / os.sysconf("SC_CLK_TCK")


def prepare(args: argparse.Namespace) -> None:
    """Build --swiftkv / --base with kvforge when they do not exist yet."""
    if not args.prepare_with:
        missing = [str(p) for p in (args.swiftkv, args.base) if not Path(p, "config.json").is_file()]
        if missing:
            sys.exit(f"missing checkpoint directories {missing}: pass --prepare-with PYTHON (kvforge's)")
        return
    if not Path(args.swiftkv, "config.json").is_file():
        subprocess.run([args.prepare_with, "-m", "kvforge", "swiftkv", "export", "--swiftkv",
                        str(args.swiftkv_source), "--out", str(args.swiftkv)], check=True)
    if not Path(args.base, "config.json").is_file():
        code = ("import sys, torch; torch.set_num_threads(2); "
                "from kvforge.integrations.vllm.base_checkpoint import write_base_checkpoint; "
                "write_base_checkpoint(sys.argv[1], sys.argv[2])")
        subprocess.run([args.prepare_with, "-c", code, args.base_model, str(args.base)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swiftkv", type=Path, required=True, help="exported SwiftKV checkpoint directory")
    parser.add_argument("--base", type=Path, required=True, help="base model as a plain HF directory")
    parser.add_argument("--prepare-with", default=None, metavar="PYTHON",
                        help="kvforge's python, to build missing --swiftkv/--base directories")
    parser.add_argument("--swiftkv-source", type=Path, default=DEFAULT_SWIFTKV,
                        help="params-only checkpoint exported into --swiftkv (with --prepare-with)")
    parser.add_argument("--base-model", default="smollm2-135m", help="kvforge model written to --base")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per measurement (4)")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="tokens per prompt (2000)")
    parser.add_argument("--repeats", type=int, default=3, help="timed measurements per model (3)")
    parser.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads (2)")
    parser.add_argument("--kv-cache-bytes", type=int, default=512 * 2**20)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's default when unset")
    parser.add_argument("--compile", action="store_true", help="let vLLM torch.compile (default: enforce_eager)")
    parser.add_argument("--json", required=True, help="output path")
    args = parser.parse_args()

    before = load_snapshot()
    prepare(args)
    from kvforge.integrations.vllm.driver import kv_capacity, make_llm, set_threads, versions

    set_threads(args.threads)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    max_len = args.prompt_tokens + 16
    systems = {}
    for name, path in (("base", args.base), ("swiftkv", args.swiftkv)):
        start = time.perf_counter()
        llm = make_llm(str(path), args.kv_cache_bytes, max_len, args.max_num_batched_tokens,
                       enforce_eager=not args.compile)
        systems[name] = {"llm": llm, "path": str(path), "start_s": time.perf_counter() - start,
                         "capacity": kv_capacity(llm), "seconds": []}
    rng = random.Random(0)
    vocab = systems["base"]["llm"].llm_engine.vllm_config.model_config.hf_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def measure(name: str) -> float:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, vocab - 1000) for _ in range(args.prompt_tokens)])
                   for _ in range(args.prompts)]
        start = time.perf_counter()
        outputs = systems[name]["llm"].generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == 1 for o in outputs)
        return elapsed

    for name in systems:  # warm-up, untimed
        measure(name)
    from kvforge.tools.bench.machine_load import LoadProbe, flags

    probe = LoadProbe()  # other programs' CPU time during the timed repeats
    workers_before, timed_start = descendant_cpu_seconds(), time.perf_counter()
    for repeat in range(args.repeats):
        order = ["base", "swiftkv"] if repeat % 2 == 0 else ["swiftkv", "base"]
        for name in order:
            systems[name]["seconds"].append(measure(name))
            print(f"repeat {repeat} {name}: {systems[name]['seconds'][-1]:.2f} s", flush=True)

    tokens = args.prompts * args.prompt_tokens
    result: dict[str, Any] = {
        "benchmark": "vllm_swiftkv_prefill",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "prefill_tokens_per_measurement": tokens,
        "versions": {**versions(), "platform": platform.platform()},
        "cpu": _cpu_model(), "nproc": os.cpu_count(),
        "load_before": before,
    }
    for name, system in systems.items():
        median = statistics.median(system["seconds"])
        result[name] = {"path": system["path"], "engine_start_s": system["start_s"], "capacity": system["capacity"],
                        "seconds": system["seconds"], "median_s": median, "median_tokens_per_s": tokens / median}
    result["speedup"] = result["base"]["median_s"] / result["swiftkv"]["median_s"]
    environment = probe.report()
    workers = (descendant_cpu_seconds() - workers_before) / (time.perf_counter() - timed_start)
    if environment["foreign_cores"] is not None:  # vLLM's engine process is ours, not foreign
        environment["foreign_cores"] = round(max(0.0, environment["foreign_cores"] - workers), 3)
    environment["vllm_engine_process_cores"] = round(workers, 3)
    result["environment"] = environment
    spread = max(max(s["seconds"]) / min(s["seconds"]) for s in systems.values())
    result["flags"] = flags(result["environment"], args.repeats, spread)
    result["target"] = 1.5
    from kvforge.tools.report.provenance import provenance

    result["provenance"] = {**provenance(), "command": "python " + " ".join(shlex.quote(a) for a in sys.argv)}
    result["load_after"] = load_snapshot()
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"prefill tokens/s: base {result['base']['median_tokens_per_s']:.0f}, SwiftKV "
          f"{result['swiftkv']['median_tokens_per_s']:.0f}; speedup {result['speedup']:.2f}x (target 1.5x); "
          f"load before {before['loadavg']}, after {result['load_after']['loadavg']}")


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


if __name__ == "__main__":
    main()

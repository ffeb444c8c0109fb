"""JSON-printing vLLM runs for the plugin's tests and benchmark (run in the vLLM venv).

    python -m kvforge.integrations.vllm.driver generate --model DIR --prompt-ids FILE ...
    python -m kvforge.integrations.vllm.driver capacity --model DIR --kv-cache-bytes N
    python -m kvforge.integrations.vllm.driver serve-check --model DIR --timeout 300

Each prints one line `KVFORGE_JSON {...}` on stdout (vLLM's logs go to stderr/stdout
around it). Threads: `--threads` (default 2) sets OMP_NUM_THREADS and unbinds vLLM's OpenMP
threads before vLLM is imported, in this process and the engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MARKER = "KVFORGE_JSON "


def set_threads(threads: int, bind: str = "nobind") -> None:
    """Before vLLM is imported: `threads` OpenMP threads in every vLLM process, unbound, or
    bound as vLLM's VLLM_CPU_OMP_THREADS_BIND reads `bind` (one CPU list per rank, `|`
    between ranks: "0|1" gives each of two ranks its own core)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    import torch

    torch.set_num_threads(threads)


def emit(payload: dict[str, Any]) -> None:
    print(MARKER + json.dumps(payload), flush=True)


def parse_emitted(stdout: str) -> dict[str, Any]:
    """The payload of the last `KVFORGE_JSON` line (ValueError when there is none)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise ValueError("no KVFORGE_JSON line in the driver's output")


def make_llm(model: str, kv_cache_bytes: int, max_model_len: int, max_num_batched_tokens: int | None = None,
             enforce_eager: bool = True, max_num_seqs: int = 8, enable_prefix_caching: bool = False,
             log_stats: bool = False, kivi: bool = False, tensor_parallel_size: int = 1,
             pipeline_parallel_size: int = 1) -> Any:
    from kvforge.integrations.vllm import register

    register()  # also loaded through the entry point; idempotent
    from vllm import LLM

    kwargs: dict[str, Any] = dict(model=model, dtype="float32", max_model_len=max_model_len,
                                  enforce_eager=enforce_eager, kv_cache_memory_bytes=kv_cache_bytes,
                                  max_num_seqs=max_num_seqs, enable_prefix_caching=enable_prefix_caching,
                                  seed=0, disable_log_stats=not log_stats)
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if kivi:  # kvforge's KIVI backend (KVFORGE_VLLM_KIVI picks the setting); a block is one KIVI page
        from kvforge.integrations.vllm.kivi_options import kivi_config

        kwargs.update(attention_backend="CUSTOM", block_size=kivi_config().key_tokens)
    if tensor_parallel_size > 1 or pipeline_parallel_size > 1:  # one worker process per rank
        kwargs.update(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                      distributed_executor_backend="mp")
    return LLM(**kwargs)


def kv_capacity(llm: Any) -> dict[str, Any]:
    """KV cache blocks and tokens the engine allocated, and the cache layers behind them."""
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    hf = config.model_config.hf_config
    blocks = cache.num_gpu_blocks
    layers = hf.num_hidden_layers
    if getattr(hf, "num_key_value_layers", None) is not None and getattr(hf, "swiftkv", True):
        from kvforge.config import SwiftKVConfig

        layers_cached = SwiftKVConfig(int(hf.num_key_value_layers),
                                      int(getattr(hf, "key_value_group_size", None) or 1)).num_cache_layers(layers)
    else:
        layers_cached = layers
    return {"num_blocks": blocks, "block_size": cache.block_size,
            "tokens": None if blocks is None else blocks * cache.block_size,
            "kv_sharing_fast_prefill": cache.kv_sharing_fast_prefill,
            "num_layers": layers, "kv_cache_layers": layers_cached}


def versions() -> dict[str, Any]:
    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}


# -- subcommands ----------------------------------------------------------------------------
def run_generate(args: argparse.Namespace) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt_ids = json.loads(Path(args.prompt_ids).read_text())
    start = time.perf_counter()
    llm = make_llm(args.model, args.kv_cache_bytes, args.max_model_len, args.max_num_batched_tokens,
                   enforce_eager=not args.compile, enable_prefix_caching=not args.no_prefix_caching,
                   log_stats=True, kivi=args.kivi, tensor_parallel_size=args.tensor_parallel_size,
                   pipeline_parallel_size=args.pipeline_parallel_size)
    started = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
    if args.one_at_a_time:  # each prompt finishes before the next starts, in one engine (and prefix cache)
        outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    emit({"outputs": [{"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(o.outputs[0].token_ids),
                       "text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason} for o in outputs],
          "capacity": kv_capacity(llm), "prefix_cache": prefix_cache_counters(llm), "start_s": started,
          "versions": versions()})


def prefix_cache_counters(llm: Any) -> dict[str, float]:
    """vLLM's prefix-cache query/hit token counters ({} when its metrics are unavailable)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # metrics are informative only
        return {}
    return {m.name.removeprefix("vllm:"): m.value for m in metrics
            if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits") and hasattr(m, "value")}


def run_capacity(args: argparse.Namespace) -> None:
    llm = make_llm(args.model, args.kv_cache_bytes, args.max_model_len, enforce_eager=not args.compile,
                   kivi=args.kivi)
    emit({"model": args.model, "kv_cache_bytes": args.kv_cache_bytes, "capacity": kv_capacity(llm),
          "versions": versions()})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_serve_check(args: argparse.Namespace) -> None:
    """Start `vllm serve` (through kvforge's launcher) on 127.0.0.1, ask it once with the
    `openai` client, stop it. Bounded by --timeout; the server is killed in every case."""
    import openai

    port = _free_port()
    command = [sys.executable, "-m", "kvforge.integrations.vllm.serve", args.model, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len",
               str(args.max_model_len), "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
               "--served-model-name", "swiftkv"] + ([] if args.compile else ["--enforce-eager"])
    if args.max_num_seqs is not None:
        command += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.pipeline_parallel_size > 1:  # --omp-bind reaches the server's workers through the environment
        command += ["--pipeline-parallel-size", str(args.pipeline_parallel_size),
                    "--distributed-executor-backend", "mp"]
    if args.kivi:  # the KIVI setting reaches the server through KVFORGE_VLLM_KIVI in its environment
        from kvforge.integrations.vllm.kivi_options import kivi_config

        command += ["--attention-backend", "CUSTOM", "--block-size", str(kivi_config().key_tokens)]
    deadline = time.monotonic() + args.timeout
    log = open(args.log, "w") if args.log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(),
                              start_new_session=True)
    result: dict[str, Any] = {"port": port, "command": command}
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", timeout=args.request_timeout,
                               max_retries=0)
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {server.returncode} before answering")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve did not answer within {args.timeout} s")
            try:
                result["models"] = [m.id for m in client.models.list().data]
                break
            except openai.APIConnectionError:
                time.sleep(2)
        result["ready_s"] = args.timeout - (deadline - time.monotonic())
        chat = client.chat.completions.create(model="swiftkv", temperature=0, max_tokens=args.max_tokens,
                                              messages=[{"role": "user", "content": args.prompt}])
        result["chat"] = {"text": chat.choices[0].message.content, "finish_reason": chat.choices[0].finish_reason,
                          "completion_tokens": chat.usage.completion_tokens if chat.usage else None}
        completion = client.completions.create(model="swiftkv", prompt=args.completion_prompt, temperature=0,
                                               max_tokens=args.max_tokens)
        result["completion"] = {"text": completion.choices[0].text,
                                "finish_reason": completion.choices[0].finish_reason}
        result["ok"] = True
    except Exception as error:  # reported, not raised: the caller decides
        result["ok"] = False
        result["error"] = f"{type(error).__name__}: {error}"
    finally:
        _stop(server)
        if log is not subprocess.DEVNULL:
            log.close()
    result["server_returncode"] = server.returncode
    result["versions"] = versions()
    emit(result)


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM the server's process group (it started its own session), SIGKILL after 30 s."""
    import signal

    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvforge.integrations.vllm.driver")
    parser.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads (2)")
    parser.add_argument("--omp-bind", default="nobind",
                        help="VLLM_CPU_OMP_THREADS_BIND for vLLM's workers (nobind; e.g. '0|1': a core per rank)")
    verbs = parser.add_subparsers(dest="verb", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", required=True, help="checkpoint directory")
    common.add_argument("--kv-cache-bytes", type=int, default=256 * 2**20, help="vLLM kv_cache_memory_bytes")
    common.add_argument("--max-model-len", type=int, default=2048)
    common.add_argument("--compile", action="store_true", help="let vLLM torch.compile (default: enforce_eager)")
    common.add_argument("--kivi", action="store_true",
                        help="kvforge's KIVI attention backend (setting: KVFORGE_VLLM_KIVI, kivi_options.py)")
    common.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM tensor parallel ranks")
    common.add_argument("--pipeline-parallel-size", type=int, default=1, help="vLLM pipeline parallel stages")
    gen = verbs.add_parser("generate", parents=[common], help="greedy generation from token ids")
    gen.add_argument("--prompt-ids", required=True, help="JSON file: a list of token-id lists")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--max-num-batched-tokens", type=int, default=None)
    gen.add_argument("--no-prefix-caching", action="store_true", help="(default: on, as in vLLM)")
    gen.add_argument("--one-at-a-time", action="store_true",
                     help="generate each prompt in its own call, in order (a later prompt can hit the cached "
                          "prefix of an earlier one)")
    verbs.add_parser("capacity", parents=[common], help="KV cache blocks/tokens under --kv-cache-bytes")
    serve = verbs.add_parser("serve-check", parents=[common], help="vllm serve + one openai client request")
    serve.add_argument("--timeout", type=float, default=300.0, help="seconds until the server must answer")
    serve.add_argument("--prompt", default="What is the capital of France?", help="chat message")
    serve.add_argument("--completion-prompt", default="The capital of France is", help="completion prompt")
    serve.add_argument("--max-tokens", type=int, default=16)
    serve.add_argument("--log", default=None, help="file for the server's output")
    serve.add_argument("--request-timeout", type=float, default=120.0,
                       help="seconds per client request (the first may build kvforge's C++ kernels)")
    serve.add_argument("--max-num-seqs", type=int, default=None,
                       help="vLLM's max_num_seqs (default: vLLM's; with --kivi it sizes the exact copies)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    set_threads(args.threads, args.omp_bind)
    {"generate": run_generate, "capacity": run_capacity, "serve-check": run_serve_check}[args.verb](args)


if __name__ == "__main__":
    main()

"""`kvforge serve`: the OpenAI-compatible server on uvicorn.

Everything that can be checked before the model loads is checked first (host, port free,
engine options, cache spec). Binds 127.0.0.1:8000 by default; a non-loopback host without
an API key gets a warning. SIGTERM / SIGINT: stop accepting, abort the requests in flight
(their streams end with finish_reason "abort"), exit 0.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import socket
import sys
import threading
from typing import TYPE_CHECKING

from kvforge.errors import ConfigError, require

if TYPE_CHECKING:
    from kvforge.engine.async_engine import AsyncEngine, StepObserver
    from kvforge.engine.llm import LLM

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
API_KEY_ENV = "KVFORGE_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
INTERRUPTED_EXIT_CODE = 130  # the shell's code for a process ended by SIGINT

logger = logging.getLogger(__name__)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Options of `serve` beyond the model, engine and sampling ones `generate` has."""
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind ({DEFAULT_HOST}: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port ({DEFAULT_PORT})")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV} if set)")
    parser.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once (256)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context limit of a request (default: the model's)")
    parser.add_argument("--admission", choices=("optimistic", "reserve"), default="optimistic",
                        help="optimistic (admit when the next chunk fits, preempt later) or reserve (admit when "
                             "prompt + max_tokens of every running request fit; no preemption)")
    parser.add_argument("--step-timing", action="store_true",
                        help="time each engine step by part (linear, attention, sampling, other) in /metrics")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="uvicorn log level (info)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port_free(host: str, port: int) -> None:
    require(0 < port < 65536, "port", port, "must be in [1, 65535]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except socket.gaierror as exc:  # a name or address that does not resolve
            raise ConfigError("host", host, f"must be an address or a name of this machine ({exc.strerror}); "
                                            "127.0.0.1 serves this machine only, 0.0.0.0 every interface") from None
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:  # a valid address of another machine
                raise ConfigError("host", host, f"is not an address of this machine ({exc.strerror}); 127.0.0.1 "
                                                "serves this machine only, 0.0.0.0 every interface") from None
            raise ConfigError("port", port, f"cannot bind {host}:{port} ({exc.strerror}); choose a free --port") from exc


def load_engine(args: argparse.Namespace, observer: StepObserver | None = None) -> tuple[AsyncEngine, LLM]:
    """The model of `args`, loaded on the engine thread, which then steps it: one OS thread
    runs every torch operation of the server (why: `kvforge.engine.async_engine`)."""
    from kvforge.engine.async_engine import AsyncEngine
    from kvforge.engine.llm import LLM

    def load() -> LLM:
        return LLM(model=args.model, load_format=args.load_format, swiftkv=args.swiftkv, cache=args.cache,
                   cache_options=args.cache_opt, dtype=args.dtype, kv_budget=args.kv_budget,
                   max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                   max_model_len=args.max_model_len, admission=args.admission, step_timing=args.step_timing,
                   prefix_caching=args.prefix_caching, device=args.device, early_exit=args.early_exit,
                   enforce_eager=args.enforce_eager, max_seq_len_to_capture=args.max_seq_len_to_capture,
                   prepack_weights=args.prepack_weights)

    try:
        return AsyncEngine.build_on_engine_thread(load, lambda llm: llm.engine, observer)
    except KeyboardInterrupt:
        # Ctrl-C while the engine thread loads: that thread cannot be stopped, and ending
        # the interpreter under it aborts the process from inside torch; leave at once.
        print("kvforge serve: interrupted while loading the model", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED_EXIT_CODE)


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from kvforge.serve.app import create_app
        from kvforge.serve.graceful import GracefulServer
        from kvforge.serve.metrics import ServerMetrics
    except ImportError as exc:
        raise ConfigError("serve", exc.name, "needs the serve extra: pip install 'kvforge[serve]'") from exc
    from kvforge.serve.served_model import ModelInfo, ServedModel

    # An empty key (often an unset "$KEY") would serve with no key at all: refused.
    given, source = (args.api_key, "api_key") if args.api_key is not None else (os.environ.get(API_KEY_ENV), API_KEY_ENV)
    require(given is None or given.strip() != "", source, given,
            f"must not be empty: leave --api-key out and {API_KEY_ENV} unset to serve without a key")
    api_key = given
    require(args.max_num_seqs >= 1, "max_num_seqs", args.max_num_seqs, "must be >= 1")
    check_port_free(args.host, args.port)
    if args.max_model_len is not None:
        from kvforge.preflight import model_context

        context = model_context(args.model, args.swiftkv, load_format=args.load_format)
        require(2 <= args.max_model_len <= context, "max_model_len", args.max_model_len,
                f"must be in [2, {context}] ({args.model}'s context)")
    if not is_loopback(args.host) and api_key is None:
        print(f"kvforge serve: warning: {args.host} is reachable from other machines and no --api-key is set: "
              "anyone who can reach it can use the model", file=sys.stderr)
    name = args.served_model_name or args.model
    metrics = ServerMetrics(name)
    engine, llm = load_engine(args, metrics.observe_step)
    for line in llm.start_up_lines():
        print(f"kvforge serve: {line}", file=sys.stderr)
    info = ModelInfo(args.model, args.swiftkv, str(llm.cache_spec), str(llm.dtype).removeprefix("torch."),
                     llm.source.weights)
    app = create_app(ServedModel(name, engine, llm.tokenizer, info), metrics, api_key)
    # Structured output wraps the tokenizer for llguidance once (up to seconds for a large
    # vocabulary): done now, beside start-up, so the first such request does not wait for it.
    threading.Thread(target=engine.engine.grammars.warm_up, name="kvforge-grammar-warm-up", daemon=True).start()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    print(f"kvforge serve: {name} ({info.banner()}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    GracefulServer(config, engine).run()
    return 0

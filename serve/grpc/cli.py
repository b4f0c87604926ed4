"""`deepinfer serve`: the gRPC server from the command line.

The `deepinfer` command line (`deepinfer.serve.cli`) wires this in:

    from deepinfer.serve.grpc.cli import add_serve_parser, run_serve
    add_serve_parser(subparsers)          # adds `serve`, with set_defaults(func=run_serve)

`run_serve(args)` reads only `args`: no environment variables are read here. The bearer token
comes from `--auth-token-file` (never from argv); a caller that has the token from elsewhere
(e.g. the CLI reading an environment variable) sets `args.auth_token` before calling. When the CLI
sets `args.env` (its `EnvDefaults`), unset `--prefill-mode` / `--keep-tokens` fall back to it.

The server listens before the model is loaded (health NOT_SERVING until the weights are loaded
and the warm-up compiled every step shape) and drains on SIGTERM / SIGINT: health NOT_SERVING, new
streams refused, `--shutdown-grace` seconds for the ones in flight, then the rest are aborted.

Exit codes: 0 after a clean shutdown, 1 when the model fails to load, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

__all__ = ["add_serve_parser", "build_settings", "run_serve"]

log = logging.getLogger("deepinfer.grpc")


class _BadArgs(Exception):
    pass


def add_serve_parser(subparsers, env=None) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "serve", help="serve the engine over gRPC (deepinfer.engine.v1.LlmEngine, health, reflection)",
        description="Serve one engine over gRPC: the deepinfer.engine.v1.LlmEngine service (SGLang-compatible "
                    "messages), grpc.health.v1 and server reflection. Binds 127.0.0.1 unless --host says otherwise.")
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    net.add_argument("--allow-insecure-remote", action="store_true",
                     help="allow a non-loopback --host without --tls-cert or --auth-token-file (refused otherwise)")
    net.add_argument("--port", type=int, default=50051, help="port (default 50051; 0 picks a free one)")
    net.add_argument("--max-concurrent-streams", type=int, default=256, metavar="N",
                     help="Generate calls in flight, server-wide; more get RESOURCE_EXHAUSTED (default 256)")
    net.add_argument("--max-queue", type=int, default=256, metavar="N",
                     help="requests in flight beyond the cache slots (waiting for a slot); more get "
                          "RESOURCE_EXHAUSTED (default 256)")
    net.add_argument("--max-message-bytes", type=int, default=16 * 1024 * 1024, metavar="B",
                     help="largest request / response message (default 16 MiB)")
    net.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                     help="max_new_tokens of requests that leave it unset (default: up to the context)")
    net.add_argument("--tls-cert", default=None, metavar="PEM", help="server certificate chain (with --tls-key)")
    net.add_argument("--tls-key", default=None, metavar="PEM", help="server private key (with --tls-cert)")
    net.add_argument("--auth-token-file", default=None, metavar="FILE",
                     help="require `authorization: Bearer <token>` on every RPC, the token read from FILE "
                          "(the health service stays open unless --auth-health)")
    net.add_argument("--auth-health", action="store_true", help="require the token for the health service too")
    net.add_argument("--shutdown-grace", type=float, default=30.0, metavar="S",
                     help="on SIGTERM, seconds for in-flight streams to finish before they are aborted (default 30)")
    net.add_argument("--metrics-port", type=int, default=None, metavar="N",
                     help="also serve Prometheus metrics (vLLM names) over HTTP on --host:N")
    net.add_argument("--served-model-name", default=None, metavar="NAME",
                     help="model name reported by GetModelInfo (default: the model's)")
    net.add_argument("--no-warmup", action="store_true",
                     help="report SERVING right after loading, without compiling every step shape first "
                          "(fast start; the first request of each new shape then waits for its compilation)")
    from deepinfer.serve.engine_args import EnvDefaults, add_engine_options  # what every command shares

    add_engine_options(p.add_argument_group("engine"), env if env is not None else EnvDefaults())
    p.set_defaults(func=run_serve)
    return p


def _read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise _BadArgs(f"--auth-token-file: cannot read {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise _BadArgs(f"--auth-token-file: {path!r} is not UTF-8 text") from None
    if not token:
        raise _BadArgs(f"--auth-token-file: {path!r} is empty")
    if any(c.isspace() for c in token) or not token.isprintable():
        raise _BadArgs(f"--auth-token-file: the token in {path!r} must be one line without spaces")
    return token


def build_settings(args: argparse.Namespace):
    """`ServerSettings` from parsed arguments (bad values -> `_BadArgs`)."""
    from deepinfer.serve.grpc.server import ServerSettings

    if not 0 <= args.port <= 65535:
        raise _BadArgs(f"--port must be in [0, 65535], got {args.port}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise _BadArgs(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    for name in ("max_concurrent_streams", "max_message_bytes"):
        if getattr(args, name) < 1:
            raise _BadArgs(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_queue < 0:
        raise _BadArgs(f"--max-queue must be non-negative, got {args.max_queue}")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise _BadArgs(f"--default-max-tokens must be at least 1, got {args.default_max_tokens}")
    if args.shutdown_grace < 0:
        raise _BadArgs(f"--shutdown-grace must be non-negative, got {args.shutdown_grace}")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise _BadArgs("--tls-cert and --tls-key go together")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not os.path.isfile(path):
            raise _BadArgs(f"{flag}: {path!r} does not exist")
    if args.tls_cert is not None:
        from deepinfer.serve.grpc.tls import TlsFileError, check_tls_files

        try:
            check_tls_files(args.tls_cert, args.tls_key, cert_label="--tls-cert", key_label="--tls-key")
        except TlsFileError as e:
            raise _BadArgs(str(e)) from None
    token = getattr(args, "auth_token", None)
    if args.auth_token_file is not None:
        if token is not None:
            raise _BadArgs("give the auth token once: --auth-token-file or the caller's token, not both")
        token = _read_token(args.auth_token_file)
    if args.auth_health and token is None:
        raise _BadArgs("--auth-health needs an auth token (--auth-token-file)")
    return ServerSettings(
        host=args.host, port=args.port, max_message_bytes=args.max_message_bytes,
        max_concurrent_streams=args.max_concurrent_streams, max_queue=args.max_queue,
        default_max_tokens=args.default_max_tokens, tls_cert=args.tls_cert, tls_key=args.tls_key,
        auth_token=token, auth_health=args.auth_health, shutdown_grace_s=args.shutdown_grace,
        warmup=not args.no_warmup, served_model_name=args.served_model_name,
        allow_insecure_remote=args.allow_insecure_remote)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(...)` keyword arguments from the engine options (shared with `deepinfer generate`)."""
    from deepinfer.serve.engine_args import CliError, check_model_arg, engine_settings, select_accelerator_from

    if any(v is not None for v in (args.coordinator, args.num_processes, args.process_id)):
        raise _BadArgs("--coordinator/--num-processes/--process-id: the gRPC server runs in one process "
                       "(use --mesh for the devices of this host); multi-process runs are for generate and run-batch")
    try:
        kwargs = engine_settings(args)
        check_model_arg(args)
        if kwargs["accelerator"] != "auto":  # before listening: a missing backend is bad input, not a load failure
            select_accelerator_from(args)
    except CliError as e:
        raise _BadArgs(str(e)) from None
    return {**kwargs, "log_stats_interval": None}


def _loader(args: argparse.Namespace, kwargs: dict[str, Any]):
    """Runs on the engine thread after the server is listening: weights, engine (and the
    persistent compilation cache, before anything compiles)."""

    def load():
        from deepinfer.model.tokenizer import tokenizer_path
        from deepinfer.serve.api.llm import LLM
        from deepinfer.serve.grpc.server import LoadedModel

        llm = LLM(args.model, **kwargs)  # turns on the persistent compilation cache (kwargs)
        tok_path = os.path.abspath(args.tokenizer) if args.tokenizer else str(tokenizer_path())
        return LoadedModel(llm.engine, model_name=str(llm.model_name), model_path=str(llm.model_dir),
                           tokenizer_path=tok_path)

    return load


async def _serve(args: argparse.Namespace, settings, loader) -> int:
    from deepinfer.serve.grpc.server import GrpcServer

    server = GrpcServer(loader, settings)
    try:
        port = await server.start()
    except (OSError, RuntimeError) as e:
        print(f"deepinfer serve: error: cannot listen on {settings.host}:{settings.port}: {e}", file=sys.stderr)
        return 2
    print(f"deepinfer serve: listening on {settings.exposure(port)}; loading the model...", flush=True)
    metrics_server = None
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        metrics_server, _ = start_http_server(args.metrics_port, addr=settings.host, registry=server.metrics_registry())
        print(f"deepinfer serve: Prometheus metrics on http://{settings.host}:{metrics_server.server_port}/metrics",
              flush=True)
        from deepinfer.serve.grpc.tls import is_loopback

        if not is_loopback(settings.host):
            log.warning("the Prometheus metrics on %s:%d are plaintext HTTP without auth, reachable from other "
                        "machines", settings.host, metrics_server.server_port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / platform
            pass
    ready = asyncio.ensure_future(server.wait_ready())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if ready.done() and ready.result():
        print(f"deepinfer serve: SERVING {server._model_name()} (health: SERVING)", flush=True)
        await stopped
    elif ready.done():
        print(f"deepinfer serve: error: the model failed to load: {server.load_error}", file=sys.stderr)
        code = 1
    for task in (ready, stopped):
        task.cancel()
    print("deepinfer serve: draining (health: NOT_SERVING)...", flush=True)
    await server.shutdown(settings.shutdown_grace_s)
    if metrics_server is not None:
        metrics_server.shutdown()
    print("deepinfer serve: stopped", flush=True)
    return code


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM / SIGINT; returns the exit code (see the module docstring)."""
    try:
        settings = build_settings(args)
        kwargs = _engine_kwargs(args)
    except (_BadArgs, ValueError) as e:
        print(f"deepinfer serve: error: {e}", file=sys.stderr)
        return 2
    logger = logging.getLogger("deepinfer")
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return asyncio.run(_serve(args, settings, _loader(args, kwargs)))

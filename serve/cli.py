"""The `deepinfer` command line.

Subcommands:

    deepinfer config show NAME_OR_PATH [--json]
        Print a resolved model config (a preset name, a checkpoint directory or a config.json).
    deepinfer forward (--preset NAME | --checkpoint DIR) --prompt TEXT [--top N] ...
        Tokenize a prompt (BOS first), run one full forward pass, print the most likely next tokens.
    deepinfer convert SRC DST
        Official safetensors checkpoint -> orbax fast-restart checkpoint.

This module is the only place that reads `DEEPINFER_*` environment variables. It reads them once,
in `main`, and turns them into argument defaults; everything below receives explicit values.
Currently read:

    DEEPINFER_COMPILATION_CACHE   default for `--compilation-cache` (JAX persistent compile cache)

Exit codes: 0 success, 2 bad input (one line on stderr naming the problem), 130 interrupted.
JAX and the model are imported only by the subcommands that need them, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, NoReturn, Sequence

__all__ = ["CliError", "EnvDefaults", "build_parser", "main"]

PROG = "deepinfer"
DTYPES = ("float32", "bfloat16")


class CliError(Exception):
    """Bad user input; reported as one line on stderr with exit code 2."""


@dataclass(frozen=True)
class EnvDefaults:
    """The `DEEPINFER_*` environment variables, read once at the command-line boundary."""

    compilation_cache: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> EnvDefaults:
        return cls(compilation_cache=environ.get("DEEPINFER_COMPILATION_CACHE") or None)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `deepinfer forward: error: ...` and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# ---- helpers -------------------------------------------------------------------------------


def _known_presets() -> str:
    from deepinfer.model import PRESETS

    return ", ".join(sorted(PRESETS))


def _resolve_config(name_or_path: str, **overrides: Any):
    """`load_config` with user-facing errors."""
    from deepinfer.model import PRESETS, ConfigError, load_config

    if name_or_path not in PRESETS and not os.path.exists(name_or_path):
        raise CliError(
            f"{name_or_path!r} is neither a known preset ({_known_presets()}) nor an existing path"
        )
    try:
        return load_config(name_or_path, **overrides)
    except (ConfigError, FileNotFoundError, OSError, TypeError) as e:
        raise CliError(f"cannot load config {name_or_path!r}: {e}") from None


def _format_value(value: Any) -> str:
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return str(value)


def _dense_param_bytes(config) -> int:
    import math

    import jax

    from deepinfer.model import abstract_params

    leaves = jax.tree.leaves(abstract_params(config))
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves)


def _available_memory_bytes() -> int | None:
    """Free memory where random weights would be allocated: device memory limit on an
    accelerator, else the host's MemAvailable. None when unknown."""
    import jax

    device = jax.devices()[0]
    if device.platform != "cpu":
        try:
            stats = device.memory_stats() or {}
        except Exception:  # noqa: BLE001 - not every backend implements memory_stats
            stats = {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _seconds(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def _enable_compilation_cache(directory: str | None) -> None:
    if not directory:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# ---- subcommands ---------------------------------------------------------------------------


def cmd_config_show(args: argparse.Namespace) -> int:
    config = _resolve_config(args.name_or_path)
    values = config.to_dict()
    if args.json:
        print(json.dumps(values, indent=2))
        return 0
    import math

    from deepinfer.model import param_specs

    derived = {
        "param_count": sum(math.prod(s.shape) for s in param_specs(config)),
        "global_cache_bytes_per_token": config.global_cache_bytes_per_token(),
    }
    width = max(len(k) for k in (*values, *derived)) + 1
    for key, value in values.items():
        print(f"{key + ':':<{width}} {_format_value(value)}")
    print("# derived")
    for key, value in derived.items():
        print(f"{key + ':':<{width}} {value:,}" if isinstance(value, int) else f"{key + ':':<{width}} {value:g}")
    return 0


def cmd_forward(args: argparse.Namespace) -> int:
    if args.prompt == "":
        raise CliError("empty prompt: pass some text with --prompt")
    if args.top < 1:
        raise CliError(f"--top must be at least 1, got {args.top}")
    overrides: dict[str, Any] = {}
    if args.dtype is not None:
        overrides["dtype"] = args.dtype
    if args.no_fake_quant:
        overrides["fake_quant"] = False

    if args.preset is not None:
        from deepinfer.model import PRESETS

        if args.preset not in PRESETS:
            raise CliError(f"unknown preset {args.preset!r}; known presets: {_known_presets()}")
    elif not os.path.isdir(args.checkpoint):
        raise CliError(f"checkpoint directory {args.checkpoint!r} does not exist")

    _enable_compilation_cache(args.compilation_cache)
    import jax
    import numpy as np

    from deepinfer.model import forward, init_params, load_checkpoint
    from deepinfer.model.tokenizer import decode_token, load_tokenizer

    t0 = time.perf_counter()
    if args.preset is not None:
        config = _resolve_config(args.preset, **overrides)
        need, have = _dense_param_bytes(config), _available_memory_bytes()
        if have is not None and need > have:
            raise CliError(
                f"random weights for preset {args.preset!r} need {_gib(need)} but only {_gib(have)} "
                "is available; use a smaller preset (tiny-v4.1) or --checkpoint"
            )
        params = init_params(config, args.seed)
        source = f"random weights (seed {args.seed})"
    else:
        try:
            config, params = load_checkpoint(args.checkpoint, **overrides)
        except (ValueError, OSError) as e:  # CheckpointError and ConfigError are ValueErrors
            raise CliError(f"cannot load checkpoint {args.checkpoint!r}: {e}") from None
        source = f"checkpoint {args.checkpoint}"
    jax.block_until_ready(params)
    t_params = time.perf_counter() - t0

    t0 = time.perf_counter()
    tokenizer = load_tokenizer()
    prompt_ids = tokenizer.encode(args.prompt).ids
    ids = np.asarray([config.bos_token_id, *prompt_ids], dtype=np.int32)
    t_tokenize = time.perf_counter() - t0
    if int(ids.max()) >= config.vocab_size:
        raise CliError(f"token id {int(ids.max())} is outside the model's vocabulary ({config.vocab_size})")

    t0 = time.perf_counter()
    logits = forward(params, config, ids)
    last = np.asarray(jax.block_until_ready(logits)[-1], dtype=np.float64)
    t_forward = time.perf_counter() - t0
    if not np.all(np.isfinite(last)):
        print(f"{PROG} forward: warning: the logits contain non-finite values", file=sys.stderr)

    probs = np.exp(last - last.max())
    probs /= probs.sum()
    top = min(args.top, probs.shape[0])
    order = np.lexsort((np.arange(probs.shape[0]), -probs))[:top]  # prob descending, then id

    print(f"model   : {config.name} ({source})")
    print(f"numerics: dtype {config.dtype}, fake-quant {'on' if config.fake_quant else 'off'}, "
          f"backend {jax.default_backend()}")
    print(f"prompt  : {args.prompt!r} -> {len(ids)} tokens (BOS + {len(prompt_ids)})")
    print(f"timings : params {_seconds(t_params)}, tokenize {_seconds(t_tokenize)}, "
          f"compile+run {_seconds(t_forward)}")
    print(f"top-{top} next tokens:")
    print(f"{'rank':>4}  {'id':>6}  {'prob':>6}  token")
    for rank, token_id in enumerate(order, start=1):
        text = decode_token(tokenizer, int(token_id))
        print(f"{rank:>4}  {int(token_id):>6}  {probs[token_id]:.4f}  {text!r}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.src):
        raise CliError(f"source checkpoint directory {args.src!r} does not exist")
    if os.path.exists(args.dst) and (not os.path.isdir(args.dst) or os.listdir(args.dst)) and not args.overwrite:
        raise CliError(f"destination {args.dst!r} exists and is not empty (pass --overwrite to replace it)")
    if os.path.abspath(args.src) == os.path.abspath(args.dst):
        raise CliError("source and destination are the same directory")

    from deepinfer.model import convert_to_orbax

    t0 = time.perf_counter()
    try:
        config = convert_to_orbax(args.src, args.dst)
    except (ValueError, OSError) as e:  # CheckpointError and ConfigError are ValueErrors
        raise CliError(f"cannot convert {args.src!r}: {e}") from None
    elapsed = time.perf_counter() - t0
    n_files, n_bytes = 0, 0
    for root, _, files in os.walk(args.dst):
        for name in files:
            n_files += 1
            n_bytes += os.path.getsize(os.path.join(root, name))
    print(f"wrote orbax checkpoint {args.dst} (model {config.name}, {n_files} files, "
          f"{n_bytes / 2**20:.1f} MiB) in {_seconds(elapsed)}")
    print(f"load it with: {PROG} forward --checkpoint {args.dst} --prompt TEXT")
    return 0


# ---- parser and entry point ----------------------------------------------------------------


def _usage_of(parser: argparse.ArgumentParser):
    """Handler for a command group invoked without a subcommand: help on stderr, exit code 2."""
    def show(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return show


def build_parser(env: EnvDefaults | None = None) -> argparse.ArgumentParser:
    env = env if env is not None else EnvDefaults()
    from deepinfer import __version__

    parser = _Parser(
        prog=PROG,
        description="DeepInfer-JAX: DeepSeek-V4.1-Flash inference in JAX.",
        epilog=f"Run `{PROG} COMMAND --help` for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.set_defaults(func=_usage_of(parser), command=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p_config = sub.add_parser("config", help="inspect model configs")
    config_sub = p_config.add_subparsers(dest="config_command", metavar="ACTION", parser_class=_Parser)
    p_show = config_sub.add_parser("show", help="print a resolved config (preset, directory or config.json)")
    p_show.add_argument("name_or_path", metavar="NAME_OR_PATH", help="preset name, checkpoint directory or config.json")
    p_show.add_argument("--json", action="store_true", help="print JSON instead of aligned key: value lines")
    p_show.set_defaults(func=cmd_config_show)
    p_config.set_defaults(func=_usage_of(p_config))  # `deepinfer config` without an action

    p_fwd = sub.add_parser("forward", help="one forward pass over a prompt; print the top next tokens")
    src = p_fwd.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", metavar="NAME", help="a preset with random weights (e.g. tiny-v4.1)")
    src.add_argument("--checkpoint", metavar="DIR", help="an official or orbax checkpoint directory")
    p_fwd.add_argument("--prompt", required=True, metavar="TEXT", help="prompt text (BOS is prepended)")
    p_fwd.add_argument("--seed", type=int, default=0, help="seed of the random weights (presets only; default 0)")
    p_fwd.add_argument("--top", type=int, default=5, metavar="N", help="how many next tokens to list (default 5)")
    p_fwd.add_argument("--no-fake-quant", action="store_true",
                       help="skip the QAT fake-quantization of KV and indexer activations")
    p_fwd.add_argument("--dtype", choices=DTYPES, default=None,
                       help="activation dtype (default: the config's, float32 for tiny-v4.1)")
    p_fwd.add_argument("--compilation-cache", default=env.compilation_cache, metavar="DIR",
                       help="JAX persistent compilation cache directory "
                            "(default: $DEEPINFER_COMPILATION_CACHE, else none)")
    p_fwd.set_defaults(func=cmd_forward)

    p_conv = sub.add_parser("convert", help="official checkpoint -> orbax fast-restart checkpoint")
    p_conv.add_argument("src", metavar="SRC", help="official-format checkpoint directory")
    p_conv.add_argument("dst", metavar="DST", help="output directory (must not exist or be empty)")
    p_conv.add_argument("--overwrite", action="store_true", help="allow a non-empty DST")
    p_conv.set_defaults(func=cmd_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `deepinfer` console script; returns the exit code."""
    env = EnvDefaults.from_environ(os.environ)
    parser = build_parser(env)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version and parse errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return args.func(args)
    except CliError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `deepinfer config show X | head`: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())

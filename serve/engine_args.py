"""The engine options every command shares (`deepinfer generate`, `run-batch`, `serve`): their
arguments, the `DEEPINFER_*` variables they fall back to (read once, at the command-line
boundary, into `EnvDefaults`), and the `LLM(...)` keyword arguments they become. Bad values raise
`CliError`, which the commands report as one line with exit code 2.

Only the standard library at import time: `--help` stays fast; JAX and the model are imported by
the functions that need them.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["CliError", "DTYPES", "EnvDefaults", "PREFILL_MODES", "accelerator_name", "add_accelerator_option",
           "add_compilation_cache_options", "add_engine_options", "check_model_arg", "compilation_cache_dir",
           "engine_settings", "select_accelerator_from"]

DTYPES = ("float32", "bfloat16")
PREFILL_MODES = ("full", "compact")  # = serve.engine.engine.PREFILL_MODES (not imported: it imports JAX)
DEFAULT_PREFILL_MODE = "compact"
DEFAULT_KEEP_TOKENS = 140
ENV_PREFILL_MODE = "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"
ENV_KEEP_TOKENS = "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"
ENV_ACCELERATOR = "DEEPINFER_ACCELERATOR"


class CliError(Exception):
    """Bad user input; reported as one line on stderr with exit code 2."""


@dataclass(frozen=True)
class EnvDefaults:
    """The `DEEPINFER_*` environment variables, read once at the command-line boundary."""

    compilation_cache: str | None = None
    # raw strings, validated by the commands that use them (a bad value must not break the others)
    prefill_mode: str | None = None
    keep_tokens: str | None = None
    mesh: str | None = None
    coordinator: str | None = None
    num_processes: str | None = None
    process_id: str | None = None
    accelerator: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> EnvDefaults:
        return cls(
            compilation_cache=environ.get("DEEPINFER_COMPILATION_CACHE") or None,
            prefill_mode=environ.get(ENV_PREFILL_MODE) or None,
            keep_tokens=environ.get(ENV_KEEP_TOKENS) or None,
            mesh=environ.get("DEEPINFER_MESH") or None,
            coordinator=environ.get("DEEPINFER_COORDINATOR") or None,
            num_processes=environ.get("DEEPINFER_NUM_PROCESSES") or None,
            process_id=environ.get("DEEPINFER_PROCESS_ID") or None,
            accelerator=environ.get(ENV_ACCELERATOR) or None,
        )

    def resolved_prefill_mode(self) -> str:
        """`DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE`, else compact."""
        if self.prefill_mode is None:
            return DEFAULT_PREFILL_MODE
        mode = self.prefill_mode.strip().lower()
        if mode not in PREFILL_MODES:
            raise CliError(f"{ENV_PREFILL_MODE}={self.prefill_mode!r}: must be one of {', '.join(PREFILL_MODES)}")
        return mode

    def resolved_accelerator(self) -> str:
        """`DEEPINFER_ACCELERATOR`, else auto."""
        from deepinfer.pallas_kernels.accelerator import normalize

        try:
            return "auto" if self.accelerator is None else normalize(self.accelerator, ENV_ACCELERATOR)
        except ValueError as e:
            raise CliError(str(e)) from None

    def resolved_keep_tokens(self) -> int:
        """`DEEPINFER_YOCO_PREFILL_KEEP_TOKENS`, else 140."""
        if self.keep_tokens is None:
            return DEFAULT_KEEP_TOKENS
        try:
            return int(self.keep_tokens.strip())
        except ValueError:
            raise CliError(f"{ENV_KEEP_TOKENS}={self.keep_tokens!r}: must be an integer") from None


def select_accelerator_from(args: argparse.Namespace):
    """The `Accelerator` of --accelerator (default: $DEEPINFER_ACCELERATOR, else auto)."""
    from deepinfer.pallas_kernels.accelerator import select_accelerator

    try:
        return select_accelerator(accelerator_name(args))
    except ValueError as e:
        raise CliError(str(e)) from None


def accelerator_name(args: argparse.Namespace) -> str:
    env: EnvDefaults = getattr(args, "env", None) or EnvDefaults()
    return args.accelerator if args.accelerator is not None else env.resolved_accelerator()


def add_accelerator_option(p) -> None:
    from deepinfer.pallas_kernels.accelerator import ACCELERATORS

    p.add_argument("--accelerator", choices=ACCELERATORS, default=None,
                   help="the devices and kernels to run on: auto (JAX's default backend), cuda, ascend (an "
                        "Ascend PJRT plugin, reference kernels) or cpu (default: $DEEPINFER_ACCELERATOR, else auto)")


def compilation_cache_dir(args: argparse.Namespace) -> str | None:
    """The persistent compilation cache directory of --compilation-cache / --no-compilation-cache
    (default: $DEEPINFER_COMPILATION_CACHE, else ~/.cache/deepinfer/xla); None: off."""
    from deepinfer.serve.compilation_cache import resolve_compilation_cache

    if args.no_compilation_cache:
        return None
    try:
        return resolve_compilation_cache(args.compilation_cache or True, "--compilation-cache")
    except ValueError as e:
        raise CliError(str(e)) from None


def add_compilation_cache_options(p, env: EnvDefaults) -> None:
    p.add_argument("--compilation-cache", default=env.compilation_cache, metavar="DIR",
                   help="JAX persistent compilation cache directory: a later run loads the compiled step "
                        "shapes from there (default: $DEEPINFER_COMPILATION_CACHE, else ~/.cache/deepinfer/xla)")
    p.add_argument("--no-compilation-cache", action="store_true", help="do not use a persistent compilation cache")


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """LLM keyword arguments from the engine options; the YOCO settings fall back to the environment."""
    env: EnvDefaults = getattr(args, "env", None) or EnvDefaults()
    for name in ("max_model_len", "max_num_seqs", "page_size", "prefill_chunk", "max_num_batched_tokens",
                 "min_page_bucket_tokens"):
        value = getattr(args, name)
        if value < 1:
            raise CliError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.prefill_chunk % 128:
        raise CliError(f"--prefill-chunk must be a multiple of 128, got {args.prefill_chunk}")
    if args.prefix_cache_host_pages < 0:
        raise CliError(f"--prefix-cache-host-pages must be non-negative, got {args.prefix_cache_host_pages}")
    if (args.prefix_cache_host_pages or args.prefix_cache_dir) and not args.enable_prefix_caching:
        raise CliError("--prefix-cache-host-pages and --prefix-cache-dir need --enable-prefix-caching")
    if args.prefix_cache_disk_gb is not None and not args.prefix_cache_dir:
        raise CliError("--prefix-cache-disk-gb needs --prefix-cache-dir")
    if args.prefix_cache_disk_gb is not None and not 0 < args.prefix_cache_disk_gb < float("inf"):
        raise CliError(f"--prefix-cache-disk-gb must be a positive number, got {args.prefix_cache_disk_gb}")
    if args.num_pages is not None and args.num_pages < 1:
        raise CliError(f"--num-pages must be at least 1, got {args.num_pages}")
    mode = args.prefill_mode if args.prefill_mode is not None else env.resolved_prefill_mode()
    keep = args.keep_tokens if args.keep_tokens is not None else env.resolved_keep_tokens()
    settings: dict[str, Any] = {
        "mesh": args.mesh, "eplb_interval": args.eplb_interval, "eplb_slots": args.eplb_slots,
        "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs, "page_size": args.page_size,
        "prefill_chunk": args.prefill_chunk, "max_num_batched_tokens": args.max_num_batched_tokens,
        "min_page_bucket_tokens": args.min_page_bucket_tokens,
        "num_pages": args.num_pages, "fake_quant": not args.no_fake_quant,
        "dtype": args.dtype,
        "prefill_mode": mode, "keep_tokens": keep, "seed": args.seed if args.seed is not None else 0,
        "async_scheduling": not args.no_async_scheduling, "deterministic": args.deterministic,
        "enable_prefix_caching": args.enable_prefix_caching, "prefix_replay": args.prefix_replay,
        "prefix_cache_host_pages": args.prefix_cache_host_pages, "prefix_cache_dir": args.prefix_cache_dir,
        "prefix_cache_disk_gb": args.prefix_cache_disk_gb,
        "speculative_config": _speculative_config(args.speculative_config),
        "accelerator": accelerator_name(args), "compilation_cache": compilation_cache_dir(args),
    }
    if args.tokenizer is not None:
        if not os.path.isfile(args.tokenizer):
            raise CliError(f"tokenizer file {args.tokenizer!r} does not exist")
        settings["tokenizer"] = args.tokenizer
    return settings


def _speculative_config(text: str | None) -> dict | None:
    """--speculative-config: vLLM's JSON object (checked by `SpeculativeConfig.from_value`)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"--speculative-config: not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    from deepinfer.serve.engine.speculative import SpeculativeConfig

    try:
        SpeculativeConfig.from_value(value, "--speculative-config")
    except ValueError as e:
        raise CliError(str(e)) from None
    return value


def check_model_arg(args: argparse.Namespace) -> None:
    if args.model is not None:
        from deepinfer.model import PRESETS

        if not os.path.isdir(args.model) and args.model not in PRESETS and args.model != "tiny-v4.1-trained":
            raise CliError(f"--model {args.model!r} is neither a checkpoint directory nor a preset "
                           f"(tiny-v4.1 and tiny-v4.1-trained are embedded)")


def add_engine_options(p: argparse.ArgumentParser, env: EnvDefaults) -> None:
    p.add_argument("--model", default=None, metavar="DIR_OR_PRESET",
                   help="checkpoint directory (official or orbax), tiny-v4.1-trained (the default: the "
                        "embedded tiny model trained on the Python standard library) or tiny-v4.1 (the same "
                        "with random weights); embedded ones are written once under ~/.cache/deepinfer")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="a tokenizer.json to use instead of the pinned DeepSeek-V4 one")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (default: engine seed 0)")
    p.add_argument("--max-model-len", type=int, default=4096, metavar="N", help="context length (default 4096)")
    p.add_argument("--max-num-seqs", type=int, default=8, metavar="N", help="concurrent sequences (default 8)")
    p.add_argument("--page-size", type=int, default=128, metavar="N", help="tokens per cache page (default 128)")
    p.add_argument("--num-pages", type=int, default=None, metavar="N",
                   help="cache pages (default: every slot at --max-model-len)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                   help="most prompt tokens per prefill step, a multiple of 128 (default 512)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                   help="most tokens per step: decodes plus the prefill chunks of several prompts (default 2048)")
    p.add_argument("--min-page-bucket-tokens", type=int, default=2048, metavar="N",
                   help="the narrowest page table a step reads covers N tokens: shorter contexts read it too; "
                        "larger N compiles fewer step shapes (default 2048)")
    p.add_argument("--no-fake-quant", action="store_true",
                   help="skip the QAT fake-quantization of KV and indexer activations")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="activation dtype (default: the checkpoint's)")
    p.add_argument("--prefill-mode", choices=PREFILL_MODES, default=None,
                   help=f"YOCO prefill truncation: compact runs the decoder layers on each prompt's last "
                        f"--keep-tokens rows, full on all (default: ${ENV_PREFILL_MODE}, else "
                        f"{DEFAULT_PREFILL_MODE})")
    p.add_argument("--keep-tokens", type=int, default=None, metavar="N",
                   help=f"prompt rows kept for the decoder layers in compact mode, at least the sliding "
                        f"window (default: ${ENV_KEEP_TOKENS}, else {DEFAULT_KEEP_TOKENS})")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="run one engine step at a time instead of planning and dispatching each step while "
                        "the device runs the previous one")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant inference: each request's tokens and logprobs are the same bits whatever "
                        "else is in the batch and however its prompt is chunked, with or without speculative "
                        "decoding (slower)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="share full prompt pages between requests by their tokens; a hit replays the last 128 "
                        "tokens of the cached prefix to rebuild the window state (default: off)")
    p.add_argument("--prefix-replay", choices=("bounded", "exact"), default="bounded",
                   help="what a prefix-cache hit recomputes: bounded (the last 128 tokens; outputs close to a "
                        "cold run's) or exact (the window dependency halo; a cold run's values)")
    p.add_argument("--prefix-cache-host-pages", type=int, default=0, metavar="N",
                   help="keep up to N prefix-cache pages evicted from the device in host memory (default: 0)")
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="also keep evicted prefix-cache pages as checksummed files in DIR, for restarts")
    p.add_argument("--prefix-cache-disk-gb", type=float, default=None, metavar="GIB",
                   help="keep at most GIB GiB of page files in --prefix-cache-dir, deleting the least recently "
                        "used first (default: no limit)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='DSpark speculative decoding with the checkpoint\'s drafter, e.g. \'{"method": "dspark", '
                        '"num_speculative_tokens": 5}\' (requests verify that many drafts per step; add '
                        '"enable_adaptive_verification": true to verify as many, at most that, as the drafter\'s '
                        'confidences and the measured step costs make worthwhile, or none (a plain decode '
                        'step), the confidences calibrated by "confidence_temperatures" [T1, ...] or the '
                        'checkpoint\'s dspark_calibration.json, the step costs profiled at start unless '
                        '"verify_step_seconds" [plain, width 1, ...] gives them; default: off)')
    add_compilation_cache_options(p, env)
    p.add_argument("--mesh", default=env.mesh, metavar="SPEC",
                   help="run on a device mesh, e.g. dp=2,cp=2,tp=1 (axes dp, cp, tp; the product is the "
                        "device count; a missing dp takes the devices left, so cp=2 on 8 devices is dp=4,cp=2), "
                        "or auto (every device on dp) (default: $DEEPINFER_MESH, else one device)")
    add_accelerator_option(p)
    p.add_argument("--eplb-interval", type=int, default=None, metavar="STEPS",
                   help="expert load balancing: install a new expert layout every STEPS engine steps (default: off)")
    p.add_argument("--eplb-slots", type=int, default=None, metavar="N",
                   help="physical expert slots per layer for EPLB (default: experts + one per device)")
    p.add_argument("--coordinator", default=env.coordinator, metavar="HOST:PORT",
                   help="multi-process run: process 0's coordination address (default: $DEEPINFER_COORDINATOR)")
    p.add_argument("--num-processes", type=int, default=env.num_processes,
                   metavar="N", help="multi-process run: number of processes (default: $DEEPINFER_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=env.process_id,
                   metavar="I", help="multi-process run: this process's index (default: $DEEPINFER_PROCESS_ID)")

"""The `deepinfer` command line.

Subcommands:

    deepinfer config show NAME_OR_PATH [--json]
        Print a resolved model config (a preset name, a checkpoint directory or a config.json).
    deepinfer forward (--preset NAME | --checkpoint DIR) --prompt TEXT [--top N] ...
        Tokenize a prompt (BOS first), run one full forward pass, print the most likely next tokens.
    deepinfer convert SRC DST
        Official safetensors checkpoint -> orbax fast-restart checkpoint.
    deepinfer verify-checkpoint DIR
        Check a checkpoint without loading it: index, headers, names/dtypes/shapes against the config,
        the checksum manifest, NaN/Inf weights and scales; one line per problem, exit 1 if any.
    deepinfer generate [--model DIR_OR_PRESET] (--prompt TEXT ... | --chat TEXT) [--max-tokens N] ...
        Generate with the offline engine (`LLM.generate` / `LLM.chat`); print the text and the
        engine's tokens/s. Without --model: the embedded tiny-v4.1-trained.
    deepinfer run-batch -i IN.jsonl -o OUT.jsonl [--model DIR_OR_PRESET] [--port N] [--resume] [--fail-on-error]
        Run an OpenAI batch JSONL file (chat and text completions), like `vllm run-batch`;
        --port serves Prometheus metrics while it runs; --resume skips the lines the output file
        already has a successful result for. A bad line is an error line in the output, not a
        failed run: exit 0 once every line has its result line, or 3 with --fail-on-error if any
        line failed.

This module is the only place that reads `DEEPINFER_*` environment variables. It reads them once,
in `main`, and turns them into argument defaults; everything below receives explicit values.
Currently read:

    DEEPINFER_COMPILATION_CACHE             default for `--compilation-cache` (JAX persistent compile cache;
                                            else ~/.cache/deepinfer/xla; --no-compilation-cache: off)
    DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE  default for `--prefill-mode` (full | compact; else compact)
    DEEPINFER_YOCO_PREFILL_KEEP_TOKENS      default for `--keep-tokens` (else 140)
    DEEPINFER_MESH                          default for `--mesh` (else one device)
    DEEPINFER_COORDINATOR                   default for `--coordinator` (multi-process runs)
    DEEPINFER_NUM_PROCESSES                 default for `--num-processes`
    DEEPINFER_PROCESS_ID                    default for `--process-id`
    DEEPINFER_ACCELERATOR                   default for `--accelerator` (auto | cuda | ascend | cpu; nvidia = cuda)

Exit codes: 0 success, 1 `verify-checkpoint` found problems, 2 bad input (one line on stderr naming the
problem), 3 `run-batch --fail-on-error` with failed lines, 130 interrupted.
JAX and the model are imported only by the subcommands that need them, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import sys
import time
from typing import Any, NoReturn, Sequence

from deepinfer.serve.engine_args import (  # noqa: F401  (CliError, EnvDefaults: part of this module's API)
    DTYPES,
    ENV_ACCELERATOR,
    CliError,
    EnvDefaults,
    add_accelerator_option,
    add_compilation_cache_options,
    add_engine_options,
    check_model_arg,
    compilation_cache_dir,
    engine_settings,
    select_accelerator_from,
)

__all__ = ["CliError", "EnvDefaults", "build_parser", "main", "speculation_lines"]

PROG = "deepinfer"


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


def _available_memory_bytes(device) -> int | None:
    """Free memory where random weights would be allocated: `device`'s memory limit on an
    accelerator, else the host's MemAvailable. None when unknown."""
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

    cache_dir = compilation_cache_dir(args)
    accelerator = select_accelerator_from(args)
    device = accelerator.first_local_device
    from deepinfer.serve.compilation_cache import enable_compilation_cache

    enable_compilation_cache(cache_dir)
    import jax
    import numpy as np

    from deepinfer.model import forward, init_params, load_checkpoint
    from deepinfer.model.checkpoint import single_device
    from deepinfer.model.tokenizer import decode_token, load_tokenizer

    t0 = time.perf_counter()
    if args.preset is not None:
        config = _resolve_config(args.preset, **overrides)
        need, have = _dense_param_bytes(config), _available_memory_bytes(device)
        if have is not None and need > have:
            raise CliError(
                f"random weights for preset {args.preset!r} need {_gib(need)} but only {_gib(have)} "
                "is available; use a smaller preset (tiny-v4.1) or --checkpoint"
            )
        with jax.default_device(device):
            params = init_params(config, args.seed)
        source = f"random weights (seed {args.seed})"
    else:
        try:
            config, params = load_checkpoint(args.checkpoint, placement=single_device(device), **overrides)
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
    logits = forward(params, config, ids, kernels=accelerator.kernel_config())
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
          f"backend {device.platform} ({accelerator.name})")
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


def _make_llm(args: argparse.Namespace, **extra: Any):
    """Build the `LLM` for --model (default: the embedded tiny-v4.1-trained); bad input -> CliError."""
    settings = engine_settings(args)
    check_model_arg(args)
    _start_distributed(args)
    from deepinfer.serve.api.llm import LLM

    try:
        return LLM(args.model, **settings, **extra)
    except ValueError as e:
        raise CliError(str(e)) from None


def _describe_model(llm) -> str:
    from deepinfer.serve.api.embedded import RANDOM_MODELS, TRAINED_MODEL

    if llm.model_name in RANDOM_MODELS:
        return f"{llm.model_name} (embedded, random weights; checkpoint {llm.model_dir})"
    if llm.model_name == TRAINED_MODEL:
        return f"{TRAINED_MODEL} (embedded, trained on the Python standard library; checkpoint {llm.model_dir})"
    return f"{llm.model_name} (checkpoint {llm.model_dir})"


def speculation_lines(speculative, counts, step_seconds) -> list[str]:
    """The `generate` summary of DSpark speculative decoding: the verification it ran
    (`SpeculativeConfig`), what was accepted (`SpecDecodeCounts`) and, with confidence-scheduled
    verification, the step-cost curve it used (`step_seconds`: a plain decode step's, then a
    verify step's per width), in the form that pins it for the next run."""
    k = speculative.num_speculative_tokens
    how = (f"at most {k} drafts per verify step, confidence-scheduled" if speculative.enable_adaptive_verification
           else f"{k} drafts per verify step")
    rows = counts.num_drafts
    accepted = (f"{rows} verify rows accepted {counts.num_accepted_tokens} of {counts.num_draft_tokens} drafts, "
                f"mean acceptance length {counts.mean_acceptance_length:.2f}" if rows else "no drafts verified")
    lines = [f"dspark  : {how}: {accepted}"]
    if step_seconds is not None:
        widths = " / ".join(f"{s * 1e3:.1f}" for s in step_seconds[1:])
        pinned = ", ".join(f"{s:.6f}" for s in step_seconds)
        lines.append(f"costs   : plain decode {step_seconds[0] * 1e3:.1f} ms, verify by drafts per row {widths} ms "
                     f"(reuse with --speculative-config \"verify_step_seconds\": [{pinned}])")
    return lines


class _StderrHandler(logging.StreamHandler):
    """Log to whatever `sys.stderr` is at the time of the record."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _enable_info_logs() -> None:
    """INFO logs of the `deepinfer` loggers (compile times, the periodic stats line) on stderr."""
    logger = logging.getLogger("deepinfer")
    if logging.getLogger().handlers:  # the application (or a library) configured logging already
        logger.setLevel(logging.INFO)
        return
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def cmd_verify_checkpoint(args: argparse.Namespace) -> int:
    """Exit 0 when the checkpoint is clean, 1 when anything is wrong (one line per problem)."""
    if not os.path.isdir(args.directory):
        raise CliError(f"checkpoint directory {args.directory!r} does not exist")
    from deepinfer.model.verify import verify_checkpoint

    t0 = time.perf_counter()
    report = verify_checkpoint(args.directory)
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    for note in report.notes:
        print(f"note: {note}")
    status = "OK" if report.ok else f"{len(report.problems)} problem(s)"
    print(f"{status}: {report.directory}: {report.tensors_checked} tensors, "
          f"{report.bytes_checked / 2**20:.1f} MiB of values checked in {_seconds(time.perf_counter() - t0)}")
    return 0 if report.ok else 1


def _structured_outputs(args: argparse.Namespace):
    """The `StructuredOutputsParams` of --json-schema FILE / --regex / --grammar FILE / --choice
    (and --jump-forward)."""
    given = [name for name in ("json_schema", "regex", "grammar", "choice") if getattr(args, name) is not None]
    if not given:
        if args.jump_forward:
            raise CliError("--jump-forward: needs a structured-output constraint (--json-schema, --regex, --grammar "
                           "or --choice)")
        return None
    if len(given) > 1:
        raise CliError("give at most one of --json-schema, --regex, --grammar, --choice")
    return dataclasses.replace(_constraint(args, given), jump_forward=args.jump_forward)


def _constraint(args: argparse.Namespace, given: list[str]):
    from deepinfer.serve.api.types import StructuredOutputsParams

    if args.json_schema is not None:
        try:
            schema = json.loads(pathlib.Path(args.json_schema).read_text())
        except OSError as e:
            raise CliError(f"--json-schema: cannot read {args.json_schema}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise CliError(f"--json-schema: {args.json_schema} is not JSON (line {e.lineno}: {e.msg})") from None
        return StructuredOutputsParams(json=schema)
    if args.grammar is not None:
        try:
            return StructuredOutputsParams(grammar=pathlib.Path(args.grammar).read_text())
        except OSError as e:
            raise CliError(f"--grammar: cannot read {args.grammar}: {e.strerror}") from None
    try:
        if args.regex is not None:
            return StructuredOutputsParams(regex=args.regex)
        return StructuredOutputsParams(choice=args.choice)
    except ValueError as e:
        raise CliError(f"--{given[0]}: {str(e).partition(': ')[2]}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompt or [])
    if args.chat is None and not prompts:
        raise CliError("pass --prompt TEXT (one or more) or --chat TEXT")
    for text in [*prompts, *([args.chat] if args.chat is not None else [])]:
        if not text:
            raise CliError("empty prompt: pass some text")
    if args.chat is None and args.thinking:
        raise CliError("--thinking applies to --chat only")
    if args.logprobs is not None and not args.json:
        raise CliError("--logprobs is printed with --json only: pass --json")
    from deepinfer.serve.api.types import SamplingParams

    constraint = _structured_outputs(args)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, structured_outputs=constraint,
                                logprobs=args.logprobs)
    except ValueError as e:
        raise CliError(f"--{str(e).replace('_', '-')}") from None
    t0 = time.perf_counter()
    llm = _make_llm(args)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        if args.chat is not None:
            outputs = llm.chat([{"role": "user", "content": args.chat}], params, use_tqdm=False,
                               chat_template_kwargs={"thinking": bool(args.thinking)})
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    except ValueError as e:
        raise CliError(str(e)) from None
    elapsed = time.perf_counter() - t0
    if args.json:
        for output in outputs:
            completion = output.outputs[0]
            record = {"prompt": output.prompt, "prompt_token_ids": list(output.prompt_token_ids or ()),
                      "text": completion.text, "token_ids": list(completion.token_ids),
                      "finish_reason": completion.finish_reason}
            if completion.logprobs is not None:  # per token: {token id: [logprob, rank]}, the sampled one and the top N
                record["logprobs"] = [{str(t): [lp.logprob, lp.rank] for t, lp in position.items()}
                                      for position in completion.logprobs]
            print(json.dumps(record))
        return 0

    print(f"model   : {_describe_model(llm)}")
    print(f"engine  : prefill {llm.engine.engine_config.prefill_mode} (keep {llm.engine.engine_config.keep_tokens}), "
          f"dtype {llm.config.dtype}, fake-quant {'on' if llm.config.fake_quant else 'off'}"
          + (f", mesh {','.join(f'{k}={v}' for k, v in llm.mesh.shape.items())}" if llm.mesh is not None else "")
          + f", loaded in {_seconds(t_load)}")
    n_prompt = n_gen = 0
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        n_prompt += len(output.prompt_token_ids or ())
        n_gen += len(completion.token_ids)
        if args.chat is not None:
            print(f"--- chat: {args.chat!r} ({len(output.prompt_token_ids)} prompt tokens, "
                  f"thinking {'on' if args.thinking else 'off'})")
            if completion.reasoning_content is not None:
                print("--- reasoning:")
                print(completion.reasoning_content)
            print("--- content:")
            print(completion.text)
        else:
            print(f"--- prompt {i}: {output.prompt!r} ({len(output.prompt_token_ids)} tokens)")
            print(completion.text)
        print(f"--- {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}"
              + (f", stop_reason={completion.stop_reason!r}" if completion.stop_reason is not None else ""))
    engine = llm.engine
    if engine.speculative is not None:
        schedule = engine.verify_schedule
        for line in speculation_lines(engine.speculative, engine.spec_counts,
                                      None if schedule is None else schedule.step_seconds.tolist()):
            print(line)
    # the warm-up compiled every step shape before the first step; the speed is the steps' own
    elapsed = max(elapsed - llm.warmup_seconds, 0.0)
    speed = n_gen / elapsed if elapsed > 0 else float("inf")
    print(f"compile : {len(llm.engine.warmed_shapes)} step shapes in {_seconds(llm.warmup_seconds)} before the "
          f"first step (persistent cache: {llm.compilation_cache or 'off'})")
    print(f"speed   : {n_prompt} prompt + {n_gen} generated tokens in {_seconds(elapsed)}: "
          f"{(n_prompt + n_gen) / elapsed if elapsed > 0 else 0:.1f} tokens/s, {speed:.1f} generated tokens/s")
    return 0


def cmd_run_batch(args: argparse.Namespace) -> int:
    if args.input_file != "-" and not os.path.isfile(args.input_file):
        raise CliError(f"input file {args.input_file!r} does not exist")
    if args.output_file != "-":
        parent = os.path.dirname(os.path.abspath(args.output_file))
        if not os.path.isdir(parent):
            raise CliError(f"the directory of output file {args.output_file!r} does not exist")
    if args.port is not None and not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    if args.resume and args.output_file == "-":
        raise CliError("--resume needs an output file (it reads the results already there), not '-'")
    _enable_info_logs()
    llm = _make_llm(args, log_stats_interval=args.log_stats_interval)
    from deepinfer.serve.api.batch import read_previous, run_batch
    from deepinfer.sharding.distributed import barrier, is_primary

    previous = None
    if args.resume:
        try:
            previous = read_previous(args.output_file)
        except (OSError, ValueError) as e:
            raise CliError(f"run-batch --resume: {e}") from None
        barrier("run-batch --resume read")  # every process has read it before process 0 rewrites it
    # every process of a multi-process run computes every result; only process 0 writes them
    output, port = (args.output_file, args.port) if is_primary() else (os.devnull, None)
    try:
        summary = run_batch(llm, args.input_file, output, prometheus_port=port, previous=previous)
    except OSError as e:
        raise CliError(f"run-batch: {e}") from None
    report = sys.stderr if args.output_file == "-" else sys.stdout
    resumed = f"; {summary.skipped} already done" if args.resume else ""
    print(f"wrote {summary.total} result lines to {args.output_file} ({summary.succeeded} succeeded, "
          f"{summary.failed} failed{resumed}) in {_seconds(summary.elapsed_s)}", file=report)
    return 3 if args.fail_on_error and summary.failed else 0


# ---- parser and entry point ----------------------------------------------------------------


def _usage_of(parser: argparse.ArgumentParser):
    """Handler for a command group invoked without a subcommand: help on stderr, exit code 2."""
    def show(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return show


def _start_distributed(args: argparse.Namespace) -> None:
    """Join the multi-process runtime when --coordinator/--num-processes/--process-id are given;
    processes other than 0 then print nothing."""
    from deepinfer.sharding.distributed import DistributedConfig, initialize, is_primary

    config = DistributedConfig(args.coordinator, args.num_processes, args.process_id)
    try:
        started = initialize(config)
    except ValueError as e:
        raise CliError(f"--{str(e).replace('_', '-')}") from None
    if not started:
        return
    # gloo's native code writes its connection notes to file descriptor 1: send that to stderr
    # and keep stdout for our results (process 0 only)
    sys.stdout.flush()
    results = os.dup(1)
    os.dup2(2, 1)
    if is_primary():
        sys.stdout = os.fdopen(results, "w", buffering=1)
    else:
        os.close(results)
        sys.stdout = open(os.devnull, "w")
        logging.getLogger("deepinfer").setLevel(logging.WARNING)


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
    add_compilation_cache_options(p_fwd, env)
    add_accelerator_option(p_fwd)
    p_fwd.set_defaults(func=cmd_forward)

    p_conv = sub.add_parser("convert", help="official checkpoint -> orbax fast-restart checkpoint")
    p_conv.add_argument("src", metavar="SRC", help="official-format checkpoint directory")
    p_conv.add_argument("dst", metavar="DST", help="output directory (must not exist or be empty)")
    p_conv.add_argument("--overwrite", action="store_true", help="allow a non-empty DST")
    p_conv.set_defaults(func=cmd_convert)

    p_verify = sub.add_parser("verify-checkpoint", help="check a checkpoint: structure, checksums, NaN/Inf values")
    p_verify.add_argument("directory", metavar="DIR", help="official-format or orbax checkpoint directory")
    p_verify.set_defaults(func=cmd_verify_checkpoint)

    p_gen = sub.add_parser("generate", help="generate text with the offline engine (LLM.generate / LLM.chat)")
    what = p_gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", nargs="+", action="extend", metavar="TEXT",
                      help="one or more prompts, completed as plain text (BOS is prepended)")
    what.add_argument("--chat", metavar="TEXT", help="one user message, answered through the chat template")
    p_gen.add_argument("--max-tokens", type=int, default=16, metavar="N", help="most generated tokens (default 16)")
    p_gen.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 = greedy (default 1.0)")
    p_gen.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0)")
    p_gen.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K best tokens (default 0: off)")
    p_gen.add_argument("--thinking", action="store_true", help="--chat in thinking mode (default off)")
    p_gen.add_argument("--json", action="store_true",
                       help="print one JSON object per output (prompt, text, token ids, finish reason) instead")
    p_gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                       help="with --json, each generated token's log-probability and the N most likely tokens' "
                            "(vLLM's logprobs; default: none)")
    shape = p_gen.add_argument_group("structured output (at most one)")
    shape.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON Schema file")
    shape.add_argument("--regex", metavar="RE", help="the output matches this regular expression")
    shape.add_argument("--grammar", metavar="FILE", help="the output follows this Lark or GBNF grammar file")
    shape.add_argument("--choice", nargs="+", metavar="TEXT", help="the output is exactly one of these strings")
    shape.add_argument("--jump-forward", action="store_true",
                       help="append the text the constraint forces without sampling it (jump-forward decoding)")
    add_engine_options(p_gen, env)
    p_gen.set_defaults(func=cmd_generate)

    p_batch = sub.add_parser(
        "run-batch", help="run an OpenAI batch JSONL file (chat and text completions)",
        description="Run an OpenAI batch JSONL file (chat and text completions), like `vllm run-batch`. "
                    "A line that cannot run gets an error line in the output (naming the line and the "
                    "problem); the other lines still run.",
        epilog="exit codes: 0 the run completed (every input line has its result line, successful or "
               "not), 2 bad input (a missing input file, a bad option, an output file --resume cannot "
               "read), 3 with --fail-on-error when any line failed, 130 interrupted.")
    p_batch.add_argument("-i", "--input-file", required=True, metavar="IN.jsonl", help="input JSONL ('-': stdin)")
    p_batch.add_argument("-o", "--output-file", required=True, metavar="OUT.jsonl",
                         help="output JSONL, one line per input line, in input order ('-': stdout)")
    p_batch.add_argument("--port", type=int, default=None, metavar="N",
                         help="serve Prometheus metrics on this port while the batch runs")
    p_batch.add_argument("--log-stats-interval", type=float, default=10.0, metavar="S",
                         help="seconds between engine stats log lines (default 10)")
    p_batch.add_argument("--resume", action="store_true",
                         help="continue an interrupted run: skip the input lines whose custom_id has a "
                              "successful result in the output file, keep those results and append the "
                              "new ones (error lines and a truncated last line are dropped and run again)")
    p_batch.add_argument("--fail-on-error", action="store_true",
                         help="exit with code 3 if any line failed (default: 0 once the run completed)")
    add_engine_options(p_batch, env)
    p_batch.set_defaults(func=cmd_run_batch)

    from deepinfer.pallas_kernels.cli import add_kernels_parser
    from deepinfer.serve.grpc.cli import add_serve_parser

    add_serve_parser(sub, env)
    add_kernels_parser(sub, accelerator_env=(ENV_ACCELERATOR, env.accelerator))
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
    args.env = env
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

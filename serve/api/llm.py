"""`LLM`: the offline Python API, shaped like vLLM's (`interfaces.md` §1, §6).

    from deepinfer import LLM, SamplingParams

    llm = LLM()  # the embedded tiny-v4.1-trained, or LLM("/path/to/checkpoint")
    outs = llm.generate(["def fib(n):", [0, 791, 6102]], SamplingParams(max_tokens=8))
    chat = llm.chat([{"role": "user", "content": "Hi"}], chat_template_kwargs={"thinking": False})

What it adds on top of `LLMEngine`:

* model resolution: a checkpoint directory (official safetensors or orbax; `load_checkpoint`), or
  an embedded tiny model by name (`embedded.py`): `model=None` (or `"tiny-v4.1-trained"`) is the
  default, the tiny-v4.1 architecture trained on the Python standard library; `"tiny-v4.1"` and
  `"tiny-v4.1-short"` have random weights. `cache_dir` says where an embedded one is written.
  Other presets have no weights here and are rejected; so is a DeepSeek-V4 model (the engine
  serves V4.1; V4 runs only the full forward pass, `deepinfer forward`).
* prompts in vLLM's forms, validated before any work (`llm_inputs.py`): one bad prompt fails the
  whole call with a `ValueError` naming its index, and nothing is left in the engine;
* chat: conversations are rendered and encoded by `prepare_chat` for the model's type (the
  prompt gets exactly the template's BOS), generation stops on EOS, and the answer is parsed back
  into `text` (the content), `reasoning_content` and `tool_calls`;
* compile once: before a call's first step, the step shapes its requests will use are compiled
  (`warmup`, a dry run of the scheduler), so a generation never stalls mid-stream on a new page
  bucket; JAX's persistent
  compilation cache (`compilation_cache`, ~/.cache/deepinfer/xla) keeps them for the next process;
* observability: a tqdm "Processed prompts" bar with the estimated input/output speed, vLLM's
  periodic `LoggingStatLogger` line (logger `deepinfer.llm`, INFO, at most every
  `log_stats_interval` seconds), `get_metrics()` with vLLM's metric names (`llm_metrics.py`), and
  `start_profile(dir)` / `stop_profile()` around `jax.profiler`.

Differences from vLLM, on purpose: unknown constructor arguments raise instead of being passed to
an engine-args object; `chat` defaults to thinking off (as the DeepSeek chat templates in vLLM
do) unless `chat_template_kwargs` sets `thinking` or `reasoning_effort`; `n` must be 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax

from deepinfer.model import load_checkpoint, load_config
from deepinfer.model.checkpoint import single_device
from deepinfer.pallas_kernels.accelerator import select_accelerator
from deepinfer.serve.api.embedded import (
    DEFAULT_MODEL,
    RANDOM_MODEL,
    RANDOM_MODELS,
    TRAINED_MODEL,
    ensure_random_checkpoint,
    ensure_trained_checkpoint,
    resolve_model,
)
from deepinfer.serve.api.llm_inputs import (
    chat_kwargs,
    load_tokenizer_argument,
    normalize_conversations,
    normalize_params,
    normalize_prompts,
    positive_int,
    resolve_mesh,
    unknown_argument,
)
from deepinfer.serve.api.llm_metrics import LLMMetrics
from deepinfer.serve.api.types import RequestOutput, SamplingParams
from deepinfer.serve.engine.prefix_cache import PrefixCacheConfig
from deepinfer.serve.compilation_cache import enable_compilation_cache, resolve_compilation_cache
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import PREFILL_MODES, EngineConfig, LLMEngine
from deepinfer.serve.engine.scheduler import check_token_budget
from deepinfer.serve.engine.shape_plan import planned_shapes
from deepinfer.serve.engine.speculative import SpeculativeConfig
from deepinfer.serve.engine.verify_schedule import load_calibration
from deepinfer.serve.engine.warmup import StepShape, WarmupReport, pending_shapes, warm_up
from deepinfer.serve.text.chat import (
    ChatEncodingError,
    ChatPrompt,
    ParsedChat,
    parse_completion,
    prepare_chat,
)

# (the embedded models' names and writers are re-exported from `embedded`)
__all__ = ["DEFAULT_MODEL", "LLM", "PREFILL_MODES", "RANDOM_MODEL", "RANDOM_MODELS", "TRAINED_MODEL",
           "ensure_random_checkpoint", "ensure_trained_checkpoint", "parse_chat_completion"]

log = logging.getLogger("deepinfer.llm")

_KNOWN_ARGS = (
    "model", "tokenizer", "seed", "max_model_len", "max_num_seqs", "page_size", "num_pages",
    "prefill_chunk", "max_num_batched_tokens", "min_page_bucket_tokens", "dtype", "fake_quant", "prefill_mode",
    "keep_tokens", "log_stats_interval",
    "cache_dir", "mesh", "eplb_interval", "eplb_slots", "drafter_context", "accelerator",
    "compilation_cache", "warmup", "async_scheduling", "speculative_config", "deterministic",
    "enable_prefix_caching", "prefix_replay", "prefix_cache_host_pages", "prefix_cache_dir", "prefix_cache_disk_gb",
)


# ---- helpers ----------------------------------------------------------------------------------


def _gib_to_bytes(gib: float | None) -> int | None:
    """`prefix_cache_disk_gb` in bytes (None: no limit)."""
    if gib is None:
        return None
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0 or gib == float("inf"):
        raise ValueError(f"prefix_cache_disk_gb: must be a positive number of GiB or None, got {gib!r}")
    return max(1, int(gib * 2**30))


def parse_chat_completion(tokenizer: Any, prompt: ChatPrompt, output: RequestOutput, index: int = 0) -> ParsedChat:
    """Parse completion `index` of a chat request's finished output into content / reasoning /
    tool calls (`serve.text.chat.parse_completion`)."""
    return parse_completion(tokenizer, prompt, output.outputs[index])


@dataclass
class _Progress:
    """A vLLM-style progress bar: requests done, with the estimated token speeds."""

    bar: Any
    in_tokens: int = 0
    out_tokens: int = 0

    def update(self, output: RequestOutput) -> None:
        if self.bar is None:
            return
        self.in_tokens += len(output.prompt_token_ids or ())
        self.out_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = (getattr(self.bar, "format_dict", None) or {}).get("elapsed") or 0.0
        if elapsed > 0:
            self.bar.postfix = (f"est. speed input: {self.in_tokens / elapsed:.2f} toks/s, "
                                f"output: {self.out_tokens / elapsed:.2f} toks/s")
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- LLM --------------------------------------------------------------------------------------


class LLM:
    """An offline engine over one model, with vLLM's `generate` / `chat` API.

    Args:
        model: a checkpoint directory (official or orbax format), None / "tiny-v4.1-trained" for
            the embedded trained tiny model (the default), or "tiny-v4.1" / "tiny-v4.1-short" for
            the same architecture with random weights (see the module docstring).
        tokenizer: None (the pinned DeepSeek-V4 tokenizer), a path to a `tokenizer.json` (loaded
            without the pin check), or a loaded `tokenizers.Tokenizer`.
        seed: seed of the engine's sampling RNG (requests without their own `seed`).
        max_model_len, max_num_seqs, page_size, num_pages: the cache budget (context length,
            concurrent sequences = cache slots, tokens per page, pages; None = enough for every
            slot at max_model_len).
        prefill_chunk: most prompt tokens per prefill step (a multiple of 128).
        max_num_batched_tokens: most tokens per step (and dp rank): the decodes plus the prefill
            chunks of several prompts, and the prefill step's padded rows x tokens.
        min_page_bucket_tokens: the narrowest page table a step reads covers this many tokens;
            shorter sequences read it too (their padding pages are skipped). Larger: fewer step
            shapes to compile (one per doubling of the context above it), smaller: cheaper steps
            for short contexts.
        dtype: activation dtype override ("float32" or "bfloat16"); None keeps the checkpoint's.
        fake_quant: the QAT fake-quantization of KV and indexer activations.
        prefill_mode, keep_tokens: YOCO prefill truncation (`model-v4.1-flash.md` §4.3):
            "compact" runs the decoder layers only on each prompt's last `keep_tokens` rows
            (at least the sliding window), "full" on every row.
        async_scheduling: plan and dispatch each engine step before reading the previous step's
            tokens, so the host's work overlaps the device's (stop rules then see a token one
            step late; the extra token is dropped). False: one step at a time.
        deterministic: batch-invariant inference: a request's tokens and logprobs are the same bits
            whatever else runs with it, however its prompt is chunked, and with or without
            speculative decoding (that on one device; see `EngineConfig.deterministic`).
        enable_prefix_caching, prefix_replay: share full prompt pages between requests by their
            tokens (`deepinfer.serve.engine.prefix_cache`); a hit rebuilds the sequence's window
            state by replaying the hit's last 128 tokens ("bounded", V4.1's encoder-side bounded
            replay: outputs are close to, not the same as, a cold run's) or the whole window
            dependency halo ("exact": a cold run's values up to chunking rounding). Requests
            choose how long their pages stay cached with `SamplingParams.cache_ttl_class`.
        prefix_cache_host_pages, prefix_cache_dir: the tiers below the device: pages evicted from
            the device are kept in host memory (at most this many) and, with a directory, in
            checksummed files there that outlive the process (one device, or a mesh
            of this process's devices).
        prefix_cache_disk_gb: the most GiB of page files the directory keeps (least recently
            used deleted first); None: no limit.
        log_stats_interval: seconds between the periodic stats log lines (None: never).
        cache_dir: where an embedded model's checkpoint is written / read.
        mesh: run on many devices: a `jax.sharding.Mesh` with axes ("dp", "cp", "tp"), a spec
            such as "dp=2,cp=2,tp=1" or a dict of axis sizes over all devices (a missing dp takes
            the devices left), or "auto" (every device on dp). None: one device. Each sequence
            lives on one dp rank; the routed experts split over all devices; with cp > 1 prefill
            chunks split their queries over cp. `max_num_seqs` must be a multiple of dp.
        eplb_interval, eplb_slots: expert load balancing while serving: every `eplb_interval`
            steps a new layout of `eplb_slots` physical experts per layer (default: the experts plus
            one per device) is planned from the counted load and installed; None: off.
        drafter_context: keep the DSpark drafter's context (one window ring per draft block and
            sequence, written every step) when the checkpoint has the drafter (`mtp.*`); only
            speculative decoding reads it, so it is off by default.
        accelerator: "auto" (JAX's default backend), "cuda", "ascend" (a configured Ascend PJRT
            plugin, reference kernels) or "cpu": the devices of the params, cache and mesh, and
            the platform the kernels are chosen for. A backend JAX does not have is a
            `ValueError` saying what to install (`pallas_kernels.accelerator`).
        compilation_cache: JAX's persistent compilation cache directory; True (the default):
            `~/.cache/deepinfer/xla`; None or False: none. JAX has one per process, set once: the
            first directory set in the process stays (`serve.compilation_cache`).
        warmup: before each `generate` / `chat` call's first step, compile the step shapes its
            requests will use (a dry run of the scheduler: `serve.engine.shape_plan`) that have
            not run yet, with a "Compiling step shapes" bar on stderr: nothing then compiles
            mid-stream (unless a request stopping early lets a queued one in with a different
            mix of prefill rows). `warm_up()` compiles every shape up to max_model_len at once.
            False: shapes compile when a step first needs them.
        speculative_config: DSpark speculative decoding with the checkpoint's drafter, vLLM's
            form: `{"method": "dspark", "num_speculative_tokens": 5}` (or a
            `SpeculativeConfig`): every decoding request verifies that many drafts per step;
            `"enable_adaptive_verification": true` chooses how many from the drafter's
            confidences, calibrated by `"confidence_temperatures"` or else by the checkpoint's
            own (`dspark_calibration.json`, which the embedded trained model has), the step
            costs it weighs them against profiled at start unless `"verify_step_seconds"`
            gives them (the curve an earlier start logged). The engine
            then reads each step before planning the next (no asynchronous scheduling). None: off.

    Unknown keyword arguments raise `ValueError` naming the argument.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        tokenizer: Any = None,
        seed: int = 0,
        max_model_len: int = 4096,
        max_num_seqs: int = 8,
        page_size: int = 128,
        num_pages: int | None = None,
        prefill_chunk: int = 512,
        max_num_batched_tokens: int = 2048,
        min_page_bucket_tokens: int = 2048,
        dtype: str | None = None,
        fake_quant: bool = True,
        prefill_mode: str = "compact",
        keep_tokens: int = 140,
        log_stats_interval: float | None = 10.0,
        cache_dir: str | os.PathLike | None = None,
        mesh: Any = None,
        eplb_interval: int | None = None,
        eplb_slots: int | None = None,
        drafter_context: bool = False,
        accelerator: str = "auto",
        compilation_cache: str | os.PathLike | bool | None = True,
        warmup: bool = True,
        async_scheduling: bool = True,
        speculative_config: dict | SpeculativeConfig | None = None,
        deterministic: bool = False,
        enable_prefix_caching: bool = False,
        prefix_replay: str = "bounded",
        prefix_cache_host_pages: int = 0,
        prefix_cache_dir: str | os.PathLike | None = None,
        prefix_cache_disk_gb: float | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise unknown_argument(sorted(unknown)[0], _KNOWN_ARGS, "LLM argument")
        positive_int("seed", seed, minimum=0)
        positive_int("max_model_len", max_model_len, minimum=2)
        positive_int("max_num_seqs", max_num_seqs)
        positive_int("page_size", page_size)
        if num_pages is not None:
            positive_int("num_pages", num_pages)
        positive_int("prefill_chunk", prefill_chunk)
        if prefill_chunk % 128:
            raise ValueError(f"prefill_chunk: must be a multiple of 128, got {prefill_chunk}")
        if dtype is not None and dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: must be 'float32' or 'bfloat16', got {dtype!r}")
        if not isinstance(fake_quant, bool):
            raise ValueError(f"fake_quant: must be a bool, got {fake_quant!r}")
        if not isinstance(drafter_context, bool):
            raise ValueError(f"drafter_context: must be a bool, got {drafter_context!r}")
        if not isinstance(warmup, bool):
            raise ValueError(f"warmup: must be a bool, got {warmup!r}")
        cache_directory = resolve_compilation_cache(compilation_cache)
        speculative = SpeculativeConfig.from_value(speculative_config)
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode: must be one of {', '.join(PREFILL_MODES)}, got {prefill_mode!r}")
        positive_int("keep_tokens", keep_tokens)
        if log_stats_interval is not None and (not isinstance(log_stats_interval, (int, float))
                                               or isinstance(log_stats_interval, bool) or log_stats_interval < 0):
            raise ValueError(f"log_stats_interval: must be a non-negative number or None, got {log_stats_interval!r}")

        if eplb_interval is not None:
            positive_int("eplb_interval", eplb_interval)
        if eplb_slots is not None:
            positive_int("eplb_slots", eplb_slots)
        # before anything compiles (process-wide; the first directory set in the process stays)
        self.compilation_cache = enable_compilation_cache(cache_directory)
        # first JAX work of the constructor: the Ascend plugin must register before the backends start
        self.accelerator = select_accelerator(accelerator)
        self.mesh = resolve_mesh(mesh, self.accelerator)
        if self.mesh is not None and max_num_seqs % self.mesh.shape["dp"]:
            raise ValueError(f"max_num_seqs: {max_num_seqs} must be a multiple of the mesh's dp={self.mesh.shape['dp']}")
        positive_int("max_num_batched_tokens", max_num_batched_tokens)
        positive_int("min_page_bucket_tokens", min_page_bucket_tokens)
        if prefix_cache_disk_gb is not None and prefix_cache_dir is None:
            raise ValueError("prefix_cache_disk_gb: needs prefix_cache_dir (the disk tier it limits)")
        check_token_budget(max_num_batched_tokens, max_num_seqs // (1 if self.mesh is None else self.mesh.shape["dp"]))
        directory, self.model_name = resolve_model(model, cache_dir)
        self.model_dir = directory
        if speculative is not None and speculative.confidence_temperatures is None:
            # the checkpoint's own STS calibration of its drafter's confidences, if it has one
            temperatures = load_calibration(directory)
            if temperatures is not None and len(temperatures) < speculative.num_speculative_tokens:
                log.warning("%s calibrates %d draft positions, fewer than num_speculative_tokens (%d): the "
                            "confidences stay uncalibrated", directory, len(temperatures),
                            speculative.num_speculative_tokens)
            elif temperatures is not None:
                speculative = dataclasses.replace(speculative, confidence_temperatures=temperatures)
        try:
            probe = load_config(directory)
        except (ValueError, OSError) as e:
            raise ValueError(f"model: cannot read the config of {directory}: {e}") from None
        if probe.is_v4:
            raise ValueError(
                f"model: {self.model_name!r} is a DeepSeek-V4 model ({probe.model_type}); the engine serves "
                "DeepSeek-V4.1 only for now. V4 runs only the full forward pass (`deepinfer forward`)")
        if keep_tokens < probe.sliding_window:
            raise ValueError(f"keep_tokens: must be at least the model's sliding window "
                             f"({probe.sliding_window}), got {keep_tokens}")
        overrides: dict[str, Any] = {"fake_quant": fake_quant}
        if dtype is not None:
            overrides["dtype"] = dtype
        try:
            self.config, params = load_checkpoint(
                directory, placement=single_device(self.accelerator.first_local_device), **overrides)
        except (ValueError, OSError) as e:  # CheckpointError / ConfigError are ValueErrors
            raise ValueError(f"model: cannot load checkpoint {directory}: {e}") from None
        self.tokenizer = load_tokenizer_argument(tokenizer)
        self.max_model_len = max_model_len
        budget = CacheBudget(num_slots=max_num_seqs, max_model_len=max_model_len, page_size=page_size,
                             num_pages=num_pages)
        engine_config = EngineConfig(budget=budget, prefill_chunk=prefill_chunk, seed=seed,
                                     max_num_batched_tokens=max_num_batched_tokens,
                                     min_page_bucket_tokens=min_page_bucket_tokens,
                                     prefill_mode=prefill_mode, keep_tokens=keep_tokens,
                                     eplb_interval=eplb_interval, eplb_slots=eplb_slots,
                                     drafter_context=drafter_context, kernels=self.accelerator.kernel_config(),
                                     async_scheduling=bool(async_scheduling), speculative=speculative,
                                     deterministic=bool(deterministic),
                                     prefix_cache=PrefixCacheConfig(
                                         replay=prefix_replay, host_pages=prefix_cache_host_pages,
                                         disk_dir=None if prefix_cache_dir is None else os.fspath(prefix_cache_dir),
                                         disk_max_bytes=_gib_to_bytes(prefix_cache_disk_gb))
                                     if enable_prefix_caching else None)
        self.engine = LLMEngine(params, self.config, self.tokenizer, engine_config, mesh=self.mesh)
        self.log_stats_interval = log_stats_interval
        self.warmup = warmup
        self.warmup_seconds = 0.0  # compile time spent warming up, all calls together
        self._ids = itertools.count()
        self.metrics = LLMMetrics(self.engine)
        self._profile_dir: str | None = None

    # ---- public API -------------------------------------------------------------------------

    @property
    def params(self) -> dict:
        """The model parameters the engine runs."""
        return self.engine.runner.params

    def get_tokenizer(self):
        return self.tokenizer

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a text prompt: BOS, then the text (the DeepSeek tokenizer adds no BOS)."""
        return [self.config.bos_token_id, *self.tokenizer.encode(text, add_special_tokens=False).ids]

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Complete prompts; one `RequestOutput` per prompt, in input order.

        prompts: a str, a list of token ids, `{"prompt": str}`, `{"prompt_token_ids": [...]}`, or
            a list of those. Text is encoded with BOS prepended.
        sampling_params: one `SamplingParams` (or a dict of its fields) for every prompt, or a
            list with one per prompt; None means `SamplingParams()`.
        use_tqdm: show the "Processed prompts" bar (or a tqdm-like callable to build it).
        """
        items = normalize_prompts(prompts, self.encode_prompt)
        params = normalize_params(sampling_params, len(items))
        return self._generate(items, params, use_tqdm=use_tqdm, label="prompt")

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of message dicts) or a list of conversations.

        chat_template_kwargs: `thinking` (bool; default False unless `reasoning_effort` is set),
            `reasoning_effort`, and the request switches `tool_choice` / `response_format`. A
            `response_format` (`json_object`, `json_schema`) or tools also constrain the answer
            (structured output: JSON, or DeepSeek's tool-call block, after `</think>` in thinking
            mode) unless a sampling params has its own `structured_outputs` (`chat_constraint`).
        tools: OpenAI function tools, shared by every conversation.

        Each output's `text` is the answer content; `reasoning_content` the thinking text
        (thinking mode), `tool_calls` the parsed calls; `prompt` the rendered prompt text.
        `finish_reason` / `stop_reason` are the engine's (vLLM's), generation stops on EOS.
        """
        conversations = normalize_conversations(messages)
        kwargs = chat_kwargs(chat_template_kwargs)
        params = normalize_params(sampling_params, len(conversations))
        prompts = [self.prepare_chat(conv, tools=tools, where=f"conversation {i}", **kwargs)
                   for i, conv in enumerate(conversations)]
        params = [self.chat_constraint(prompt, p, where=f"conversation {i}")
                  for i, (prompt, p) in enumerate(zip(prompts, params))]
        outputs = self._generate([(p.prompt, p.token_ids) for p in prompts], params, use_tqdm=use_tqdm,
                                 label="conversation")
        for prompt, output in zip(prompts, outputs):
            for index, completion in enumerate(output.outputs):
                parsed = parse_chat_completion(self.tokenizer, prompt, output, index)
                completion.text = parsed.content
                completion.reasoning_content = parsed.reasoning_content
                completion.tool_calls = parsed.tool_calls
        return outputs

    def chat_constraint(self, prompt: ChatPrompt, params: SamplingParams, where: str = "conversation") -> SamplingParams:
        """`params` with the structured-output constraint deepseek-recipe asks of `prompt` (JSON for a
        `response_format`, DeepSeek's tool-call block for tools: `serve.structured.tool_calls`),
        unless `params` has its own."""
        if params.structured_outputs is not None or prompt.output_constraint is None:
            return params
        from deepinfer.serve.structured.tool_calls import chat_constraint

        try:
            constraint = chat_constraint(prompt.output_constraint, model_type=self.config.model_type,
                                         tokenizer=self.tokenizer)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return dataclasses.replace(params, structured_outputs=constraint)

    def prepare_chat(self, messages: Sequence[Mapping[str, Any]], *, tools=None, where: str = "conversation",
                     thinking: bool | None = None, reasoning_effort: str | None = None, tool_choice=None,
                     response_format=None) -> ChatPrompt:
        """Encode one conversation for this model (errors are `ValueError`s prefixed by `where`)."""
        try:
            return prepare_chat(messages, model_type=self.config.model_type, tokenizer=self.tokenizer,
                                thinking=thinking, reasoning_effort=reasoning_effort, tools=tools,
                                tool_choice=tool_choice, response_format=response_format)
        except ChatEncodingError as e:
            raise ValueError(f"{where}: {e}") from None
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def get_metrics(self) -> dict[str, Any]:
        """Engine metrics under vLLM's Prometheus names (`interfaces.md` §6).

        Gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
        (0-1); counters `vllm:prompt_tokens` (each request's prompt, counted at its first token),
        `vllm:generation_tokens`, `vllm:num_preemptions`, `vllm:request_success` ({finish reason:
        count}); histogram samples (lists, seconds or tokens) `vllm:time_to_first_token_seconds`,
        `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`,
        `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`. With speculative decoding,
        vLLM's spec-decode counters too: `vllm:spec_decode_num_drafts`,
        `vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens` and
        `vllm:spec_decode_num_accepted_tokens_per_pos` ({position: count}). With the prefix cache,
        `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` (tokens looked up, tokens found).
        """
        return self.metrics.snapshot()

    def start_profile(self, log_dir: str | os.PathLike) -> None:
        """Start a `jax.profiler` trace written under `log_dir` (view with TensorBoard / XProf)."""
        if self._profile_dir is not None:
            raise RuntimeError(f"a profile is already being recorded into {self._profile_dir}")
        log_dir = os.fspath(log_dir)
        os.makedirs(log_dir, exist_ok=True)
        jax.profiler.start_trace(log_dir)
        self._profile_dir = log_dir

    def stop_profile(self) -> str:
        """Stop the trace started by `start_profile`; returns its directory."""
        if self._profile_dir is None:
            raise RuntimeError("no profile is being recorded (call start_profile first)")
        jax.profiler.stop_trace()
        log_dir, self._profile_dir = self._profile_dir, None
        return log_dir

    # ---- requests ---------------------------------------------------------------------------

    def _next_request_id(self) -> str:
        return f"llm-{next(self._ids)}"

    def _add_request(self, prompt_text: str | None, ids: list[int], params: SamplingParams) -> str:
        """Queue one request in the engine; raises ValueError for a prompt that cannot run."""
        request_id = self._next_request_id()
        self.engine.add_request(request_id, ids, params, prompt=prompt_text)
        return request_id

    def _generate(self, items, params, *, use_tqdm, label: str) -> list[RequestOutput]:
        added: list[str] = []
        try:
            for i, ((text, ids), sp) in enumerate(zip(items, params)):
                try:
                    added.append(self._add_request(text, ids, sp))
                except ValueError as e:
                    raise ValueError(f"{label} {i}: {e}") from None
        except BaseException:
            for request_id in added:
                self.engine.abort(request_id)
            raise
        bar = self._progress_bar(use_tqdm, total=len(added), desc="Processed prompts")
        results = self._run(added, progress=bar)
        return [results[r] for r in added]

    def warm_up(self, max_len: int | None = None, use_tqdm: bool = True,
                shapes: list[StepShape] | None = None) -> WarmupReport:
        """Compile, with a "Compiling step shapes" bar, every step shape of sequences up to
        `max_len` tokens (default: max_model_len), or the given `shapes`, that has not run yet
        (`serve.engine.warmup`); no request may be running. Returns what it compiled and how
        long it took."""
        shapes = pending_shapes(self.engine, max_len, shapes)
        if not shapes:
            return WarmupReport()
        start = time.perf_counter()
        bar = self._progress_bar(use_tqdm, total=len(shapes), desc="Compiling step shapes", unit="shape").bar
        try:
            report = warm_up(self.engine, shapes=shapes,
                             progress=None if bar is None else lambda i, n, shape, seconds: bar.update(1))
        finally:
            if bar is not None:
                bar.close()
            self.warmup_seconds += time.perf_counter() - start
        return report

    def _progress_bar(self, use_tqdm, *, total: int, desc: str, **kwargs) -> _Progress:
        if not use_tqdm or total == 0 or jax.process_index() != 0:
            return _Progress(None)
        if callable(use_tqdm):
            factory = use_tqdm
        else:
            from tqdm import tqdm as factory
        return _Progress(factory(total=total, desc=desc, dynamic_ncols=True, **kwargs))

    def _run(self, request_ids: Sequence[str], *, progress: _Progress | None = None,
             on_output: Callable[[RequestOutput], None] | None = None) -> dict[str, RequestOutput]:
        """Step the engine until every request in `request_ids` finished; aborts them on error."""
        progress = progress or _Progress(None)
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        try:
            if self.warmup and not self.engine.scheduler.running:
                self.warm_up(shapes=planned_shapes(self.engine))
            while pending:
                if not self.engine.has_unfinished():
                    raise RuntimeError(f"the engine dropped {len(pending)} request(s) without a result")
                outputs = self.engine.step()
                self.metrics.finished(outputs)
                for output in outputs:
                    if output.request_id in pending:
                        pending.discard(output.request_id)
                        results[output.request_id] = output
                        progress.update(output)
                        if on_output is not None:
                            on_output(output)
                self.metrics.maybe_log(self.log_stats_interval)
        except BaseException:
            for request_id in pending:
                aborted = self.engine.abort(request_id)
                if aborted is not None:
                    self.metrics.finished([aborted])
            raise
        finally:
            progress.close()
        return results

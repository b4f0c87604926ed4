"""The offline engine: requests in, `RequestOutput`s out, one `step()` at a time.

A step asks the scheduler for work, runs the prefill chunks and the decode batch on the
device, where the rows that reached the end of their input are sampled (each request's sampling
settings are written to its slot's device state when it is admitted), and applies the stop rules
(EOS unless `ignore_eos`, `stop_token_ids`, stop strings across token boundaries, `max_tokens`,
`min_tokens`, the context limit) to the sampled tokens. Everything here is host-side Python; the
device work is the runner's and the sampler's.

A request without a seed gets one drawn from the engine's seed (`EngineConfig.seed`) when it is
added: sampling is counter-based (seed, position), so every request's tokens are reproducible.

Asynchronous scheduling (on by default, `EngineConfig.async_scheduling`): a step plans and
dispatches its device work on top of the previous step, whose sampled tokens the host has not
read yet, and only then reads them, while the device runs the new step. A decode row's input
token that the host does not know is a placeholder the device fills in from its slot's last
sample (`placeholders.py`). Stop rules therefore see a token one step late: a request that a
stop string, a stop id or EOS ends has been given one more step, whose token is dropped (never
emitted nor counted). Limits the host can count (`max_tokens`, the context) release the slot
when the last token is dispatched, as the synchronous engine would after reading it. The device
runs the steps in the order they were dispatched (each takes the cache the previous returned),
so a page or slot freed while a step that writes it is in flight is only reused after it.

Structured output (`serve/structured`): a constrained row's mask needs every token its request
has sampled. When a decode step has such a row whose last token is still in flight, the step runs
as two programs (`runner.run_split`): the model half is dispatched first, then the host reads the
previous step, advances the grammars and builds the masks while the device computes, then the
sampler half is dispatched with them, on one device or a mesh. (With speculative decoding the
engine reads the previous step first instead.) With jump-forward (`_jump_forward`) the tokens a grammar forces
are appended when the request is added and after each step's tokens are read; they are its next
input, computed as one chunk (a request that jumped while its next decode's model half ran keeps
no sample of that step).

DSpark speculative decoding (`EngineConfig.speculative`, `speculative.py`): the decodes run as one
verify step in which the drafter proposes each request's next block, the target verifies it and
the request gains the accepted drafts and one more token. The host only chooses how many drafts
each request verifies: `num_speculative_tokens`, or with confidence-scheduled verification the
step's width from the requests' earlier confidences (`verify_schedule.py`), at most its lookahead
(`Request.lookahead`, whose pages the scheduler reserves). Such an engine reads each step before
planning the next. In a step in which constrained requests check drafts, the host reads the
drafts before the acceptance program runs, so that their grammars can mask every verify position
after reading the drafts before it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np

from deepinfer.model.config import ModelConfig
from deepinfer.model.drafter import has_drafter
from deepinfer.pallas_kernels.registry import KernelConfig
from deepinfer.serve.engine.types import MAX_LOGPROBS, RequestOutput, SamplingParams, logprob_entry
from deepinfer.serve.engine import sampling_state
from deepinfer.serve.engine.cache import AdmissionError, CacheManager, make_layout
from deepinfer.serve.engine.engine_config import PREFILL_MODES, EngineConfig
from deepinfer.serve.engine.page_io import PageIO
from deepinfer.serve.engine.expert_balance import ExpertBalancer
from deepinfer.serve.engine.page_store import params_fingerprint
from deepinfer.serve.engine.parallel_sampling import SampleGroup, SampleGroups, child_ids
from deepinfer.serve.engine.prompt_logprobs import chunk_targets, prompt_logprobs_of, scores_chunk
from deepinfer.serve.engine.prefix_cache import PrefixCacheConfig
from deepinfer.serve.engine.request import Request, Status
from deepinfer.serve.engine.runner import ChunkWork, ModelRunner, PendingSamples, SplitStep, StepSampling, token_bucket
from deepinfer.serve.engine.sampler import SampleOutput
from deepinfer.serve.engine.scheduler import GRANULE, Scheduler, prefill_passes
from deepinfer.serve.engine.speculative import SpecDecodeCounts
from deepinfer.serve.engine.verify_schedule import VerifySchedule
from deepinfer.serve.text.detokenizer import IncrementalDetokenizer
from deepinfer.serve.text.stops import StopChecker
from deepinfer.sharding.distributed import process_zero_value

log = logging.getLogger("deepinfer.engine")
FORCED_BUCKET = 16  # the shortest token bucket of a step of jump-forward chunks


class EngineStalledError(RuntimeError):
    """A step could not advance any request (an engine bug, never a request's fault): raised
    instead of looping forever, naming the requests and how far each got."""


class LLMEngine:
    def __init__(self, params: dict, config: ModelConfig, tokenizer, engine_config: EngineConfig = EngineConfig(),
                 mesh=None):
        """`mesh` (axes dp, cp, tp; see `deepinfer.sharding.make_mesh`): run on many devices, each
        sequence on one dp rank, the experts split over all devices. None: one device."""
        self.config = config
        self.tokenizer = tokenizer
        if engine_config.prefill_mode == "compact" and engine_config.keep_tokens < config.sliding_window:
            raise ValueError(f"keep_tokens ({engine_config.keep_tokens}) must cover the sliding window "
                             f"({config.sliding_window})")
        if engine_config.deterministic:
            engine_config = dataclasses.replace(engine_config, kernels=dataclasses.replace(
                engine_config.kernels or KernelConfig(), batch_invariant=True))
        self.engine_config = engine_config
        self.speculative = engine_config.speculative
        # speculative steps are read before the next is planned (speculative.py: not overlapped yet)
        self.async_scheduling = engine_config.async_scheduling and self.speculative is None
        if self.speculative is not None:
            if not has_drafter(params, config):
                raise ValueError("speculative: method 'dspark' needs the checkpoint's DSpark drafter (mtp.* of a "
                                 "DeepSeek-V4.1 checkpoint); these params have none")
            self.speculative.check(config)
        drafter = (engine_config.drafter_context or self.speculative is not None) and has_drafter(params, config)
        draft_rings = config.num_nextn_predict_layers if drafter else 0
        layout = make_layout(config, engine_config.budget, dp=1 if mesh is None else mesh.shape["dp"],
                             draft_rings=draft_rings)
        prefix = engine_config.prefix_cache
        late_engram = [layer for layer in config.engram_layer_ids if layer >= config.decoder_start]
        if prefix is not None and prefix.replay == "exact" and engine_config.prefill_mode == "compact" and late_engram:
            # below the compact floor a decoder layer's Engram gate is shut, so the KV its layer
            # sources would depend on where the floor was, not on the tokens alone
            raise ValueError(f"prefix_cache: exact replay with compact prefill needs every Engram layer before the "
                             f"first decoder layer ({config.decoder_start}); engram_layer_ids has {late_engram}")
        if (prefix is not None and (prefix.host_pages or prefix.disk_dir) and mesh is not None
                and len({d.process_index for d in mesh.devices.flat}) > 1):
            raise ValueError("prefix_cache: the host and disk tiers need a mesh of one process's devices (they "
                             "copy pages through this process's host memory)")
        weights = params_fingerprint(params) if prefix is not None and prefix.disk_dir else b""
        self.cache = CacheManager(config, layout, prefix, weights)
        self.runner = ModelRunner(params, config, layout, engine_config.kernels, mesh=mesh,
                                  keep_logical_experts=engine_config.eplb_interval is not None,
                                  max_logit_bias=engine_config.max_logit_bias,
                                  max_bans=engine_config.max_stop_token_ids + 1,
                                  min_page_tokens=engine_config.min_page_bucket_tokens)
        self.cache.connect(PageIO(self.runner))
        self.balancer = None
        if engine_config.eplb_interval is not None:
            self.balancer = ExpertBalancer.for_mesh(config.num_hidden_layers, config.n_routed_experts,
                                                    engine_config.eplb_slots, mesh,
                                                    interval=engine_config.eplb_interval)
            self.runner.apply_expert_layout(*self.balancer.initial(), self.balancer.max_replicas)
        self.scheduler = Scheduler(self.cache, prefill_chunk=engine_config.prefill_chunk,
                                   max_num_batched_tokens=engine_config.max_num_batched_tokens,
                                   lookahead=self._lookahead, replay_tokens=self._replay_tokens())
        self.requests: dict[str, Request] = {}
        self._samples = SampleGroups()  # parallel sampling (n > 1)
        self._order = itertools.count()
        self._seeds = np.random.default_rng(engine_config.seed)  # of requests without one
        self._sampling_slots: set[int] = set()  # slots whose sampling state a request wrote
        self._step_count = 0
        self._in_flight: list[_Sampled] = []  # the dispatched step's sampled rows, not read yet
        self._ready: list[RequestOutput] = []  # finished by `sync()`, returned by the next step
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "forced_tokens": 0}
        # vLLM's spec-decode counters (`SpecDecodeCounts.metrics`); None without speculative decoding
        self.spec_counts = None if self.speculative is None else SpecDecodeCounts(
            self.speculative.num_speculative_tokens)
        self.warmed_shapes: set = set()  # step shapes `serve.engine.warmup.warm_up` compiled
        self._grammars = None  # the structured-output backend, built for the first constrained request
        # a decode step can run as two programs (`runner.run_split`) where its masks need the
        # tokens in flight (asynchronous scheduling, no speculative decoding)
        self._splits = self.async_scheduling and self.speculative is None
        # confidence-scheduled verification: a plain decode step's cost and a verify step's per
        # width, profiled now (dummy steps on the idle engine: `warmup.time_decode_steps`) unless
        # the speculative config gives them
        self.verify_schedule = None
        if self.speculative is not None and self.speculative.enable_adaptive_verification:
            from deepinfer.serve.engine.warmup import time_decode_steps

            seconds = self.speculative.verify_step_seconds or time_decode_steps(self)
            # one curve for every process of a multi-process mesh (each measured or was given its
            # own): the widths they choose must be the same, or their steps' collectives never meet
            seconds = process_zero_value(np.asarray(seconds, np.float64)).tolist()
            log.info("step seconds: plain decode %.4f, verify by drafts per row %s (speculative_config "
                     "\"verify_step_seconds\": [%s])", seconds[0],
                     ", ".join(f"{w}: {s:.4f}" for w, s in enumerate(seconds) if w),
                     ", ".join(f"{s:.6f}" for s in seconds))
            self.verify_schedule = VerifySchedule(seconds, temperatures=self.speculative.confidence_temperatures)

    def verify_widths(self) -> list[int]:
        """The drafts per row a verify step of this engine can check (its compiled widths)."""
        if self.speculative is None:
            return []
        k = self.speculative.num_speculative_tokens
        return list(range(1, k + 1)) if self.speculative.enable_adaptive_verification else [k]

    def decodes_plainly(self) -> bool:
        """Whether decode steps can run as plain decode steps: always without speculative
        decoding, and with confidence-scheduled verification where no draft pays."""
        return self.speculative is None or self.speculative.enable_adaptive_verification

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    prompt: str | None = None) -> None:
        """Queue a request; with `params.n > 1` its n samples run as child requests whose
        completions come back in one `RequestOutput` (`parallel_sampling.py`)."""
        params = params or SamplingParams()
        if params.n == 1:
            self._add(request_id, prompt_token_ids, params, prompt)
            return
        self._check_id_free(request_id)
        for cid in child_ids(request_id, params.n):
            if cid in self.requests or cid in self._samples:
                raise ValueError(f"request_id {request_id!r}: {cid!r}, the id of one of its n={params.n} samples, "
                                 "is already in use")
        ids = [int(t) for t in prompt_token_ids]
        seed = params.seed if params.seed is not None else self._default_seed(ids)
        group = self._samples.open(request_id, params.n)
        try:
            for i, cid in enumerate(group.child_ids):
                self._add(cid, ids, SampleGroup.child_params(params, i, seed), prompt)
        except BaseException:
            self.abort(request_id)
            raise

    def sample_ids(self, request_id: str) -> list[str]:
        """The engine ids of `request_id`'s samples, by index: its children with `n > 1`, else
        itself (for callers that stream each sample's tokens from `requests`)."""
        return self._samples.sample_ids(request_id)

    def _check_id_free(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self._samples:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None) -> None:
        self._check_id_free(request_id)
        ids = [int(t) for t in prompt_token_ids]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        params.check_vocabulary(self.config.vocab_size)
        if params.cache_ttl_class is not None:  # a known class, even where nothing is cached
            (self.engine_config.prefix_cache or PrefixCacheConfig()).ttl(params.cache_ttl_class)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise ValueError(f"{name}: at most {MAX_LOGPROBS} alternatives are supported, got {value}")
        sampling_state.check_capacity(params, eos_token_id=self.config.eos_token_id,
                                      max_logit_bias=self.runner.max_logit_bias, max_bans=self.runner.max_bans)
        self.cache.check_admissible(len(ids), self.cache.layout.max_len)
        constraint = self._constraint(params, ids) if params.structured_outputs is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) if params.detokenize else None
        request = Request(request_id, prompt, ids, params, detok,
                          StopChecker(params.stop, params.include_stop_str_in_output), next(self._order))
        request.logprobs = [] if params.logprobs is not None else None
        request.constraint = constraint
        request.seed = params.seed if params.seed is not None else self._default_seed(ids)
        self.requests[request_id] = request
        self.scheduler.add(request)
        if self._jump_forward(request):  # (the grammar forced all of it)
            self._ready += self._complete([request])

    def _default_seed(self, prompt_ids: list[int]) -> int:
        """The noise seed of a request without one: the next of the engine's seeds, or in
        deterministic mode one from the engine's seed and the prompt, so that the request's
        samples do not depend on when it arrived."""
        if not self.engine_config.deterministic:
            return int(self._seeds.integers(1 << 32))
        digest = hashlib.blake2b(np.asarray(prompt_ids, np.int64).tobytes(), digest_size=8,
                                 key=self.engine_config.seed.to_bytes(8, "little", signed=True)).digest()
        return int.from_bytes(digest[:4], "little")

    def _constraint(self, params: SamplingParams, prompt_ids: list[int]):
        """The request's grammar state; `ValueError` naming the field when its spec does not compile."""
        from deepinfer.serve.structured import LLGuidanceBackend, RequestConstraint, ThinkTokens

        if self._grammars is None:
            self._grammars = LLGuidanceBackend(self.tokenizer, self.config.vocab_size, self.config.eos_token_id)
            self._think = ThinkTokens.of(self.tokenizer)
        matcher = self._grammars.matcher(self._grammars.compile(params.structured_outputs))
        return RequestConstraint.for_prompt(matcher, prompt_ids, self._think)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (every sample of a parallel-sampling one): its output with what it
        generated, finish reason "abort"; None when it is unknown or already returned."""
        closed = self._samples.close(request_id)
        if closed is None:
            return self._abort_one(request_id)
        group, pending = closed
        ready = {o.request_id: o for o in self._ready}
        for i, cid in pending:
            if cid in ready:  # finished by `sync()`, not returned yet
                self._ready.remove(ready[cid])
                group.finished[i] = ready[cid]
                continue
            output = self._abort_one(cid)
            if output is not None:
                group.finished[i] = output
        return group.merged() if group.finished else None

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.abort(request)  # also frees a request finished by a step that then raised
        self._forget_in_flight([request])
        self._clear_left_slots()
        if request.finished:
            return None
        request.status, request.finish_reason = Status.FINISHED, "abort"
        request.metrics.finished_time = time.time()
        return self._output(request)

    def _output(self, request: Request) -> RequestOutput:
        output = request.to_output()
        output.prompt_logprobs = prompt_logprobs_of(request, self._decode_one)
        return output

    def draft(self, request_ids: list[str]) -> dict[str, dict[str, np.ndarray]]:
        """Greedy DSpark drafts for running requests from the drafter rings: the block after each
        request's last sampled token (its anchor), i.e. what speculative decoding would verify
        next: `tokens`, `logits`, `confidence` `[block, ...]` per request. Between steps every
        decoding request qualifies (its last sample is not in the cache yet)."""
        if not self.cache.layout.draft_rings:
            raise ValueError("this engine keeps no drafter context: the checkpoint has no DSpark drafter "
                             "(mtp.*) or drafter_context is off")
        self.sync()
        rows = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status != Status.RUNNING or not request.output_ids or request.to_feed != 1:
                raise ValueError(f"request {request_id!r}: drafting needs a running request whose last sampled "
                                 "token is not in the cache yet")
            rows.append(request)
        out = self.runner.draft([r.slot for r in rows], [r.output_ids[-1] for r in rows],
                                [r.length - 1 for r in rows], [r.floor for r in rows])
        return {r.request_id: {k: out[k][i] for k in ("tokens", "logits", "confidence")} for i, r in enumerate(rows)}

    def counters(self) -> dict:
        """The engine's own counters under vLLM's names: spec decode and prefix cache, each only
        when it is on."""
        out = {} if self.spec_counts is None else self.spec_counts.metrics()
        if self.cache.prefix is not None:
            stats = self.scheduler.prefix_stats
            out["vllm:prefix_cache_queries"], out["vllm:prefix_cache_hits"] = stats["queries"], stats["hits"]
            out["deepinfer:prefix_cache_hits_by_tier"] = {
                "device": stats["hits"] - stats["hits_host"] - stats["hits_disk"],
                "host": stats["hits_host"], "disk": stats["hits_disk"]}
        return out

    def has_unfinished(self) -> bool:
        """Requests wait, run, or have a token in flight."""
        return self.scheduler.has_work or bool(self._ready or self._in_flight)

    def sync(self) -> None:
        """Read the step in flight now (asynchronous scheduling): every request's tokens are then
        on the host. The outputs of the requests it finishes come with the next `step()`."""
        if self._in_flight:
            rows, self._in_flight = self._in_flight, []
            self._ready += self._complete(self._settle(rows))

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch a step; read the tokens of the step before it (asynchronous
        scheduling) or of this one. Returns the requests that finished."""
        if self._in_flight and not self._splits and any(s.request.constraint is not None for s in self._in_flight):
            # a grammar's next mask needs the token in flight and this engine cannot split its
            # decode step (mesh, speculative decoding): read it first, as the synchronous engine does
            self.sync()
        plan = self.scheduler.schedule()
        now = time.time()
        for request in plan.admitted:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            request.floor = self.replay_floor(request)
            request.prompt_scores = {}  # (recomputed from the start after a preemption)
        self.runner.reset([r.slot for r in plan.admitted])
        for request in plan.admitted:
            if request.slot is not None:  # (not preempted again while this step was planned)
                self.runner.write_sampling(request.slot, self._slot_row(request))
                self._sampling_slots.add(request.slot)
        # a constrained decode whose last token is in flight: the model half of the decode step
        # runs while the host reads that token and builds the masks, then the sampler (`_split`)
        split = self._splits and any(r.constraint is not None and r.pending for r in plan.decode)
        width = self._verify_width(plan.decode)  # None: the decodes (if any) run as a plain decode step
        sampled, deferred = self._dispatch(plan, split, plain_decode=width is None)
        if self.async_scheduling:
            to_read, self._in_flight = self._in_flight, sampled
        else:
            to_read = sampled
        finished = self._settle(to_read)
        if deferred is not None:
            self._in_flight += self._sample_split(deferred, plan.decode)
        if width is not None:
            finished += self._verify(plan.decode, width)
        self._finish_stuck(plan, finished)
        self._check_progress(plan, finished, read=bool(to_read))
        self.cache.flush_disk(block=not self.has_unfinished())
        self._step_count += 1
        if self.balancer is not None and self.balancer.due(self._step_count):
            layout = self.balancer.update(self.runner.read_counts())
            if layout is not None:
                self.runner.apply_expert_layout(*layout, self.balancer.max_replicas)
        self.stats["steps"] += 1
        outputs, self._ready = self._ready + self._complete(finished), []
        return self._samples.gather(outputs)

    def _dispatch(self, plan, split: bool = False, plain_decode: bool = True) -> tuple[list[_Sampled], SplitStep | None]:
        """Run the plan's prefill chunks and, with `plain_decode`, its decodes as a plain decode
        step on the device without waiting for them; returns the rows that sampled a token
        (pending in their request until read) and, with `split`, the decode step whose sampler
        is still to be dispatched (`_sample_split`)."""
        sampled: list[_Sampled] = []
        for step in prefill_passes(plan.prefill, self.cache):
            decoder, group = step.decoder, step.chunks
            scored = [(r, n) for r, n in group if scores_chunk(r)]
            group = [(r, n) for r, n in group if not scores_chunk(r)]
            for request, n in scored:
                sampled += self._run_scored(request, n)
            if not group:
                continue
            work = [ChunkWork(r.slot, r.ids(r.computed, r.computed + n), r.computed, self._lookback(r, r.computed),
                              r.floor, r.write_floor) for r, n in group]
            emit = [r.computed + n == r.length for r, n in group]
            sample = self._step_sampling([r if e else None for (r, _), e in zip(group, emit)]) if decoder else None
            # chunks after the prompts are forced tokens (jump-forward): a few tokens, a short bucket
            forced = all(r.computed >= len(r.prompt_token_ids) for r, _ in group)
            tokens = token_bucket(max(len(w.tokens) for w in work), FORCED_BUCKET if forced else GRANULE)
            out = self.runner.run(work, self.cache.page_table, rows=step.rows, decoder=decoder, tokens=tokens,
                                  sample=sample, defer=True)
            for i, (request, n) in enumerate(group):
                self.stats["prompt_tokens"] += max(0, min(request.computed + n, len(request.prompt_token_ids))
                                                   - request.computed)  # (not forced tokens)
                request.computed += n
                self.scheduler.publish(request)
                if request.to_feed == 0:
                    sampled.append(self._sampled(request, out, i))
        if plan.decode and plain_decode:
            work = [ChunkWork(r.slot, r.ids(r.length - 1, r.length), r.length - 1, self._lookback(r, r.length - 1),
                              r.floor) for r in plan.decode]
            if split:
                deferred = self.runner.run_split(work, self.cache.page_table)
                for request in plan.decode:
                    request.computed += 1
                    self.scheduler.publish(request)
                return sampled, deferred
            out = self.runner.run(work, self.cache.page_table, rows=self.cache.layout.slots_per_rank, tokens=1,
                                  sample=self._step_sampling(plan.decode), defer=True)
            for i, request in enumerate(plan.decode):
                request.computed += 1
                self.scheduler.publish(request)
                sampled.append(self._sampled(request, out, i))
        return sampled, None

    def _run_scored(self, request: Request, n: int) -> list[_Sampled]:
        """Dispatch the next `n`-token prompt chunk of a request that asked for prompt logprobs
        (`prompt_logprobs.py`); its sampled row when the chunk ends its input."""
        start = request.computed
        work = ChunkWork(request.slot, request.ids(start, start + n), start, self._lookback(request, start),
                         request.floor, request.write_floor)
        emit = start + n == request.length
        samples, scores = self.runner.run_scored(
            work, self.cache.page_table, tokens=token_bucket(n, GRANULE), targets=chunk_targets(request, start, n),
            num_logprobs=request.params.prompt_logprobs,
            sample=self._step_sampling([request]) if emit else None)
        request.prompt_scores[start] = (n, scores)
        self.stats["prompt_tokens"] += max(0, min(start + n, len(request.prompt_token_ids)) - start)
        request.computed += n
        self.scheduler.publish(request)
        return [self._sampled(request, samples, 0)] if emit else []

    def _replay_tokens(self) -> int:
        prefix = self.engine_config.prefix_cache
        return 0 if prefix is None else prefix.replay_tokens(self.config.sliding_window,
                                                             self.config.num_hidden_layers)

    def _sample_split(self, deferred: SplitStep, requests: list[Request]) -> list[_Sampled]:
        """Dispatch the sampler of a split decode step, the previous step's tokens read and the
        grammars advanced; a request that finished meanwhile, or whose grammar forced tokens
        after the token read (jump-forward: they are its next input), keeps no token (and writes
        no state)."""
        rows = [None if r.finished or r.to_feed else r for r in requests]  # (to_feed: it jumped forward)
        out = deferred.sample(self._step_sampling(rows))
        return [self._sampled(r, out, i) for i, r in enumerate(rows) if r is not None]

    def _sampled(self, request: Request, out: PendingSamples, row: int) -> _Sampled:
        """Row `row` of `out` is `request`'s next token. When the host can count that it is the
        last (max_tokens, the context), the request takes no further step: its slot and pages
        are released now, as the synchronous engine does once it has read the token."""
        request.pending += 1
        limit = request.params.max_tokens
        if (limit is not None and len(request.output_ids) + request.pending >= limit) \
                or request.length >= self.cache.layout.max_len:
            request.closing = "length"
            self.scheduler.finish(request)
        return _Sampled(request, out, row)

    def _complete(self, finished: list[Request]) -> list[RequestOutput]:
        """Outputs of the finished requests, whose slots and pages are released and whose tokens
        still in flight (computed past a stop) will never be read."""
        outputs = []
        for request in finished:
            self.scheduler.finish(request)
            request.metrics.finished_time = time.time()
            outputs.append(self._output(request))
            self.requests.pop(request.request_id, None)
        self._forget_in_flight(finished)
        self._clear_left_slots()
        return outputs

    def _forget_in_flight(self, requests: list[Request]) -> None:
        gone = {id(r) for r in requests}
        if self._in_flight and gone:
            self._in_flight = [s for s in self._in_flight if id(s.request) not in gone]

    def replay_floor(self, request: Request) -> int:
        """Where the decoder layers start on `request`'s tokens, fixed when it is admitted: in
        compact prefill the last `keep_tokens` of its sequence, else (and for prompt logprobs)
        all of it."""
        if self.engine_config.prefill_mode != "compact" or request.params.prompt_logprobs is not None:
            return 0
        return max(0, request.length - self.engine_config.keep_tokens)

    def _clear_left_slots(self) -> None:
        """Slots whose request finished, was aborted or preempted go back to neutral sampling."""
        held = {r.slot for r in self.scheduler.running}
        left = self._sampling_slots - held
        if left:
            self.runner.clear_sampling(sorted(left))
            self._sampling_slots &= held

    def _lookback(self, request: Request, start: int) -> np.ndarray:
        """The tokens right before `start` that the chunk's Engram n-grams reach back to: O(1) per
        row, whatever the context."""
        return request.ids(start - self.runner.lookback, start)

    def _check_progress(self, plan, finished: list[Request], read: bool) -> None:
        """Refuse to spin: a step that computed no token, read none, finished and preempted no
        request leaves the engine as it was, so the next step would do the same forever."""
        broken = [r for r in self.scheduler.running if not 0 <= r.computed <= r.length]
        if broken:
            raise EngineStalledError("engine invariant broken: " + ", ".join(
                f"request {r.request_id!r} has {r.computed} tokens computed of {r.length}" for r in broken))
        if plan.prefill or plan.decode or plan.admitted or plan.preempted or finished or read \
                or not self.scheduler.has_work:
            return
        state = [f"{r.request_id!r} (running, {r.computed}/{r.length} tokens computed)" for r in self.scheduler.running]
        state += [f"{r.request_id!r} (waiting, {r.length} tokens)" for r in self.scheduler.waiting]
        raise EngineStalledError("engine step scheduled no work and no request can advance: " + ", ".join(state))

    def _finish_stuck(self, plan, finished: list[Request]) -> None:
        """A lone running request that cannot get another page ends with "length"."""
        if plan.prefill or plan.decode:
            return
        for request in list(self.scheduler.running):
            if request.to_feed == 1 and request not in finished:
                request.finish_reason = "length"
                request.status = Status.FINISHED
                request.flush_text()
                finished.append(request)

    # ---- sampling and stop rules -------------------------------------------------------
    def _slot_row(self, request: Request) -> sampling_state.SlotRow:
        """The request's sampling state, for the slot it was admitted to (its output so far
        counts: a preempted request resumes where it was)."""
        return sampling_state.slot_row(
            request.params, seed=request.seed, vocab_size=self.config.vocab_size,
            max_logit_bias=self.runner.max_logit_bias, max_bans=self.runner.max_bans,
            eos_token_id=self.config.eos_token_id, prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_ids)

    def _step_sampling(self, rows: list[Request | None], masks: bool = True) -> StepSampling:
        """The sampling of a step's work rows (None: the row emits no token). Log-probabilities
        are computed only when one of its sampled rows asks; the structured-output masks only when
        one of them is constrained (built here, from grammars that have read every earlier token)
        and `masks` (False: the caller builds them)."""
        emitting = [r for r in rows if r is not None]
        wants = any(r.params.logprobs is not None for r in emitting)
        constrained = [(i, r.constraint) for i, r in enumerate(rows)
                       if masks and r is not None and r.constraint is not None and r.constraint.active]
        allowed = None
        if constrained:
            if any(rows[i].pending for i, _ in constrained):  # (`step` reads them first: a safeguard)
                raise EngineStalledError("a structured-output mask was built before its request's last token was read")
            allowed = np.full((len(rows), (self.config.vocab_size + 31) // 32), -1, np.int32)
            self._grammars.fill([(c.matcher, i) for i, c in constrained], allowed)
        return StepSampling([r is not None for r in rows], MAX_LOGPROBS if wants else None, allowed)

    def _settle(self, rows: list[_Sampled]) -> list[Request]:
        """Read the sampled rows of a dispatched step (waiting for the device if need be), append
        each request's token (and its logprobs) and apply the stop rules; a request that ended
        (or was aborted) since the step was dispatched drops its token. Returns the requests
        that finished."""
        finished: list[Request] = []
        for sampled in rows:
            request = sampled.request
            if request.finished:
                continue
            out = _row(sampled.samples.fetch(), sampled.row)
            request.pending -= 1
            if self._take(request, int(out.tokens), out) or self._jump_forward(request):
                finished.append(request)
            elif request.closing and not request.pending:  # (the limits are counted alike: a safeguard)
                request.finish_reason, request.status = request.closing, Status.FINISHED
                request.flush_text()
                finished.append(request)
        return finished

    def _take(self, request: Request, token: int, out: SampleOutput | None) -> bool:
        """Append a sampled `token` (with its logprobs from `out` when the request asks) and
        apply the stop rules; True when the request finished."""
        now = time.time()
        request.output_ids.append(token)
        self.stats["generation_tokens"] += 1
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        if request.constraint is not None and not request.constraint.accept(token):
            # (the mask allowed only what the grammar accepts: a safeguard)
            log.error("request %r: token %d is outside its structured-output grammar: %s", request.request_id,
                      token, request.constraint.error)
            request.finish_reason, request.stop_reason = "stop", "grammar_error"
            request.flush_text()
            request.status = Status.FINISHED
            return True
        if request.logprobs is not None:
            request.logprobs.append(logprob_entry(token, out.logprobs, out.ranks, out.top_ids, out.top_logprobs,
                                                  request.params.logprobs, self._decode_one))
            request.cumulative_logprob += float(out.logprobs)
        if request.check_stop(token, self.config.eos_token_id, self.cache.layout.max_len):
            request.status = Status.FINISHED
            return True
        if request.constraint is not None and request.constraint.finished:  # the grammar is complete
            request.finish_reason = "stop"
            request.flush_text()
            request.status = Status.FINISHED
            return True
        return False

    def _jump_forward(self, request: Request) -> bool:
        """Jump-forward (`StructuredOutputsParams.jump_forward`), when `request` is added and once
        a step's tokens of it are read: the tokens its grammar now forces (llguidance's canonical
        tokenization of the forced bytes) are appended as if sampled, within max_tokens and the
        context, and the stop rules apply to each; its next step computes them as one chunk and
        samples after them. Its slot's sampling state is rewritten, so that penalties and
        min_tokens count them. Not where the forced tokens and the token before them would be
        tokenized differently together. True when the request finished."""
        constraint = request.constraint
        if constraint is None or not request.params.structured_outputs.jump_forward or request.pending \
                or not constraint.active or request.closing:
            return False
        forced = constraint.matcher.compute_ff_tokens()
        room = self.cache.layout.max_len - request.length
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output_ids))
        forced = forced[:max(room, 0)]
        # llguidance tokenizes the forced bytes canonically but not together with the token
        # before them: where the model's last token would merge with them ("hel" + "lo world"
        # is not how "hello world" is tokenized), do not jump; the model samples on under the mask
        if not forced or (request.output_ids and not self._grammars.canonical([request.output_ids[-1], *forced])):
            return False
        self.stats["forced_tokens"] += len(forced)
        if any(self._take(request, int(token), None) for token in forced):
            return True
        if request.slot is not None:  # (else its admission writes it)
            self.runner.write_sampling(request.slot, self._slot_row(request))
        return False

    # ---- speculative decoding ------------------------------------------------------------
    def _lookahead(self, request: Request) -> int:
        """Drafts `request`'s next verify step checks: `num_speculative_tokens`, fewer near its
        max_tokens or the context's end (the step gains at most lookahead + 1 tokens), none when
        speculative decoding is off."""
        if self.speculative is None:
            return 0
        room = self.cache.layout.max_len - request.length
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output_ids))
        return max(0, min(self.speculative.num_speculative_tokens, room - 1))

    def _verify_width(self, requests: list[Request]) -> int | None:
        """The drafts per row of this step's verify step: `num_speculative_tokens`, or with
        confidence-scheduled verification the scheduler's width; None: no verify step (no
        speculative decoding, no decodes, or a plain decode step pays more)."""
        if self.speculative is None or not requests:
            return None
        if self.verify_schedule is None:
            return self.speculative.num_speculative_tokens
        width = self.verify_schedule.width([r.confidence for r in requests], [r.lookahead for r in requests])
        return width or None

    def _verify(self, requests: list[Request], width: int) -> list[Request]:
        """One DSpark verify step over the decoding requests (`speculative.py`) in which each
        checks `width` drafts, fewer near its end (its lookahead), read at once: each gains its
        accepted drafts and one more token, checked against the stop rules token by token
        (tokens after a stop are dropped). Returns the requests that finished."""
        work = [ChunkWork(r.slot, r.ids(r.length - 1, r.length), r.length - 1, self._lookback(r, r.length - 1), r.floor)
                for r in requests]
        num, host = [], []
        for r in requests:  # host drafts (used once) may be fewer than it may verify: verify those
            n = min(r.lookahead, width)
            if r.host_drafts is not None:
                r.host_drafts = [int(t) for t in r.host_drafts[:n]]
                n = len(r.host_drafts)
            num.append(n)
            host.append(r.host_drafts)
            r.host_drafts = None
        if any(n and r.constraint is not None for n, r in zip(num, requests)):
            out = self._verify_constrained(requests, work, num, host, width + 1)
        else:
            out = self.runner.verify(work, self.cache.page_table, num, host, tokens=width + 1,
                                     sample=self._step_sampling(requests))
        finished, observed = [], []
        for i, request in enumerate(requests):
            accepted, count = int(out.accepted[i]), int(out.count[i])
            request.computed += 1 + accepted  # the anchor and the accepted drafts are in the cache
            self.scheduler.publish(request)
            self.spec_counts.record(num[i], accepted)
            if self.verify_schedule is not None and request.lookahead:
                request.confidence = self.verify_schedule.observe(request.confidence, out.confidence[i])
                observed.append(out.confidence[i])
            if num[i]:
                gained = [(int(out.tokens[i, j]), None if out.gained is None else _row(out.gained, i, j))
                          for j in range(count)]
            else:
                gained = [(int(out.sampled.tokens[i]), _row(out.sampled, i))]
            if any(self._take(request, token, row) for token, row in gained) or self._jump_forward(request):
                finished.append(request)
        if self.verify_schedule is not None:
            self.verify_schedule.observe_step(observed)
        return finished

    def _verify_constrained(self, requests: list[Request], work: list[ChunkWork], num: list[int],
                            host: list[list[int] | None], tokens: int):
        """A verify step in which constrained requests check drafts: the drafts come to the host
        (while the target verifies them), each constrained row's grammar gives a mask per verify
        position from them (without advancing), and the acceptance applies them (`speculative.py`)."""
        proposed = self.runner.propose(work, self.cache.page_table, num, host, tokens=tokens,
                                       sample=self._step_sampling(requests, masks=False))
        words = (self.config.vocab_size + 31) // 32
        masks = np.full((len(requests), tokens, words), -1, np.int32)
        jobs = []
        for i, request in enumerate(requests):
            where = None if request.constraint is None else \
                request.constraint.draft_masks(proposed.drafts[i, :num[i]].tolist())
            if where is not None:
                first, read = where
                jobs.append((request.constraint.matcher, i * tokens + first, read))
        self._grammars.fill_drafts(jobs, masks.reshape(len(requests) * tokens, words))
        return self.runner.check(proposed, masks)

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

@dataclass
class _Sampled:
    """A row of a dispatched step that sampled `request`'s next token."""

    request: Request
    samples: PendingSamples
    row: int


def _row(out: SampleOutput, *index: int) -> SampleOutput:
    """Row `i` of a step's sampled outputs (`index` = (i,)), or entry (i, j) of a verify step's
    gained tokens."""
    return SampleOutput(*(None if a is None else a[index] for a in
                          (out.tokens, out.logprobs, out.ranks, out.top_ids, out.top_logprobs)))


__all__ = ["PREFILL_MODES", "AdmissionError", "EngineConfig", "EngineStalledError", "LLMEngine"]

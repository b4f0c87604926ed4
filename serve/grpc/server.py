"""The gRPC server: one `LLMEngine` behind `deepinfer.engine.v1.LlmEngine`, on `grpc.aio`.

Threads and ownership:

* The engine lives in one background thread (`EngineDriver`). It loads the model (when given a
  loader), compiles every step shape a request can need (unless `warmup=False`), then loops:
  apply the queued commands (add, abort, call), run `engine.step()` while there is work, and
  publish what each request gained. Nothing else touches the engine's mutable state.
* The asyncio event loop runs the RPC handlers. A Generate call validates and tokenizes its input,
  hands the request to the driver and then reads its own `asyncio.Queue`, into which the driver
  posts (thread-safely) the token/text deltas of the live `Request` after every step, and finally
  the `RequestOutput` that `step()` returned for it.
* Cancellation: when the client goes away the handler is cancelled; its `finally` sends an abort,
  which the driver applies before the next step, so the slot and pages are free at once.

Health (`grpc.health.v1`, for "" and the service name): NOT_SERVING until the weights are loaded
and the warm-up compiled every step shape (GetServerInfo shows its progress), SERVING after,
NOT_SERVING again from the moment a drain starts. A non-loopback address needs TLS or a token
(or `allow_insecure_remote`); the start-up log says what is exposed. Server reflection lists the
engine, health and reflection services.

Limits (`ServerSettings`): message size (both directions), Generate streams in flight
(`max_concurrent_streams`) and requests queued beyond the cache slots (`max_queue`); over either
limit a Generate call gets RESOURCE_EXHAUSTED. Optional TLS and an optional bearer token checked
on every RPC by a server interceptor (the health service can stay open).

Shutdown (`GrpcServer.shutdown`, SIGTERM in `deepinfer serve`): health NOT_SERVING, new Generate
calls get UNAVAILABLE, in-flight streams get `grace` seconds to finish, the rest are aborted (they
end with finish_reason "abort"), then the transport stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health as health_lib
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deepinfer.serve.grpc import convert
from deepinfer.serve.grpc import deepinfer_engine_pb2 as pb
from deepinfer.serve.grpc.auth import BearerTokenInterceptor
from deepinfer.serve.grpc.engine_driver import EngineDriver, LoadedModel, ModelSource, _Stream
from deepinfer.serve.grpc.metrics import ServerMetrics
from deepinfer.serve.grpc.tls import check_tls_files, is_loopback

__all__ = [
    "BearerTokenInterceptor",
    "EngineDriver",
    "GrpcServer",
    "LoadedModel",
    "SERVICE_NAME",
    "ServerSettings",
    "ServerThread",
]

log = logging.getLogger("deepinfer.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LlmEngine"].full_name  # deepinfer.engine.v1.LlmEngine
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

LOADING, READY, DRAINING, FAILED, STOPPED = "LOADING", "SERVING", "DRAINING", "FAILED", "STOPPED"


# ---- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSettings:
    """How the server listens and what it allows.

    host / port: where to listen (port 0 picks a free one); loopback only unless told otherwise.
    max_message_bytes: largest request and response message, both directions.
    max_concurrent_streams: Generate calls in flight, server-wide.
    max_queue: requests in flight beyond the engine's cache slots (waiting for a slot).
    default_max_tokens: max_new_tokens of a request that leaves it unset (None: up to the context).
    tls_cert / tls_key: PEM files; both or neither.
    auth_token: bearer token required in the `authorization` metadata of every RPC (None: off);
        `auth_health` also requires it for the health service (default: health stays open).
    shutdown_grace_s: how long a drain waits for in-flight streams before aborting them.
    warmup: compile every step shape the server can be asked for before reporting SERVING.
    served_model_name: the name GetModelInfo and the metrics report (default: the model's).
    allow_insecure_remote: allow a non-loopback `host` with neither TLS nor a token (refused
        otherwise: anyone who reaches the port could use the engine and read the traffic).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    max_message_bytes: int = 16 * 1024 * 1024
    max_concurrent_streams: int = 256
    max_queue: int = 256
    default_max_tokens: int | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = field(default=None, repr=False)
    auth_health: bool = False
    shutdown_grace_s: float = 30.0
    warmup: bool = True
    served_model_name: str | None = None
    allow_insecure_remote: bool = False

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        for name in ("max_message_bytes", "max_concurrent_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue: must be non-negative, got {self.max_queue}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens: must be at least 1, got {self.default_max_tokens}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert / tls_key: give both or neither")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token: must not be empty")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s: must be non-negative, got {self.shutdown_grace_s}")
        if not (is_loopback(self.host) or self.tls_cert or self.auth_token or self.allow_insecure_remote):
            raise ValueError(f"host: {self.host!r} is not a loopback address and the server has neither TLS nor "
                             "an auth token: anyone who reaches it could use the engine and read the traffic; "
                             "add TLS and/or a token, or allow_insecure_remote (--allow-insecure-remote)")

    def exposure(self, port: int | None = None) -> str:
        """What a client reaching the port gets: address, TLS and auth, for the start-up log."""
        scope = "loopback only" if is_loopback(self.host) else "reachable from other machines"
        auth = ("on" + ("" if self.auth_health else " (health service open)")) if self.auth_token else "off"
        tls = "on" if self.tls_cert else "off"
        return f"{self.host}:{self.port if port is None else port} ({scope}), TLS {tls}, bearer-token auth {auth}"

    def public_dict(self) -> dict[str, Any]:
        """The settings without secrets (for GetServerInfo)."""
        d = asdict(self)
        d["auth_token"] = "<set>" if self.auth_token else None
        return d


# ---- the service --------------------------------------------------------------------------------


class _Malformed:
    """Stands in for a request whose bytes did not parse (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # noqa: BLE001 - DecodeError and friends: answered INVALID_ARGUMENT
            return _Malformed(e)
    return deserialize


def _struct(d: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()

    def clean(v):
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        return str(v)

    s.update(clean(d))
    return s


class GrpcServer:
    """The asyncio gRPC server around one engine (see the module docstring).

        server = GrpcServer(engine_or_loader, ServerSettings(port=0))
        port = await server.start()        # listening; health NOT_SERVING while loading
        await server.wait_ready()          # SERVING after the warm-up
        ...
        await server.shutdown(grace=10)    # drain, then stop
    """

    def __init__(self, model: ModelSource, settings: ServerSettings = ServerSettings()):
        self.settings = settings
        self.metrics = ServerMetrics()
        self._source = model
        self.state = LOADING
        self.port: int | None = None
        self.load_error: BaseException | None = None
        self._active: dict[str, _Stream] = {}
        self._server: grpc.aio.Server | None = None
        self._driver: EngineDriver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._failed: asyncio.Event | None = None
        self._stopped: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._shutdown_task: asyncio.Task | None = None
        self._started_wall = time.time()
        self._started = time.monotonic()
        self._last_receive = 0.0

    # -- properties
    @property
    def engine(self):
        return None if self._driver is None else self._driver.engine

    @property
    def driver(self) -> EngineDriver | None:
        return self._driver

    @property
    def active_requests(self) -> int:
        return len(self._active)

    def capacity(self) -> int:
        """Generate calls allowed in flight: the stream limit, or slots + queue if smaller."""
        engine = self.engine
        slots = engine.cache.layout.num_slots if engine is not None else 0
        return min(self.settings.max_concurrent_streams, slots + self.settings.max_queue)

    # -- lifecycle
    async def start(self) -> int:
        """Bind, start serving RPCs (health NOT_SERVING) and start loading; returns the port."""
        if self._server is not None:
            raise RuntimeError("the server is already started")
        self._loop = asyncio.get_running_loop()
        self._ready, self._failed, self._stopped = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        s = self.settings
        self._health = health_lib.aio.HealthServicer()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, NOT_SERVING)
        interceptors = []
        if s.auth_token:
            open_prefixes = () if s.auth_health else (f"/{HEALTH_SERVICE_NAME}/",)
            interceptors.append(BearerTokenInterceptor(s.auth_token, open_prefixes))
        options = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        # headroom above the stream limit so unary RPCs (health, abort, info) still get through
        server = grpc.aio.server(interceptors=interceptors, options=options,
                                 maximum_concurrent_rpcs=s.max_concurrent_streams + 64)
        server.add_generic_rpc_handlers((self._handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{s.host}:{s.port}" if ":" not in s.host else f"[{s.host}]:{s.port}"
        if s.tls_cert:
            check_tls_files(s.tls_cert, s.tls_key)  # grpc would only say "Failed to bind"
            with open(s.tls_key, "rb") as f:
                key = f.read()
            with open(s.tls_cert, "rb") as f:
                cert = f.read()
            port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind {address}")
        await server.start()
        self._server, self.port = server, port
        loop = self._loop
        self._driver = EngineDriver(
            self._source, metrics=self.metrics, warmup=s.warmup,
            on_ready=lambda: asyncio.run_coroutine_threadsafe(self._became_ready(), loop),
            on_failed=lambda e: asyncio.run_coroutine_threadsafe(self._engine_failed(e), loop))
        self._driver.start()
        exposed = s.exposure(port)
        if is_loopback(s.host) or (s.tls_cert and s.auth_token):
            log.info("gRPC server listening on %s", exposed)
        else:
            log.warning("gRPC server listening on %s", exposed)
        return port

    async def _became_ready(self) -> None:
        if self.state != LOADING:
            return
        self.state = READY
        for name in ("", SERVICE_NAME):
            await self._health.set(name, SERVING)
        self._ready.set()
        log.info("serving %s", self._driver.model.model_name)

    async def _engine_failed(self, error: BaseException) -> None:
        """Loading failed, or the engine broke: NOT_SERVING from now on (streams get UNAVAILABLE)."""
        self.load_error = error
        if self.state in (LOADING, READY):
            self.state = FAILED
            for name in ("", SERVICE_NAME):
                await self._health.set(name, NOT_SERVING)
        self._failed.set()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """True once SERVING; False if loading failed (or on timeout)."""
        waiters = [asyncio.ensure_future(self._ready.wait()), asyncio.ensure_future(self._failed.wait())]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        return self._ready.is_set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()

    async def shutdown(self, grace: float | None = None) -> None:
        """Drain (health NOT_SERVING, no new streams, `grace` seconds for the ones in flight),
        abort what is left, stop the transport and the engine thread. Safe to call twice."""
        if self._server is None:
            return
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(grace))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, grace: float | None) -> None:
        grace = self.settings.shutdown_grace_s if grace is None else grace
        self.state = DRAINING
        await self._health.enter_graceful_shutdown()
        log.info("draining: %d stream(s) in flight, grace %.1f s", len(self._active), grace)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace)
        except asyncio.TimeoutError:
            pass
        if self._active:
            log.info("aborting %d stream(s) still in flight", len(self._active))
            for rid in list(self._active):
                self._driver.abort(rid)
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=5.0)
            except asyncio.TimeoutError:
                log.warning("%d stream(s) did not end after the abort", len(self._active))
        await self._server.stop(grace=1.0)
        await asyncio.to_thread(self._driver.stop, 30.0)
        self.state = STOPPED
        self._stopped.set()
        log.info("gRPC server stopped")

    async def run_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on the engine thread between steps (consistent reads of the cache, ...)."""
        return await asyncio.wrap_future(self._driver.call(fn))

    def gauges(self) -> dict[str, float]:
        engine = self.engine
        if engine is None:
            return {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0.0}
        running = len(engine.scheduler.running)
        return {"vllm:num_requests_running": running,
                "vllm:num_requests_waiting": max(0, len(self._active) - running),
                "vllm:kv_cache_usage_perc": float(engine.cache.usage())}

    def engine_counters(self) -> dict:
        """The engine's own counters under vLLM's names (spec decode, prefix cache; empty with
        those off)."""
        return {} if self.engine is None else self.engine.counters()

    def metrics_registry(self):
        """A prometheus_client registry with this server's metrics (for `start_http_server`)."""
        return self.metrics.registry(self.gauges, self._model_name, self.engine_counters)

    def _model_name(self) -> str:
        model = self._driver.model if self._driver is not None else None
        return self.settings.served_model_name or (model.model_name if model else "deepinfer")

    # -- handler plumbing
    def _handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn, req, resp):
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=_tolerant(req.FromString),
                                                       response_serializer=resp.SerializeToString)

        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate, request_deserializer=_tolerant(pb.GenerateRequest.FromString),
                response_serializer=pb.GenerateResponse.SerializeToString),
            "Abort": unary(self.Abort, pb.AbortRequest, pb.AbortResponse),
            "HealthCheck": unary(self.HealthCheck, pb.HealthCheckRequest, pb.HealthCheckResponse),
            "GetModelInfo": unary(self.GetModelInfo, pb.GetModelInfoRequest, pb.GetModelInfoResponse),
            "GetServerInfo": unary(self.GetServerInfo, pb.GetServerInfoRequest, pb.GetServerInfoResponse),
            "Tokenize": unary(self.Tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
        })

    @staticmethod
    async def _check_parsed(request, context) -> None:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: cannot be parsed: {request.error}")

    async def _require_model(self, context) -> None:
        if self.state == LOADING:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is loading (health: NOT_SERVING)")
        if self.state == FAILED:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine failed: {self.load_error}")
        if self.state in (DRAINING, STOPPED):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")

    async def _prepare_prompt(self, kind, value, context, field_prefix: str = "") -> convert.PreparedPrompt:
        engine = self.engine
        kwargs = dict(field_prefix=field_prefix, tokenizer=engine.tokenizer, config=engine.config,
                      max_len=engine.cache.layout.max_len, max_token_bytes=self._driver.max_token_bytes)
        try:
            if kind in ("text", "chat"):  # tokenizing / rendering: keep it off the event loop
                return await asyncio.to_thread(convert.prompt_from_input, kind, value, **kwargs)
            return convert.prompt_from_input(kind, value, **kwargs)
        except convert.InvalidArgument as e:
            self.metrics.rejected()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _check_request_id(self, request_id: str, context) -> None:
        try:
            convert.check_request_id(request_id)
        except convert.InvalidArgument as e:
            self.metrics.rejected()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _check_capacity(self, context) -> None:
        limit = self.capacity()
        if len(self._active) >= limit:
            self.metrics.rejected()
            which = ("max_concurrent_streams" if limit == self.settings.max_concurrent_streams
                     else "max_queue (requests waiting for a cache slot)")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"server busy: {len(self._active)} requests in flight, limit {limit} ({which})")

    # -- RPCs
    async def Generate(self, request, context):
        await self._check_parsed(request, context)
        self._last_receive = time.time()
        await self._require_model(context)
        await self._check_capacity(context)
        engine = self.engine
        await self._check_request_id(request.request_id, context)
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        for name in ("token_ids_logprob", "lora_id"):
            if getattr(request, name):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: not supported")
        if request.return_hidden_states:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "return_hidden_states: not supported")
        try:
            params = convert.sampling_params_from_proto(
                request.sampling_params, request, vocab_size=engine.config.vocab_size,
                default_max_tokens=self.settings.default_max_tokens)
        except convert.InvalidArgument as e:
            self.metrics.rejected()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        kind = request.WhichOneof("input")
        prompt = await self._prepare_prompt(kind, getattr(request, kind) if kind else None, context)
        input_start = request.logprob_start_len if params.prompt_logprobs is not None else None
        if input_start is not None and input_start >= len(prompt.token_ids):
            self.metrics.rejected()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"logprob_start_len: must be less than the prompt's {len(prompt.token_ids)} tokens "
                                f"(or -1), got {input_start}")
        if prompt.chat is not None and params.structured_outputs is None and prompt.chat.output_constraint:
            # the answer follows the tools (DeepSeek's tool-call block) or the response format
            from deepinfer.serve.structured.tool_calls import chat_constraint

            try:
                constraint = chat_constraint(prompt.chat.output_constraint, model_type=engine.config.model_type,
                                             tokenizer=engine.tokenizer)
            except ValueError as e:
                self.metrics.rejected()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"chat.tools_json: {e}")
            params = dataclasses.replace(params, structured_outputs=constraint)
        # no await between these checks and the registration below
        await self._require_model(context)
        if rid in self._active:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already in flight")
        await self._check_capacity(context)
        sp = request.sampling_params
        stream = _Stream(rid=rid, prompt=prompt, params=params, want_stream=request.stream,
                         interval=sp.stream_interval if sp.HasField("stream_interval") else 1,
                         n_top=params.logprobs, loop=asyncio.get_running_loop(), queue=asyncio.Queue())
        self._active[rid] = stream
        self._idle.clear()
        self._driver.submit(stream)
        done = False
        try:
            while True:
                event = await stream.queue.get()
                kind_ = event[0]
                if kind_ == "chunk":
                    _, ids, text, lps, n, index = event
                    yield convert.chunk_message(rid, ids, text, prompt_tokens=len(prompt.token_ids),
                                                completion_tokens=n, logprobs=lps, n_top=stream.n_top, index=index)
                elif kind_ == "final":
                    done = True
                    _, output, rest = event
                    try:  # each sample's last chunk (streaming), then one GenerateComplete per sample
                        responses = [
                            convert.chunk_message(rid, ids, text, prompt_tokens=len(prompt.token_ids),
                                                  completion_tokens=len(output.outputs[index].token_ids),
                                                  logprobs=lps, n_top=stream.n_top, index=index)
                            for index, ids, text, lps in rest if stream.want_stream and (ids or text)]
                        responses += [convert.complete_message(output, eos_token_id=engine.config.eos_token_id,
                                                               n_top=stream.n_top, tokenizer=engine.tokenizer,
                                                               chat=prompt.chat, index=index, input_start=input_start,
                                                               input_top=params.prompt_logprobs or 0)
                                      for index in range(len(output.outputs))]
                    except Exception as e:  # noqa: BLE001 - reported in-band
                        log.exception("building the completion of %s failed", rid)
                        self.metrics.error()
                        yield pb.GenerateResponse(request_id=rid, error=pb.GenerateError(
                            message=f"building the completion failed: {type(e).__name__}: {e}",
                            http_status_code="500"))
                        return
                    for response in responses:
                        yield response
                    return
                elif kind_ == "rejected":
                    done = True
                    self.metrics.rejected()
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, event[1])
                else:  # "error"
                    done = True
                    yield pb.GenerateResponse(request_id=rid, error=pb.GenerateError(
                        message=event[1], http_status_code="500", details="the request was aborted"))
                    return
        finally:
            self._active.pop(rid, None)
            if not done:  # cancelled by the client (or the connection dropped): free the cache now
                self._driver.abort(rid)
            if not self._active:
                self._idle.set()

    async def Abort(self, request, context):
        await self._check_parsed(request, context)
        await self._check_request_id(request.request_id, context)
        if request.request_id not in self._active:
            return pb.AbortResponse(success=False, message=f"no request {request.request_id!r} in flight")
        self._driver.abort(request.request_id)
        return pb.AbortResponse(success=True, message="abort requested")

    async def HealthCheck(self, request, context):
        await self._check_parsed(request, context)
        healthy = self.state == READY
        message = {LOADING: "loading", READY: "serving", DRAINING: "draining", FAILED: f"failed: {self.load_error}",
                   STOPPED: "stopped"}[self.state]
        return pb.HealthCheckResponse(healthy=healthy, message=message)

    async def GetModelInfo(self, request, context):
        await self._check_parsed(request, context)
        if self.engine is None:
            await self._require_model(context)
        engine, model = self.engine, self._driver.model
        config = engine.config
        max_len = engine.cache.layout.max_len
        return pb.GetModelInfoResponse(
            model_path=model.model_path, tokenizer_path=model.tokenizer_path, is_generation=True,
            preferred_sampling_params="", weight_version="", served_model_name=self._model_name(),
            max_context_length=max_len, vocab_size=config.vocab_size, supports_vision=False,
            model_type=config.model_type, eos_token_ids=[config.eos_token_id],
            pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, max_req_input_len=max_len - 1)

    async def GetServerInfo(self, request, context):
        await self._check_parsed(request, context)
        from deepinfer import __version__

        engine, driver = self.engine, self._driver
        args: dict[str, Any] = {"server": self.settings.public_dict()}
        info: dict[str, Any] = {}
        running = waiting = free_pages = total_pages = free_slots = total_slots = 0
        if engine is not None:
            ec = engine.engine_config
            layout = engine.cache.layout
            args["engine"] = {"num_slots": layout.num_slots, "max_model_len": layout.max_len,
                              "page_size": layout.page_size, "num_pages": layout.num_pages,
                              "prefill_chunk": ec.prefill_chunk, "max_num_batched_tokens": ec.max_num_batched_tokens,
                              "prefill_mode": ec.prefill_mode, "keep_tokens": ec.keep_tokens, "seed": ec.seed,
                              "async_scheduling": engine.async_scheduling, "deterministic": ec.deterministic,
                              "prefix_caching": None if ec.prefix_cache is None else ec.prefix_cache.replay,
                              "speculative_config": (None if ec.speculative is None else
                                                     dataclasses.asdict(ec.speculative)),
                              "model_name": self._model_name(), "dtype": str(engine.config.dtype),
                              "fake_quant": bool(engine.config.fake_quant)}
            running = len(engine.scheduler.running)
            waiting = max(0, len(self._active) - running)
            free_pages, total_pages = engine.cache.pages.free, layout.num_pages
            free_slots, total_slots = engine.cache.free_slots, layout.num_slots
            info["warmup_seconds"] = self._driver.warmup_seconds
            info["step_failures"] = self._driver.step_failures
            info["num_preemptions"] = engine.scheduler.num_preemptions
        info["metrics"] = self.metrics.snapshot(self.gauges())
        response = pb.GetServerInfoResponse(
            server_args=_struct(args), scheduler_info=_struct(info), active_requests=len(self._active),
            is_paused=self.state != READY, last_receive_timestamp=self._last_receive,
            uptime_seconds=time.monotonic() - self._started, version=__version__, server_type="grpc",
            running_requests=running, waiting_requests=waiting, free_pages=free_pages, total_pages=total_pages,
            free_slots=free_slots, total_slots=total_slots, serving_status=self.state,
            warmup_complete=driver is not None and driver.warmup_seconds is not None,
            warmup_shapes_done=driver.warmup_done if driver else 0,
            warmup_shapes_total=driver.warmup_total if driver else 0)
        response.start_time.FromSeconds(int(self._started_wall))
        return response

    async def Tokenize(self, request, context):
        await self._check_parsed(request, context)
        if self.engine is None:
            await self._require_model(context)
        kind = request.WhichOneof("input")
        prompt = await self._prepare_prompt(kind, getattr(request, kind) if kind else None, context)
        return pb.TokenizeResponse(input_ids=prompt.token_ids, count=len(prompt.token_ids),
                                   prompt=prompt.text or "", max_context_length=self.engine.cache.layout.max_len)


# ---- a server on its own event loop --------------------------------------------------------------


class ServerThread:
    """A `GrpcServer` on its own event loop in a daemon thread: for tests, notebooks and programs
    that are not asyncio themselves.

        with ServerThread(engine, ServerSettings(port=0)) as srv:
            srv.wait_ready(120)
            channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    """

    def __init__(self, model: ModelSource, settings: ServerSettings = ServerSettings()):
        self.server = GrpcServer(model, settings)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="deepinfer-grpc", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def port(self) -> int | None:
        return self.server.port

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._amain())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _amain(self) -> None:
        try:
            await self.server.start()
        except BaseException as e:  # noqa: BLE001 - re-raised by start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        await self.server.wait_for_termination()

    def start(self, timeout: float = 60.0) -> int:
        """Start listening (the model loads in the background); returns the port."""
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError("the gRPC server did not start")
        if self._error is not None:
            raise self._error
        return self.port

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.run(self.server.wait_ready(timeout))

    def in_engine(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        """`fn(engine)` on the engine thread between steps."""
        return self.server.driver.call(fn).result(timeout)

    def shutdown(self, grace: float | None = None, timeout: float | None = 120.0) -> None:
        if self._loop is None or not self._thread.is_alive():
            return
        self.run(self.server.shutdown(grace), timeout)
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown(grace=0)

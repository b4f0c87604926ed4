"""Bearer-token authentication for every RPC, as a `grpc.aio` server interceptor."""

from __future__ import annotations

import hmac

import grpc

def _deny_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only fails with `code`."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    async def unary(request_or_iterator, context):
        await context.abort(code, details)

    async def streaming(request_or_iterator, context):
        await context.abort(code, details)
        yield  # pragma: no cover - makes this an async generator

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Require `authorization: Bearer <token>` on every RPC except the `open_prefixes` methods."""

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = ()):
        if not token:
            raise ValueError("token: must not be empty")
        self._expected = token.encode()
        self._open = open_prefixes

    def _authorized(self, metadata) -> bool:
        """`authorization: <scheme> <token>`, the scheme `Bearer` in any case (RFC 7235 §2.1)."""
        for key, value in metadata or ():
            if key.lower() == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                scheme, _, token = given.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.lstrip(b" "), self._expected)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        missing = not any(k.lower() == "authorization" for k, _ in handler_call_details.invocation_metadata or ())
        return _deny_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                             "missing bearer token (authorization metadata)" if missing else "invalid bearer token")

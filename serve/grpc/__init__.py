"""gRPC serving: the `deepinfer.engine.v1.LlmEngine` service around one engine.

* `deepinfer_engine.proto` and its committed stubs (`deepinfer_engine_pb2*.py`, regenerate with
  `serve/grpc/regenerate.sh`);
* `server`: `GrpcServer` (asyncio), `ServerThread` (the same on a background event loop),
  `ServerSettings`;
* `convert`: request validation and message building;
* `tls`: the TLS files and the bind address checked before the server binds;
* `cli`: `add_serve_parser` / `run_serve` behind `deepinfer serve`.

Import the submodules directly; this package imports nothing heavy.
"""

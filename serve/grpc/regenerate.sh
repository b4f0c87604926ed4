#!/usr/bin/env bash
# Regenerate the committed Python stubs of deepinfer_engine.proto (run from anywhere):
#
#     serve/grpc/regenerate.sh            # uses .venv/bin/python of the repository, else python3
#     PYTHON=/path/to/python serve/grpc/regenerate.sh
#
# The proto is compiled under the path deepinfer/serve/grpc/ (a staging copy), so the generated
# *_pb2_grpc.py imports `from deepinfer.serve.grpc import deepinfer_engine_pb2` and the descriptor
# is registered as deepinfer/serve/grpc/deepinfer_engine.proto; no import needs patching afterwards.
# Needs grpcio-tools (the committed stubs were made with grpcio-tools 1.85.1 / protobuf 7.35.1; the
# test that checks them ignores these version stamps: a newer patch release of the tools needs no
# regeneration).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python=python3
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/deepinfer/serve/grpc"
cp "$here/deepinfer_engine.proto" "$stage/deepinfer/serve/grpc/"
(cd "$stage" && "$python" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
    deepinfer/serve/grpc/deepinfer_engine.proto)
cp "$stage"/deepinfer/serve/grpc/deepinfer_engine_pb2.py \
   "$stage"/deepinfer/serve/grpc/deepinfer_engine_pb2.pyi \
   "$stage"/deepinfer/serve/grpc/deepinfer_engine_pb2_grpc.py "$here/"
echo "regenerated $here/deepinfer_engine_pb2{.py,.pyi,_grpc.py}"

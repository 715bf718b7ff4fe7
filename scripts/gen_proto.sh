#!/usr/bin/env bash
# Regenerate the gRPC/protobuf modules: the cache protocol (beside the client that speaks it)
# and the copy protocol (beside the copy daemon).
# Run from anywhere; the command runs from the repository root so the generated imports are
# package-absolute (pyspark_acs.cache.proto.acs_pb2). Uses $PYTHON, else the repo's .venv, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
for proto in pyspark_acs/cache/proto/acs.proto pyspark_acs/server/copy/proto/copy.proto; do
  "$PYTHON" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. "$proto"
done

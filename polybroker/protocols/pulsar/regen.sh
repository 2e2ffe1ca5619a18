#!/bin/sh
# Regenerate PulsarApi_pb2.py from PulsarApi.proto (dev tool: pip install grpcio-tools).
# The generated module is committed; the runtime needs only the protobuf package.
set -e
cd "$(dirname "$0")"
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. PulsarApi.proto

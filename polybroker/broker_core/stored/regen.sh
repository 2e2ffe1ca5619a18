#!/bin/sh
# Regenerate stored_message_pb2.py(i) from stored_message.proto (dev tool: pip install
# grpcio-tools; never a runtime dependency). The generated modules are committed.
set -e
cd "$(dirname "$0")"
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. stored_message.proto

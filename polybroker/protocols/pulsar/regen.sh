#!/bin/sh
# Regenerate PulsarApi_pb2.py(i) from PulsarApi.proto (dev tool: pip install grpcio-tools;
# never a runtime dependency). The generated modules are committed; the runtime needs only
# the protobuf package. The stub drops the enum value Schema.Type.None, which is a Python
# keyword (code reaches it as pb.Schema.Type.Value("None")).
set -e
cd "$(dirname "$0")"
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. PulsarApi.proto
sed -i '/^ *None: /d' PulsarApi_pb2.pyi

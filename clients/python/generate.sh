#!/usr/bin/env bash
# Regenerates the framework API's Python stubs in gpuctl_framework/ from the
# protos in proto/proto (run it after changing scheduler.proto or
# common.proto, and commit the result):
#
#   common_pb2.py, scheduler_pb2.py   messages, by `protoc` (Debian 12's
#                                     protobuf-compiler, libprotoc 3.21.12)
#   scheduler_pb2_grpc.py             the Scheduler service's client and
#                                     server classes, by `python3 -m
#                                     grpc_tools.protoc` (Debian 12's
#                                     python3-grpc-tools, grpcio-tools 1.14.1)
#
# Needs: apt-get install -y protobuf-compiler python3-grpc-tools
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
protos="$(cd "$here/../../proto/proto" && pwd)"
out="$here/gpuctl_framework"
files=(gpuctl/v1/common.proto gpuctl/v1/scheduler.proto)

# grpc_tools lives in the system Python's dist-packages; a python3 earlier
# on PATH (pyenv, a virtualenv) may not see it.
python=""
for p in ${PYTHON:-} python3 /usr/bin/python3; do
    if "$p" -c 'import grpc_tools.protoc' 2>/dev/null; then
        python="$p"
        break
    fi
done
if [ -z "$python" ]; then
    echo "generate.sh: no python3 with grpc_tools (apt-get install python3-grpc-tools)" >&2
    exit 1
fi
command -v protoc >/dev/null || {
    echo "generate.sh: protoc not found (apt-get install protobuf-compiler)" >&2
    exit 1
}

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/out" "$tmp/stripped/gpuctl/v1"

# Messages: protoc 3.21 knows proto3 `optional` fields (explicit presence).
protoc -I "$protos" --python_out="$tmp/out" "${files[@]}"

# Service stubs: grpc_tools 1.14 bundles protoc 3.5, which refuses proto3
# `optional` (added in 3.15). The gRPC stub only names the service, its
# methods and their message classes, none of which the keyword changes, so
# it is generated from a copy of the protos without it.
for f in "${files[@]}"; do
    sed -E 's/^([[:space:]]*)optional[[:space:]]+/\1/' "$protos/$f" >"$tmp/stripped/$f"
done
"$python" -m grpc_tools.protoc -I "$tmp/stripped" --grpc_python_out="$tmp/out" \
    gpuctl/v1/scheduler.proto

# Flat, package-relative modules: `import gpuctl_framework` works with
# clients/python on sys.path, and nothing named `gpuctl` is needed.
for f in common_pb2.py scheduler_pb2.py scheduler_pb2_grpc.py; do
    sed -E 's/^from gpuctl\.v1 import /from . import /' "$tmp/out/gpuctl/v1/$f" >"$out/$f"
done
if grep -n '^from gpuctl\|^import gpuctl' "$out"/*_pb2*.py; then
    echo "generate.sh: absolute gpuctl imports left in the stubs" >&2
    exit 1
fi
echo "generated in $out: common_pb2.py scheduler_pb2.py scheduler_pb2_grpc.py"

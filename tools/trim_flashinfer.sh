#!/usr/bin/env bash
# Make a flashinfer release small enough to carry to a lent GPU machine (the device tool carries at most
# 64 MiB per call, repository included). flashinfer 0.7.4's wheel is 101 MB; most of it is kernel sources
# and prebuilt programs of features the probes never touch (cake_* kernels, experimental/, alphamoe).
# Removed: data/csrc/cake_* and data/csrc/*alphamoe*, and every non-Python file under experimental/ and
# the cake_*_backend/ packages (their .py files stay, because flashinfer.moe_ep imports some of them at
# import time). Everything else stays, the .dist-info included (the probes read the version from it).
# The result imports, and JIT-builds trtllm_comm, vllm_comm and pcie_ipc.
#
# Output: .whl/flashinfer_python-VERSION-trimmed.tgz (a site-packages tree) and the apache-tvm-ffi
# wheel beside it. On the device:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && tar xzf .whl/flashinfer_python-*-trimmed.tgz -C /tmp/site && export PYTHONPATH=/tmp/site
# Usage: tools/trim_flashinfer.sh [VERSION=0.7.4]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-0.7.4}"
TVM_FFI="${TVM_FFI:-0.1.15.post2}"
DL=".cache/wheels"
mkdir -p "$DL" .whl
wheel="$DL/flashinfer_python-${VERSION}-py3-none-any.whl"
[ -f "$wheel" ] || python3 -m pip download -q --no-deps --only-binary=:all: -d "$DL" "flashinfer-python==${VERSION}"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "apache-tvm-ffi==${TVM_FFI}"
rm -f .whl/flashinfer_python-*.whl  # a full wheel beside the tree would be installed over it
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m zipfile -e "$wheel" "$work"
fi="$work/flashinfer"
rm -rf "$fi"/data/csrc/cake_* "$fi"/data/csrc/*alphamoe*
for d in "$fi"/experimental "$fi"/cake_*_backend; do
    [ -d "$d" ] && find "$d" -type f ! -name '*.py' -delete
done
out=".whl/flashinfer_python-${VERSION}-trimmed.tgz"
tar czf "$out" -C "$work" flashinfer "flashinfer_python-${VERSION}.dist-info"
du -sh "$out" .whl

#!/usr/bin/env bash
# Fetch the wheels the lent H200 machines lack for the flashinfer probes into .whl/ (gitignored).
# That image already holds torch 2.11.0+cu130, numpy, nvidia-ml-py, requests, tqdm, packaging, einops,
# tabulate, ninja and cuda-bindings, so flashinfer needs only itself and apache-tvm-ffi to import and JIT
# its comm modules (about 21 MiB; the device tool carries at most 64 MiB per call, repo included).
# On the device: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#   --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHINFER="${FLASHINFER:-0.6.18}"
TVM_FFI="${TVM_FFI:-0.1.15.post2}"
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "flashinfer-python==${FLASHINFER}" "apache-tvm-ffi==${TVM_FFI}"
du -sh .whl

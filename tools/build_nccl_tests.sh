#!/usr/bin/env bash
# Build nccl-tests' all_reduce_perf for one GPU architecture on this (GPU-less) machine, against the NCCL
# that torch 2.11.0 ships (nvidia-nccl-cu13 2.28.9 from the registry), into .whl/bin/ (gitignored). It is
# the independent measurement for benchmarks/bench_latency_crosscheck.py on a device machine, which has no
# network to fetch or build it. nccl-tests' source is not on the package registry: pass a checkout.
# Usage: tools/build_nccl_tests.sh NCCL_TESTS_SRC [SM=90]
# On the device the binary needs torch's NCCL and CUDA runtime on LD_LIBRARY_PATH; the benchmark sets it.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="$(realpath "${1:?usage: tools/build_nccl_tests.sh NCCL_TESTS_SRC [SM=90]}")"
SM="${2:-90}"
NCCL="${NCCL:-2.28.9}"
[ -f "$SRC/src/all_reduce.cu" ] || { echo "build_nccl_tests: $SRC is not an nccl-tests checkout (no src/all_reduce.cu)" >&2; exit 2; }
DEPS=".cache/nccl-${NCCL}"
if [ ! -e "$DEPS/.ready" ]; then
    rm -rf "$DEPS"
    uv pip install -q --no-deps --target "$DEPS" "nvidia-nccl-cu13==${NCCL}"
    touch "$DEPS/.ready"
fi
HOME_DIR="$(mktemp -d)"; BUILD="$(mktemp -d)"
trap 'rm -rf "$HOME_DIR" "$BUILD"' EXIT
mkdir -p "$HOME_DIR/lib"
ln -s "$PWD/$DEPS/nvidia/nccl/include" "$HOME_DIR/include"
ln -s "$PWD/$DEPS/nvidia/nccl/lib/libnccl.so.2" "$HOME_DIR/lib/libnccl.so"
make -s -C "$SRC/src" -j"$(nproc)" NCCL_HOME="$HOME_DIR" CUDA_HOME=/usr/local/cuda BUILDDIR="$BUILD" \
    NVCC_GENCODE="-gencode=arch=compute_${SM},code=sm_${SM}" "$BUILD/all_reduce_perf"
mkdir -p .whl/bin
cp "$BUILD/all_reduce_perf" .whl/bin/
echo "all_reduce_perf (sm_${SM}, NCCL ${NCCL} headers) -> .whl/bin/all_reduce_perf ($(git -C "$SRC" log -1 --format=%h 2>/dev/null || echo unknown))"

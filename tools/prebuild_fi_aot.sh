#!/usr/bin/env bash
# Compile flashinfer's comm modules for one GPU architecture on this (GPU-less) machine and leave them in
# .whl/aot/ (gitignored), for the device runs of the local backend (tools/device_run_all.sh,
# device_run_flashinfer.sh): their environment is the machine's own Python, which `provision build` does not
# make, so no cell carries kernels there (a venv or Docker cell does: provision build compiles them). So a
# device run spends no device time in ptxas: trtllm_comm takes about 12 min
# per architecture on 2 cores. The final link needs a libcuda.so, which this toolkit lacks; an empty
# library with the driver's soname is enough for a shared object (the real driver resolves the symbols
# at load time). On the device, after installing the wheels into /tmp/site:
#   for so in .whl/aot/*.so; do n=$(basename "$so" .so); mkdir -p /tmp/site/flashinfer/data/aot/$n; \
#     cp "$so" /tmp/site/flashinfer/data/aot/$n/; done
# flashinfer then loads them as AOT artifacts instead of JIT-compiling. fi-jit ignores them (it always
# compiles), so restrict it on the device with STACKPROBE_FI_JIT_ONLY if device time is short.
# Usage: tools/prebuild_fi_aot.sh [ARCH=9.0a] [MODULE...]   (default: vllm_comm moe_a2a trtllm_comm)
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH="${1:-9.0a}"; shift || true
MODULES=("${@:-vllm_comm moe_a2a trtllm_comm}")
FLASHINFER="${FLASHINFER:-0.6.18}"
VENV=".cache/fi-venv-${FLASHINFER}"
if [ ! -x "$VENV/bin/python" ]; then
    uv venv -q "$VENV" --python 3.11
    VIRTUAL_ENV="$VENV" uv pip install -q torch==2.11.0 numpy nvidia-ml-py tqdm requests packaging ninja
    VIRTUAL_ENV="$VENV" uv pip install -q --no-deps "flashinfer-python==${FLASHINFER}" apache-tvm-ffi==0.1.15.post2
    echo ok > "$VENV/.ready"
fi
STUB="$(mktemp -d)"
trap 'rm -rf "$STUB"' EXIT
# The stub must export the driver functions the module calls: an empty one lets the linker drop the
# libcuda.so.1 dependency (--as-needed), and the module then fails to load on the GPU host with
# "undefined symbol: cuPointerGetAttribute" (seen on the 2x H200 run).
python3 -m provision.cudahome stub-source /usr/local/cuda/include/cuda.h \
    | gcc -shared -x c - -o "$STUB/libcuda.so" -Wl,-soname,libcuda.so.1
# moe_a2a includes cublasLt.h; an nvcc-only toolkit lacks it. Borrow just the cuBLAS headers from the
# venv's nvidia-cublas wheel (not its cuda_runtime headers, which must stay the toolkit's own).
EXTRA=()
if [ ! -e /usr/local/cuda/include/cublasLt.h ]; then
    inc=$(ls -d "$VENV"/lib/python3*/site-packages/nvidia/cu13/include 2>/dev/null | head -1)
    if [ -n "$inc" ]; then
        mkdir -p "$STUB/include"
        for h in "$inc"/cublas*.h "$inc"/curand*.h; do ln -s "$PWD/$h" "$STUB/include/"; done  # 0.7 moe_a2a: curand
        EXTRA=(NVCC_APPEND_FLAGS="-I$STUB/include" CPATH="$STUB/include")
    fi
fi
CACHE=".cache/fi-aot-${FLASHINFER}"
mkdir -p .whl/aot
# Relink from the cached objects every time: ninja does not see a changed stub, and a module linked
# against an older stub would keep its missing libcuda.so.1 dependency.
find "$CACHE" -path '*/cached_ops/*' -name '*.so' -delete 2>/dev/null || true
for m in ${MODULES[@]}; do
    out=$(env -u VIRTUAL_ENV PATH="$PWD/$VENV/bin:/usr/local/cuda/bin:$PATH" PYTHONPATH="$PWD" CUDA_HOME=/usr/local/cuda \
        FLASHINFER_CUDA_ARCH_LIST="$ARCH" FLASHINFER_WORKSPACE_BASE="$PWD/$CACHE" LIBRARY_PATH="$STUB" "${EXTRA[@]}" \
        "$VENV/bin/python" -m inenv.kit._fi_build "$m" | grep '^@@FI-JIT@@' | cut -c11-)
    lib=$(echo "$out" | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r.get("library","") if r["ok"] else "")')
    [ -n "$lib" ] || { echo "$m: build failed: $out" >&2; exit 1; }
    cp "$lib" .whl/aot/
    echo "$m -> .whl/aot/$(basename "$lib")"
done
du -sh .whl/aot

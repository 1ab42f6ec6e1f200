#!/usr/bin/env bash
# The environment a user serves from, probed on a lent GPU machine (benchmarks/bench_gpu_host.py --case local):
# the machine's python (torch 2.11.0+cu130) with flashinfer installed into it from the carried wheels, nothing
# carried for it, `checks run --backend local --python` from the checkout; then the quick level warm and cold
# (--cold-ranks) and alone (--gpu-alone) for the A/B of warm ranks and the shared GPU lock (COLD=1). PREFILL (default vllm_comm): comm modules the environment's own
# flashinfer JIT cache is filled with first, as an engine's first use would (fi-jit then loads them, not compiles).
# Here first (CPU machine): tools/fetch_overlay_wheels.sh VERSION (flashinfer-python and its apache-tvm-ffi).
# Device call: run(carry=[".whl/overlay"], command="bash tools/device_run_local.sh 480")
# Back in $OUT: gpu-host-local.json and .log, and res-local.tgz (the run's results, for results/).
set -u
cd "$(dirname "$0")/.."
LIMIT="${1:-480}"
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 UV_OFFLINE=1
. tools/device_env.sh
fi_jit_only
W="$(mktemp -d)"
nvidia-smi -L
python3 benchmarks/bench_gpu_host.py --matrix matrix.yaml --only '*' --case local --wheels .whl/overlay \
    --base-python "$(command -v python3)" --limit "$LIMIT" --out "$W" ${COLD:+--cold} --prefill "${PREFILL-vllm_comm}" | tail -30
cp "$W"/gpu-host-local.json "$W"/gpu-host-local.log "$OUT"/ 2>/dev/null
[ -d "$W/res-local" ] && tar -C "$W" -czf "$OUT/res-local.tgz" res-local
grep -E "^ +(partial|fail|crash|hang) " "$W/gpu-host-local.log" | head -60
sed -n '/^summary/,$p' "$W/gpu-host-local.log" | head -60

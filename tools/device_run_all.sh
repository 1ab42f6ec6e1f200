#!/usr/bin/env bash
# One device call: the latency cross-check, then the whole suite on a lent GPU machine with its own Python
# (local executor). Carry .whl: tools/fetch_gpu_wheels.sh (flashinfer), tools/prebuild_fi_aot.sh 9.0a (comm
# modules, so no device time goes to ptxas) and tools/build_nccl_tests.sh (all_reduce_perf). Results land
# under $OUT/res, ready to copy into results/. RESUME=DIR continues an interrupted run kept in DIR.
# Usage (from the run tool): bash tools/device_run_all.sh [SUITE_SECONDS=400]
set -u
cd "$(dirname "$0")/.."
SUITE_S="${1:-400}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
for so in .whl/aot/*.so; do n=$(basename "$so" .so); mkdir -p /tmp/site/flashinfer/data/aot/$n; cp "$so" /tmp/site/flashinfer/data/aot/$n/; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 STACKPROBE_JIT_CACHE=/tmp/jit FLASHINFER_WORKSPACE_BASE=/tmp/jit
. tools/device_env.sh
export STACKPROBE_FI_JIT_ONLY=vllm_comm@local
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
if [ "$(nvidia-smi -L | grep -c '^GPU ')" -ge 2 ]; then
    timeout 120 python3 benchmarks/bench_latency_crosscheck.py --json "$OUT/xcheck.json" > "$OUT/xcheck.txt" 2>&1
    echo "xcheck rc=$?"; tail -16 "$OUT/xcheck.txt"
fi
RES="$OUT/res"; EXTRA=()
if [ -n "${RESUME:-}" ]; then cp -r "$RESUME" "$RES"; EXTRA=(--resume); fi
timeout -s INT "$SUITE_S" python3 -m checks.cli run --all --backend local --python python3 --timeout-scale 0.25 \
    --results "$RES" "${EXTRA[@]}" > "$OUT/run.log" 2>&1
echo "run rc=$?"
grep -E "^ +(pass|partial|fail|crash|hang)" -A1 "$OUT/run.log" | head -80

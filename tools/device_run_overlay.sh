#!/usr/bin/env bash
# The first runtime matrix on a lent GPU machine (no Docker, no index): each flashinfer release of
# matrices/h200-overlay.yaml as an overlay venv cell on the machine's own Python (torch 2.11.0+cu130, its CUDA
# libraries and NCCL as installed), then the whole suite in every cell, one cell after another.
# Here first: tools/fetch_overlay_wheels.sh 0.6.8.post1 0.6.17 0.6.18 (or 0.7.4: 64 MiB per call, so two calls).
# Device call: run(kind=nvidia-h200-x2, carry=[".whl/overlay"],
#                  command="bash tools/device_run_overlay.sh 'cu130-*-fi0.6.*' 480")
# Kernels: `provision build` here with this matrix first makes each cell's kernel set in .cache/kernels/<cell>/
# (the matrix's kernel_archs); carried too (carry=[".cache/kernels"], in a call of its own when the wheels fill
# 64 MiB), `provision build` there installs it and compiles nothing. Without it the cells compile on the device.
# Results: $OUT/res/<host>/<run>.jsonl and .manifest.json (copy into results/), $OUT/build.txt (the build and
# each cell's build.json), $OUT/run.log. FI_JIT_ONLY narrows fi-jit (default: every comm module for the local
# GPU: its cross-compile targets are the CPU machine's work, and a carried module answers the local target);
# PROBES="ID ..." runs only those probes; RESUME=DIR continues an interrupted run kept in DIR; KERNEL_ARCHS=none
# builds no kernel set (fi-jit then compiles the modules for the local GPU while the other probes run).
set -u
cd "$(dirname "$0")/.."
ONLY="${1:-*}"
SUITE_S="${2:-560}"
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
M=matrices/h200-overlay.yaml
export PYTHONUNBUFFERED=1 STACKPROBE_JIT_CACHE=/tmp/jit FLASHINFER_WORKSPACE_BASE=/tmp/jit UV_OFFLINE=1
. tools/device_env.sh
export STACKPROBE_FI_JIT_ONLY="${FI_JIT_ONLY-$LOCAL_COMM_PAIRS}"
T0=$(date +%s)
python3 -m provision.cli build --backend venv --base-python python3 --wheels .whl/overlay --matrix "$M" \
    --only "$ONLY" --no-reach-check ${KERNEL_ARCHS:+--kernel-archs "$KERNEL_ARCHS"} > "$OUT/build.txt" 2>&1
echo "build rc=$? in $(( $(date +%s) - T0 ))s"
for f in envs/cu130-torch2.11.0-sglnone-*/build.json; do
    [ -f "$f" ] && { echo "== $f"; cat "$f"; } >> "$OUT/build.txt"
done
grep -E "│ cu130" "$OUT/build.txt" | cut -c1-220
RES="$OUT/res"; EXTRA=()
# PROBES="ep-a2a pcie-ipc" narrows the suite (default: every probe).
if [ -n "${PROBES:-}" ]; then for p in $PROBES; do EXTRA+=(--probe "$p"); done; else EXTRA+=(--all); fi
if [ -n "${RESUME:-}" ]; then cp -r "$RESUME" "$RES"; EXTRA+=(--resume); fi
timeout -s INT "$SUITE_S" python3 -m checks.cli run --backend venv --matrix "$M" --only "$ONLY" \
    --timeout-scale 0.25 --results "$RES" "${EXTRA[@]}" > "$OUT/run.log" 2>&1
echo "run rc=$? in $(( $(date +%s) - T0 ))s"
grep -E "^ *(pass|partial|fail|crash|hang|skip|not-run) " "$OUT/run.log" | head -120
# Each cell's suite time, probe by probe (the sum of its variants' seconds; the target is 90 s a cell).
for f in "$RES"/*/*.jsonl; do [ -f "$f" ] && python3 benchmarks/bench_checks_run.py --summarize "$f"; done

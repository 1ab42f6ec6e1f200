#!/usr/bin/env bash
# The flashinfer 0.7 probes on a lent GPU machine, one command: pcie-ipc (all ops; shared-GPU variants where
# the host has fewer GPUs than ranks), ep-a2a on flashinfer.moe_ep (simulated and real ranks), custom-ar with
# ranks sharing GPUs, and ar-latency's flashinfer-pcie-ipc backend. Results and logs land under $OUT.
# Carry .whl: tools/trim_flashinfer.sh 0.7.4 (flashinfer tree + apache-tvm-ffi wheel) and, optionally,
# prebuilt sm_90a modules in .whl/aot/NAME.so, which flashinfer loads as AOT artifacts instead of compiling.
# Device call: run(kind=nvidia-h200-x2, carry=[".whl"], command="bash tools/device_run_fi07.sh [SECONDS]").
set -u
cd "$(dirname "$0")/.."
BUDGET="${1:-200}"
T0=$(date +%s)
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
R=$OUT/results.jsonl; L=$OUT/log.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
tar xzf .whl/flashinfer_python-*-trimmed.tgz -C /tmp/site
for so in .whl/aot/*.so; do [ -e "$so" ] || continue; n=$(basename "$so" .so); mkdir -p "/tmp/site/flashinfer/data/aot/$n"; cp "$so" "/tmp/site/flashinfer/data/aot/$n/"; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 STACKPROBE_JIT_CACHE=/tmp/jit FLASHINFER_WORKSPACE_BASE=/tmp/jit
. tools/device_env.sh
GPUS=$(nvidia-smi -L | grep -c '^GPU ')
{ nvidia-smi topo -m; echo "gpus=$GPUS install=$(( $(date +%s) - T0 ))s"; ls /tmp/site/flashinfer/data/aot; } >> "$L" 2>&1
w() { # probe variant-json timeout: one worker run, its result line appended to results.jsonl
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  [ "$left" -gt 20 ] || { echo "budget spent: $1 $2 not run" | tee -a "$L"; return; }
  local t=$(( $3 < left ? $3 : left ))
  echo "=== $(( $(date +%s) - T0 ))s $1 $2" >> "$L"
  local line
  line=$(timeout "$t" python3 -m inenv.worker --probe "$1" --variant "$2" --gpus "$GPUS" --timeout $(( t - 5 )) 2>>"$L" \
      | grep '^@@STACKPROBE-RESULT@@')
  printf '%s\n' "${line#@@STACKPROBE-RESULT@@}" >> "$R"
  echo "$(( $(date +%s) - T0 ))s $1 $2 -> ${line:21:220}"
}
P='{"probe_id":"pcie-ipc","ranks":'
w pcie-ipc "$P"'2,"params":[["op","all-reduce"]]}' 120
w ep-a2a '{"probe_id":"ep-a2a","ranks":1,"params":[["mode","sim"],["ep","2"]]}' 60
w ep-a2a '{"probe_id":"ep-a2a","ranks":2,"params":[["mode","gpus"]]}' 60
w pcie-ipc "$P"'4,"params":[["op","all-reduce"]],"share_gpu":true}' 60
w pcie-ipc "$P"'2,"params":[["op","all-gather"]]}' 45
w pcie-ipc "$P"'2,"params":[["op","reduce-scatter"]]}' 45
w ar-latency '{"probe_id":"ar-latency","ranks":2,"params":[["backend","flashinfer-pcie-ipc"]]}' 60
w custom-ar '{"probe_id":"custom-ar","ranks":4,"params":[["impl","flashinfer"],["full_nvlink","forced"]],"share_gpu":true}' 60
w pcie-ipc "$P"'8,"params":[["op","all-reduce"]],"share_gpu":true}' 60
w ep-a2a '{"probe_id":"ep-a2a","ranks":1,"params":[["mode","sim"],["ep","8"]]}' 45
echo "total $(( $(date +%s) - T0 ))s" | tee -a "$L"

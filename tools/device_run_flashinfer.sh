#!/usr/bin/env bash
# Debug run of the flashinfer-side probes on a lent GPU machine, one command, results under $OUT.
# Needs .whl/ (tools/fetch_gpu_wheels.sh) and optionally .whl/aot/ (tools/prebuild_fi_aot.sh 9.0a) carried.
# Device call: run(kind=nvidia-h200-x2, carry=[".whl"], command="bash tools/device_run_flashinfer.sh").
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 STACKPROBE_JIT_CACHE=/tmp/jitcache
. tools/device_env.sh
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
R=$OUT/results.jsonl; L=$OUT/log.txt
nvidia-smi topo -m >> $L 2>&1; nproc >> $L
w() { # probe variant-json timeout
  echo "=== $(( $(date +%s) - T0 ))s $1 $2" >> $L
  local line
  line=$(timeout "$3" python3 -m inenv.worker --probe "$1" --variant "$2" --timeout $(( $3 - 10 )) 2>>$L | grep '^@@STACKPROBE-RESULT@@')
  printf '%s\t%s\t%s\n' "$1" "$2" "${line#@@STACKPROBE-RESULT@@}" >> $R
  echo "$1 $2 -> ${line:21:160}"
}
# Prebuilt sm_90a comm modules (compiled on the dev box with nvcc 13.0) load as flashinfer AOT artifacts,
# so the functional probes do not spend minutes of device time in ptxas; fi-jit below still JITs locally.
for so in .whl/aot/*.so; do [ -e "$so" ] || continue; n=$(basename $so .so); mkdir -p /tmp/site/flashinfer/data/aot/$n; cp $so /tmp/site/flashinfer/data/aot/$n/; done
ls /tmp/site/flashinfer/data/aot >> $L
w fi-jit '{"probe_id":"fi-jit","ranks":1,"params":[["module","vllm_comm"],["arch","local"]]}' 120 &
w inventory '{"probe_id":"inventory","ranks":1}' 120
wait
E='{"probe_id":"ep-a2a","ranks":1,"params":[["mode","sim"],["ep",'
for ep in 2 4 8; do w ep-a2a "$E\"$ep\"]]}" 120; done
w custom-ar '{"probe_id":"custom-ar","ranks":2,"params":[["impl","flashinfer"],["full_nvlink","topology"]]}' 150
w fi-fusion '{"probe_id":"fi-fusion","ranks":2}' 150
w fi-fusion '{"probe_id":"fi-fusion","ranks":2,"params":[["placement","1gpu"]],"share_gpu":true}' 150
w ep-a2a '{"probe_id":"ep-a2a","ranks":2,"params":[["mode","gpus"]]}' 120
echo "total $(( $(date +%s) - T0 ))s" >> $L

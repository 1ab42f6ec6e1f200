#!/usr/bin/env bash
# A cell built on another machine, probed on a lent GPU machine: how soon its first table comes, how long its
# whole suite takes, and how many compiler processes this host started (benchmarks/bench_gpu_host.py --case
# carried). The whole suite includes every shareable multi-rank backend at 2, 3, 4 and 8 ranks on one GPU
# (placement=shared) with its rank-agreement fields.
# Here first (CPU machine): tools/fetch_overlay_wheels.sh VERSION, then
#   uv run provision build --backend venv --matrix matrices/h200-overlay.yaml --only 'cu130-*-fiVERSION' --wait-kernels
# which leaves the cell's kernel set in .cache/kernels/<cell>/.
# Device call: run(carry=[".whl/overlay", ".cache/kernels"], command="bash tools/device_run_carried.sh 'cu130-*-fi0.6.17'")
# When the wheels and the kernel set pass the 64 MiB a call carries (flashinfer 0.7.4's wheel is 43 MB), pack
# the set here, `tar -cJf .whl/k/kernels.tar.xz .cache/kernels/<cell>` (about a third of its size), and carry
# .whl/k instead of .cache/kernels: every .whl/k/*.tar.xz is unpacked in the repository root first.
# Back in $OUT: gpu-host-carried.json and .log, and res-carried.tgz (the run's results, for results/).
# COLD=1: then the quick level again as it is, --cold-ranks and --gpu-alone, timed (bench_gpu_host.py --cold).
set -u
cd "$(dirname "$0")/.."
ONLY="${1:-cu130-*-fi0.6.17}"
LIMIT="${2:-480}"
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 UV_OFFLINE=1
. tools/device_env.sh
# The overlay matrix carries its cells' kernels for this GPU (kernel_archs 9.0a): fi-jit's cross-compile targets
# (12.0a, 12.0f) are answered by the default matrix's cells, which carry those targets too. FI_JIT_ONLY=all
# plans them here as well (they then compile on this host: nothing carried them).
fi_jit_only
W="$(mktemp -d)"
for t in .whl/k/*.tar.xz; do [ -f "$t" ] && tar -xJf "$t"; done
nvidia-smi -L
python3 benchmarks/bench_gpu_host.py --matrix matrices/h200-overlay.yaml --only "$ONLY" --case carried \
    --wheels .whl/overlay --base-python "$(command -v python3)" --limit "$LIMIT" --out "$W" ${COLD:+--cold} ${PROFILE:+--profile} | tail -22
cp "$W"/gpu-host-carried.json "$W"/gpu-host-carried.log "$W"/profile-quick.txt "$OUT"/ 2>/dev/null
[ -d "$W/res-carried" ] && tar -C "$W" -czf "$OUT/res-carried.tgz" res-carried
grep -E "^ +(partial|fail|crash|hang) " "$W/gpu-host-carried.log" | head -60
sed -n '/^summary/,$p' "$W/gpu-host-carried.log" | head -40

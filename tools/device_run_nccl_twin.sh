#!/usr/bin/env bash
# One stack, two NCCL releases, on a lent GPU machine: matrices/h200-overlay-nccl.yaml's pair (torch 2.11.0+cu130
# with its own NCCL, and the same overlay with NCCL 2.32.6 loaded ahead of it), nccl-graphs, symm-mem and the
# inventory at the full level (on one GPU: nccl-graphs' check=table and symm-mem's one-rank backend=nccl).
# The NCCL wheel (about 197 MiB, its library does not compress) is more than one call carries (64 MiB with the
# checkout): the wheels come as one tar (.whl/overlay: NCCL 2.32.6 and apache-tvm-ffi; .whl/k: flashinfer 0.7.4 as
# .whl.txz) cut in parts, .whl/s1 .. .whl/s5 staged by earlier calls on the same warm machine into .whl/stage (`bash
# tools/device_run_nccl_twin.sh stage`, one part a call) and the last part with this call in .whl/s6, which also
# holds the tar's SHA256; the parts are joined and the hash checked before anything is installed.
# Here: tar -cf B.tar .whl/overlay/<the three wheels> .whl/k/<flashinfer txz>; split -b 39000000 -d -a 1 B.tar part.
# (a part and the tracked checkout, about 25 MB, must stay under the 64 MiB a call carries)
# Device calls: run(carry=[".whl/s1"], command="bash tools/device_run_nccl_twin.sh stage"), the same for s2 .. s5,
# then run(carry=[".whl/s6"], command="bash tools/device_run_nccl_twin.sh").
# Back in $OUT: nccl-twin.log and res-nccl.tgz (the run's results, for results/).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
STAGE=.whl/stage
mkdir -p "$STAGE"
for d in .whl/s?; do [ -d "$d" ] && cp "$d"/part.* "$STAGE"/; done
if [ "${1:-}" = stage ]; then
    ls -la "$STAGE"
    exit 0
fi
cat $(ls "$STAGE"/part.* | sort -V) > /tmp/bundle.tar || exit 3
want="$(cat .whl/s6/SHA256)"
got="$(sha256sum /tmp/bundle.tar | cut -d' ' -f1)"
[ "$want" = "$got" ] || { echo "wheel bundle: sha256 $got, wanted $want: a part is missing or damaged"; ls -la "$STAGE"; exit 3; }
tar -xf /tmp/bundle.tar
export PYTHONUNBUFFERED=1 UV_OFFLINE=1
. tools/device_env.sh
ls .whl/overlay
nvidia-smi -L
LOG="$OUT/nccl-twin.log"
W="$(mktemp -d)"
python3 -m provision.cli build --backend venv --matrix matrices/h200-overlay-nccl.yaml --venvs .cache/venvs-nccl \
    --wheels .whl/overlay --no-reach-check --base-python "$(command -v python3)" --kernel-archs none \
    > "$LOG" 2>&1
echo "build rc $?" | tee -a "$LOG"
for v in .cache/venvs-nccl/*/; do
    echo "$v: $("$v/bin/python" -c 'import torch; from inenv.selfcheck import loaded_nccl; print(torch.__version__, loaded_nccl(), "built", torch.cuda.nccl.version())' 2>&1 | tail -1)" \
        | tee -a "$LOG"
done
# NCCL's own words on how it parsed NCCL_ALGO=allreduce:tree, one rank per cell (the raw lines the probe reads)
for v in .cache/venvs-nccl/*/; do
    echo "== $v NCCL_ALGO=allreduce:tree" >> "$LOG"
    NCCL_ALGO=allreduce:tree NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ENV MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 \
        "$v/bin/python" -c 'import torch, torch.distributed as d; d.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0")); t=torch.ones(4, device="cuda"); d.all_reduce(t); d.broadcast(t, 0); torch.cuda.synchronize(); d.destroy_process_group()' 2>&1 \
        | grep -E -A 9 "NCCL_ALGO set|Func/Proto/Algo" | head -24 >> "$LOG"
done
start=$(date +%s)
python3 -m checks.cli run --probe nccl-graphs --probe symm-mem --probe inventory --backend venv \
    --matrix matrices/h200-overlay-nccl.yaml --level full --results "$W/res-nccl" \
    >> "$LOG" 2>&1
echo "run rc $? in $(( $(date +%s) - start )) s" | tee -a "$LOG"
tar -C "$W" -czf "$OUT/res-nccl.tgz" res-nccl
grep -E -A 9 "^== |NCCL_ALGO set|Func/Proto/Algo" "$LOG" | head -60
grep -E "^ *(pass|partial|fail|crash|hang) " "$LOG" | grep -E "nccl-graphs|symm-mem" | cut -c1-240 | head -40
sed -n '/^summary/,$p' "$LOG" | head -30

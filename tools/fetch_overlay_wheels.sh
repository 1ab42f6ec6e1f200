#!/usr/bin/env bash
# Fill the gitignored .whl/overlay/ with the wheels overlay venv cells of matrices/h200-overlay.yaml install on a lent
# GPU machine (no index there; its torch 2.11.0+cu130, CUDA libraries, NCCL, numpy, ninja, nvidia-ml-py and
# the like come from its own Python): flashinfer-python of each VERSION and the apache-tvm-ffi its lock pins.
# The device tool carries at most 64 MiB per call, repository included: the three 0.6.x wheels fit in one
# call (about 47 MB), 0.7.4 in another. flashinfer 0.7.4's wheel is 101 MB; a wheel over 40 MB is rewritten
# without the kernel sources and prebuilt programs of features no probe touches (data/csrc/cake_*,
# data/csrc/*alphamoe*, and every non-Python file under experimental/ and the cake_*_backend/ packages, whose
# .py files flashinfer.moe_ep imports), its RECORD rewritten to match. Such a wheel keeps its name and version;
# `provision build` records that its bytes are not the lock's (build.json: installed.<name>.lock_hash false).
# Usage: tools/fetch_overlay_wheels.sh VERSION... (e.g. 0.6.8.post1 0.6.17 0.6.18, then 0.7.4); the folder is
# emptied first (one device call's set), and carried alone: run(carry=[".whl/overlay"], ...).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: $0 FLASHINFER_VERSION..." >&2; exit 2; }
DL=".cache/wheels"
W=".whl/overlay"
mkdir -p "$DL" "$W"
rm -f "$W"/*.whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
tvm=()
for v in "$@"; do
    lock="envs/cu130-torch2.11.0-sglnone-fi$v/requirements.lock"
    [ -f "$lock" ] || { echo "no $lock: run provision lock --matrix matrices/h200-overlay.yaml" >&2; exit 2; }
    tvm+=("$(grep -oE '^apache-tvm-ffi==[^ ]+' "$lock")")
    whl="$DL/flashinfer_python-$v-py3-none-any.whl"
    [ -f "$whl" ] || python3 -m pip download -q --no-deps --only-binary=:all: -d "$DL" "flashinfer-python==$v"
    cp "$whl" "$W"/
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$W" $(printf '%s\n' "${tvm[@]}" | sort -u)
for whl in "$W"/flashinfer_python-*.whl; do
    [ "$(stat -c %s "$whl")" -gt 40000000 ] || continue
    python3 - "$whl" <<'PY'
import re, sys, zipfile
from pathlib import Path

src = Path(sys.argv[1])
tmp = src.with_name(src.name + ".part")

def dropped(name: str) -> bool:
    # Sampling "cake" kernels and attention/GEMM families no comm JIT module compiles (kda: Kimi delta
    # attention, gdn: gated delta net, blackwell_*: SM100 GEMMs); the comm modules use csrc/*.cu at the top
    # level and csrc/nv_internal.
    if re.match(r"flashinfer/data/csrc/(cake_|[^/]*alphamoe|kda/|gdn/|blackwell_)", name):
        return True
    return bool(re.match(r"flashinfer/(experimental|cake_[^/]*_backend)/", name)) and not name.endswith(".py")

with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    for info in zin.infolist():
        if info.filename != record and not dropped(info.filename):
            zout.writestr(info, zin.read(info.filename))
    rows = [r for r in zin.read(record).decode().splitlines() if r and not dropped(r.split(",", 1)[0])]
    zout.writestr(record, "\n".join(rows) + "\n")
tmp.replace(src)
PY
done
du -sh "$W"/*.whl "$W"

# Sourced (from the repository root) by every tools/device_run_*.sh script: what each run on a lent GPU machine
# keeps the same.
# NVLink multicast stays off in NCCL, torch symmetric memory and NVSHMEM: a program that uses it can put a
# shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# fi-jit's (module, target) pairs for the machine's own GPU only, every comm module (STACKPROBE_FI_JIT_ONLY's
# form): its cross-compile targets are answered by the CPU machine's cells.
LOCAL_COMM_PAIRS="vllm_comm@local,trtllm_comm@local,moe_a2a@local,pcie_ipc@local,pcie_ipc_ag_rs@local"
# fi-jit's pairs from FI_JIT_ONLY (default: LOCAL_COMM_PAIRS; "all": every pair fi-jit plans, cross targets too)
fi_jit_only() {
    local pairs="${FI_JIT_ONLY-$LOCAL_COMM_PAIRS}"
    if [ "$pairs" = all ]; then unset STACKPROBE_FI_JIT_ONLY; else export STACKPROBE_FI_JIT_ONLY="$pairs"; fi
}
# A wheel carried as .whl/k/NAME.whl.txz (its files in an xz tar: under half the zip's size, so the wheels, a
# kernel set and the checkout fit the 64 MiB a call carries) is made a wheel again as .whl/overlay/NAME.whl: a
# wheel is a zip of its files, and its RECORD hashes the files, not the archive.
# Here: mkdir W && (cd W && unzip -q ../NAME.whl && tar -cJf ../.whl/k/NAME.whl.txz .)
for t in .whl/k/*.whl.txz; do
    [ -f "$t" ] || continue
    d="$(mktemp -d)"
    tar -xJf "$t" -C "$d"
    mkdir -p .whl/overlay
    (cd "$d" && python3 -m zipfile -c "$OLDPWD/.whl/overlay/$(basename "$t" .txz)" $(ls -A))
    rm -rf "$d"
done

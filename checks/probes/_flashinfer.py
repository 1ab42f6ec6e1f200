"""One adapter over the flashinfer versions the matrix holds: where each comm module's JIT generator
lives, the fused allreduce API (legacy ``trtllm_ar`` vs unified ``allreduce.py``), the vLLM-style custom
allreduce, and the MoE all-to-all. Probes call these functions and never touch flashinfer names directly.

In-environment side: standard library at import time; flashinfer and torch are imported inside functions.
Run as ``python -m checks.probes._flashinfer jit MODULE`` it builds one JIT module in this fresh
interpreter (flashinfer fixes its target architectures when it is imported, so every (module, arch) pair
needs its own process) and prints one JSON line.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

from checks.probes import _elf

# JIT generators by module, newest location first. A module missing from a version is reported as absent.
JIT_GENERATORS: dict[str, tuple[tuple[str, str], ...]] = {
    "vllm_comm": (
        ("flashinfer.jit.comm", "gen_vllm_comm_module"),
        ("flashinfer.comm.vllm_ar", "gen_vllm_comm_module"),
    ),
    "trtllm_comm": (
        ("flashinfer.jit.comm", "gen_trtllm_comm_module"),
        ("flashinfer.comm.trtllm_ar", "gen_trtllm_comm_module"),
    ),
    "moe_a2a": (
        ("flashinfer.jit.comm", "gen_moe_alltoall_module"),
        ("flashinfer.comm.trtllm_moe_alltoall", "gen_moe_alltoall_module"),
    ),
    "pcie_ipc": (("flashinfer.jit.comm", "gen_pcie_ipc_comm_module"),),
}
# Smallest first: vllm_comm is one .cu file (about 15 s for one arch on 2 cores), trtllm_comm three.
COMM_MODULES: tuple[str, ...] = tuple(JIT_GENERATORS)

RESULT_PREFIX = "@@FI-JIT@@ "
_TAIL = 3000


def prepare_env() -> None:
    """Point flashinfer's JIT cache at ``STACKPROBE_JIT_CACHE`` (reused across runs); call before importing it."""
    cache = os.environ.get("STACKPROBE_JIT_CACHE")
    if cache:
        os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", cache)


def version() -> str | None:
    try:
        import importlib.metadata as md

        for dist in ("flashinfer-python", "flashinfer"):
            try:
                return md.version(dist)
            except md.PackageNotFoundError:
                continue
    except Exception:
        pass
    return None


def nvcc_version(cuda_home: str) -> str | None:
    try:
        text = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release\s+([\d.]+)", text)
    return m.group(1) if m else None


def jit_generator(module: str) -> Any | None:
    """The generator function for a comm module in the installed flashinfer, or None when it lacks it."""
    for mod_name, attr in JIT_GENERATORS[module]:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        gen = getattr(mod, attr, None)
        if gen is not None:
            return gen
    return None


# --- error classification ---------------------------------------------------------------------------
# (reason_code, regex) in priority order; the first that matches names the failure.
JIT_SIGNATURES: tuple[tuple[str, str], ...] = (
    ("fi-arch-gate", r"No supported CUDA architectures found for major versions"),
    ("fi-nvcc-too-old", r"SM 12\.x requires CUDA >= 12\.9"),
    ("nvcc-unsupported-arch", r"Unsupported gpu architecture|not defined for option 'gpu-name'"),
    ("fi-link-no-libcuda", r"cannot find -lcuda"),
    ("fi-link-unresolved", r"undefined symbol: cu[A-Z]\w*"),
    ("fi-missing-header", r"fatal error: [\w./+-]+\.h(?:pp)?: No such file or directory"),
    ("fi-no-nvcc", r"Could not find nvcc|nvcc: not found|No such file or directory: '[^']*nvcc'"),
    ("fi-nvcc-error", r"error: |\berror\b.*\.cu\(|ptxas (fatal|error)"),
)


def classify_jit_error(text: str) -> str:
    for code, pattern in JIT_SIGNATURES:
        if re.search(pattern, text):
            return code
    return "fi-jit-error"


def error_lines(text: str, limit: int = 6) -> list[str]:
    """The lines of a build log a person needs to read first."""
    keep = [ln.strip() for ln in text.splitlines() if re.search(r"error|Error|fatal|cannot find|FAILED", ln)]
    return keep[:limit]


def api_surface() -> dict[str, bool]:
    """Which of the comm entry points the probes use this flashinfer has (import only; no GPU needed)."""
    names = {
        "unified_fusion": ("flashinfer.comm", "create_allreduce_fusion_workspace"),
        "legacy_fusion": ("flashinfer.comm", "trtllm_create_ipc_workspace_for_all_reduce_fusion"),
        "vllm_custom_ar": ("flashinfer.comm", "vllm_init_custom_ar"),
        "ipc_shared_buffer": ("flashinfer.comm", "create_shared_buffer"),
        "moe_a2a": ("flashinfer.comm.trtllm_moe_alltoall", "MoeAlltoAll"),
        "moe_a2a_functional": ("flashinfer.comm.trtllm_moe_alltoall", "moe_a2a_dispatch"),
        "pcie_ipc": ("flashinfer.comm", "PcieIpcAllReduceWorkspace"),
        "torch_dist_backend": ("flashinfer.comm.comm_backend", "TorchDistBackend"),
        "torch_dist_backend_mnnvl": ("flashinfer.comm.mnnvl", "TorchDistBackend"),  # before comm_backend.py
    }
    out: dict[str, bool] = {}
    for key, (mod_name, attr) in names.items():
        try:
            out[key] = hasattr(importlib.import_module(mod_name), attr)
        except Exception:
            out[key] = False
    for module in JIT_GENERATORS:
        out[f"jit_{module}"] = jit_generator(module) is not None
    return out


# --- one JIT build, in this process (called in a fresh interpreter by fi-jit) -------------------------
def _ninja_targets(ninja_file: str) -> tuple[list[str], list[str]]:
    """(object targets, final targets) of a flashinfer build.ninja."""
    objs: list[str] = []
    finals: list[str] = []
    with open(ninja_file) as f:
        for line in f:
            m = re.match(r"build (\S+): (\S+)", line)
            if m is None:
                continue
            (objs if m.group(2) in ("compile", "cuda_compile") else finals).append(m.group(1))
    return objs, finals


def _ninja(build_dir: str, targets: list[str]) -> tuple[int, str]:
    cmd = [os.environ.get("STACKPROBE_NINJA", "ninja"), "-C", build_dir, *targets]
    jobs = os.environ.get("MAX_JOBS")
    if jobs:
        cmd[1:1] = ["-j", jobs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, (proc.stdout + proc.stderr)


def build_module(module: str, load: bool = False) -> dict[str, Any]:
    """Build one comm module for the architectures flashinfer resolved at import; compile and link apart,
    then read what the library needs at load time and, with ``load`` (a GPU is visible), load it."""
    out: dict[str, Any] = {"module": module, "flashinfer": version()}
    t0 = time.monotonic()
    try:
        import flashinfer  # noqa: F401  (fixes the compilation context from the environment)
    except Exception as exc:
        return {**out, "stage": "import", "ok": False, "error": f"{type(exc).__name__}: {exc}"[-_TAIL:]}
    gen = jit_generator(module)
    if gen is None:
        return {**out, "stage": "absent", "ok": False, "error": f"this flashinfer has no {module} JIT module"}
    try:
        spec = gen()  # arch gates raise here
    except Exception as exc:
        return {**out, "stage": "spec", "ok": False, "error": f"{type(exc).__name__}: {exc}"[-_TAIL:]}
    out["name"] = getattr(spec, "name", module)
    if not hasattr(spec, "write_ninja") or not hasattr(spec, "ninja_path"):
        # Old JitSpec without a ninja file of its own: one step, told apart by the error text afterwards.
        try:
            spec.build_and_load()
        except Exception as exc:
            return {**out, "stage": "build", "ok": False, "error": f"{type(exc).__name__}: {exc}"[-_TAIL:]}
        return {**out, "stage": "done", "ok": True, "compile_s": round(time.monotonic() - t0, 1)}
    out["build_dir"] = str(spec.build_dir)
    spec.write_ninja()
    objs, finals = _ninja_targets(str(spec.ninja_path))
    with open(spec.ninja_path) as f:
        out["gencode"] = sorted(set(re.findall(r"-gencode=\S+", f.read())))
    rc, log = _ninja(str(spec.build_dir), objs)
    out["compile_s"] = round(time.monotonic() - t0, 1)
    out["objects"] = len(objs)
    if rc != 0:
        return {**out, "stage": "compile", "ok": False, "error": log[-_TAIL:]}
    t1 = time.monotonic()
    rc, log = _ninja(str(spec.build_dir), finals)
    out["link_s"] = round(time.monotonic() - t1, 1)
    if rc != 0:
        return {**out, "stage": "link", "ok": False, "error": log[-_TAIL:]}
    # The JIT output itself: get_library_path() answers with an AOT artifact when one is installed.
    jit_lib = getattr(spec, "jit_library_path", None)
    if jit_lib is None and hasattr(spec, "get_library_path"):
        jit_lib = spec.get_library_path()
    out["library"] = str(jit_lib or "")
    out["library_bytes"] = os.path.getsize(out["library"]) if out["library"] and os.path.exists(out["library"]) else 0
    if out["library_bytes"]:
        linked = _elf.linkage(out["library"])
        if linked is not None:
            out["needed"] = list(linked.needed)
            out["driver_calls"] = list(linked.driver_calls())
            out["unresolved_driver_calls"] = list(linked.unresolved_driver_calls())
    if load:
        # flashinfer's own loader, after CUDA is up (libcuda is then loaded, privately, by the runtime):
        # exactly the state a probe or a server loads the module in. Ninja has nothing left to do.
        t2 = time.monotonic()
        try:
            import torch

            torch.zeros(1, device="cuda")
            if "so_path" in inspect.signature(spec.load).parameters:
                spec.load(jit_lib)
            else:
                spec.build_and_load()
        except Exception as exc:
            return {**out, "stage": "load", "ok": False, "error": f"{type(exc).__name__}: {exc}"[-_TAIL:]}
        out["load_s"] = round(time.monotonic() - t2, 1)
        out["loaded"] = True
    return {**out, "stage": "done", "ok": True}


def run_build_subprocess(
    module: str, env: dict[str, str], timeout_s: float, python: str | None = None, load: bool = False
) -> dict[str, Any]:
    """Run :func:`build_module` in a fresh interpreter with ``env``; a timeout or crash is a result too."""
    cmd = [python or sys.executable, "-m", "checks.probes._flashinfer", "jit", module, *(["--load"] if load else [])]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-_TAIL:]
        text = tail.decode(errors="replace") if isinstance(tail, bytes) else str(tail)
        return {"module": module, "stage": "timeout", "ok": False, "error": f"no result in {timeout_s:.0f} s\n{text}"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
            result["log_tail"] = proc.stderr[-1500:]
            return result
    return {
        "module": module,
        "stage": "crash",
        "ok": False,
        "error": f"builder exited {proc.returncode} without a result\n{(proc.stdout + proc.stderr)[-_TAIL:]}",
    }


def stop_together(local: dict[str, Any] | None, group: Any = None) -> dict[str, Any] | None:
    """Every rank learns every rank's early verdict (None = go on); all stop with the worst, or all go on.

    A rank that returned alone would leave its peers blocked in the next collective step, and the variant
    would read as a hang instead of the failure that stopped it.
    """
    from checks.probe import combine_worst
    from checks.probes import _dist

    verdicts = [o for o in _dist.gather_objects(local, group) if o is not None]
    return combine_worst(verdicts) if verdicts else None


# --- fused allreduce + residual + RMSNorm -------------------------------------------------------------
class Fusion:
    """The trtllm fused allreduce across flashinfer versions. Always the ``trtllm`` backend: ``auto`` may
    pick ``mnnvl``, which creates NVLink multicast objects, and those must never be made on shared hosts."""

    def __init__(self) -> None:
        import flashinfer.comm as comm

        self.comm = comm
        self.unified = hasattr(comm, "create_allreduce_fusion_workspace") and hasattr(comm, "allreduce_fusion")
        self.api = "unified" if self.unified else "legacy"
        self.workspace: Any = None
        self._legacy_ptrs: Any = None

    def create_workspace(self, rank: int, world: int, max_tokens: int, hidden: int, dtype: Any, group: Any) -> None:
        comm = self.comm
        if self.unified:
            params = inspect.signature(comm.create_allreduce_fusion_workspace).parameters
            kwargs: dict[str, Any] = {
                "backend": "trtllm",
                "world_size": world,
                "rank": rank,
                "max_token_num": max_tokens,
                "hidden_dim": hidden,
                "dtype": dtype,
            }
            if "group" in params:
                kwargs["group"] = group
            if "gpus_per_node" in params:
                kwargs["gpus_per_node"] = world
            self.workspace = comm.create_allreduce_fusion_workspace(**kwargs)
            return
        fn = comm.trtllm_create_ipc_workspace_for_all_reduce_fusion
        params = inspect.signature(fn).parameters
        kwargs = {"group": group} if "group" in params else {}
        made = fn(rank, world, max_tokens, hidden, **kwargs)
        self._legacy_ptrs, self.workspace = made[0], made[1]

    def workspace_bytes(self) -> int:
        ws = self.workspace
        tensor = getattr(ws, "workspace_tensor", ws)
        try:
            return int(tensor.numel() * tensor.element_size())
        except Exception:
            return 0

    def ar_residual_rmsnorm(
        self, inp: Any, residual: Any, gamma: Any, eps: float, residual_out: Any, norm_out: Any, rank: int, world: int
    ) -> None:
        comm = self.comm
        pattern = comm.AllReduceFusionPattern.kARResidualRMSNorm
        if self.unified:
            comm.allreduce_fusion(
                input=inp,
                workspace=self.workspace,
                pattern=pattern,
                launch_with_pdl=False,
                residual_out=residual_out,
                norm_out=norm_out,
                residual_in=residual,
                rms_gamma=gamma,
                rms_eps=eps,
                fp32_acc=True,
            )
            return
        tokens, hidden = inp.shape
        comm.trtllm_allreduce_fusion(
            allreduce_in=inp,
            world_size=world,
            world_rank=rank,
            token_num=tokens,
            hidden_dim=hidden,
            workspace_ptrs=self.workspace,
            launch_with_pdl=False,
            use_oneshot=None,
            trigger_completion_at_end=True,
            fp32_acc=True,
            pattern_code=pattern,
            allreduce_out=None,
            residual_in=residual,
            residual_out=residual_out,
            norm_out=norm_out,
            quant_out=None,
            scale_out=None,
            rms_gamma=gamma,
            rms_eps=eps,
            scale_factor=None,
            layout_code=None,
        )

    def destroy(self, group: Any) -> None:
        try:
            if self.unified and hasattr(self.workspace, "destroy"):
                self.workspace.destroy()
            elif self._legacy_ptrs is not None:
                self.comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self._legacy_ptrs, group)
        except Exception:
            pass


# --- vLLM-style custom allreduce ----------------------------------------------------------------------
class VllmCustomAR:
    """flashinfer's copy of vLLM's one-/two-stage custom allreduce (IPC buffers, graph registration)."""

    MAX_BYTES = 8 * 1024 * 1024

    def __init__(self, rank: int, group: Any, device: Any, full_nvlink: bool) -> None:
        import flashinfer.comm as comm
        import torch

        self.comm = comm
        self.rank = rank
        self.group = group
        self.meta_ptrs = comm.create_shared_buffer(comm.vllm_meta_size() + self.MAX_BYTES, group=group)
        self.buffer_ptrs = comm.create_shared_buffer(self.MAX_BYTES, group=group)
        self.rank_data = torch.empty(8 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.fa = comm.vllm_init_custom_ar(self.meta_ptrs, self.rank_data, rank, full_nvlink)
        comm.vllm_register_buffer(self.fa, self.buffer_ptrs)
        self._takes_ctas = len(inspect.signature(comm.vllm_all_reduce).parameters) >= 6

    def _call(self, inp: Any, out: Any, reg_ptr: int, reg_bytes: int) -> None:
        if self._takes_ctas:
            self.comm.vllm_all_reduce(self.fa, inp, out, reg_ptr, reg_bytes, 16)
        else:
            self.comm.vllm_all_reduce(self.fa, inp, out, reg_ptr, reg_bytes)

    def all_reduce_staged(self, inp: Any, out: Any) -> None:
        """Eager path: the kernel copies ``inp`` into the pre-registered IPC buffer first."""
        self._call(inp, out, self.buffer_ptrs[self.rank], self.MAX_BYTES)

    def all_reduce_graph(self, inp: Any, out: Any) -> None:
        """Inside a capture: ``inp`` itself is recorded and registered after the capture."""
        self._call(inp, out, 0, 0)

    def register_graph_buffers(self) -> int:
        import torch.distributed as dist

        handles, offsets = self.comm.vllm_get_graph_buffer_ipc_meta(self.fa)
        world = dist.get_world_size(self.group)
        all_h: list[Any] = [None] * world
        all_o: list[Any] = [None] * world
        dist.all_gather_object(all_h, handles, group=self.group)
        dist.all_gather_object(all_o, offsets, group=self.group)
        self.comm.vllm_register_graph_buffers(self.fa, all_h, all_o)
        return len(offsets)


# --- MoE all-to-all -----------------------------------------------------------------------------------
def moe_a2a() -> Any:
    """The functional MoE all-to-all module (flashinfer >= 0.6.0)."""
    return importlib.import_module("flashinfer.comm.trtllm_moe_alltoall")


def moe_dispatch(mod: Any, **kwargs: Any) -> tuple[list[Any], int]:
    """``moe_a2a_dispatch`` returns 2 values in early versions and 3 (with EPLB stats) later."""
    res = mod.moe_a2a_dispatch(**kwargs)
    return list(res[0]), int(res[1])


def moe_alltoall_object(
    rank: int,
    ep: int,
    max_tokens: int,
    top_k: int,
    num_experts: int,
    dispatch_bytes: int,
    combine_bytes: int,
    group: Any,
) -> Any:
    """``MoeAlltoAll`` across processes, its memory handles exchanged through torch.distributed."""
    mod = moe_a2a()
    from flashinfer.comm.mapping import Mapping
    from flashinfer.comm.mnnvl import MnnvlConfig

    try:
        from flashinfer.comm.comm_backend import TorchDistBackend
    except ImportError:
        from flashinfer.comm.mnnvl import TorchDistBackend  # type: ignore[no-redef]

    mapping = Mapping(world_size=ep, rank=rank, gpus_per_node=ep, tp_size=ep, moe_ep_size=ep)
    size = mod.moe_a2a_get_workspace_size_per_rank(ep, max_tokens, dispatch_bytes, combine_bytes)
    return mod.MoeAlltoAll(
        mapping,
        max_tokens,
        top_k,
        num_experts,
        workspace_size_per_rank=size,
        mnnvl_config=MnnvlConfig(comm_backend=TorchDistBackend(group)),
    )


def _main(argv: list[str]) -> int:
    if len(argv) in (2, 3) and argv[0] == "jit" and argv[1] in JIT_GENERATORS and argv[2:] in ([], ["--load"]):
        result = build_module(argv[1], load=argv[2:] == ["--load"])
        sys.stdout.write(RESULT_PREFIX + json.dumps(result, default=str) + "\n")
        return 0
    sys.stderr.write("usage: python -m checks.probes._flashinfer jit {" + ",".join(JIT_GENERATORS) + "} [--load]\n")
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

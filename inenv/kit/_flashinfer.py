"""One adapter over the flashinfer versions the matrix holds: where each comm module's JIT generator
lives, the fused allreduce API (legacy ``trtllm_ar`` vs unified ``allreduce.py``), the vLLM-style custom
allreduce, and the MoE all-to-all. Probes call these functions and never touch flashinfer names directly.
Building a JIT module is ``inenv.kit._fi_build``.

In-environment side: standard library at import time; flashinfer and torch are imported inside functions.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import itertools
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from inenv import atomic
from inenv.kit import _carried, _compile_cache

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
        ("flashinfer.jit.comm", "gen_nvlink_one_sided_alltoall_module"),  # flashinfer.moe_ep's, from 0.7
        ("flashinfer.jit.comm", "gen_moe_alltoall_module"),
        ("flashinfer.comm.trtllm_moe_alltoall", "gen_moe_alltoall_module"),
    ),
    "pcie_ipc": (("flashinfer.jit.comm", "gen_pcie_ipc_comm_module"),),
    "pcie_ipc_ag_rs": (("flashinfer.jit.comm", "gen_pcie_ipc_ag_rs_module"),),  # all-gather, reduce-scatter
}
# Smallest first: vllm_comm is one .cu file (about 15 s for one arch on 2 cores), trtllm_comm three.
COMM_MODULES: tuple[str, ...] = tuple(JIT_GENERATORS)


def prepare_env() -> None:
    """Point flashinfer's JIT cache at ``STACKPROBE_JIT_CACHE`` (reused across runs), and its AOT folder at
    the comm modules fi-jit built for this GPU in this cell (:func:`use_prebuilt`); call before the first
    flashinfer call that loads a module."""
    cache = os.environ.get("STACKPROBE_JIT_CACHE")
    if cache:
        os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", cache)
    use_prebuilt()


# --- one compile per module, arch and host --------------------------------------------------------------
# fi-jit's build for the local GPU (arch=local: flashinfer's own arch detection, as a probe's import does) is
# published, once it loaded, into a folder laid out as flashinfer's AOT folder: <root>/<flashinfer version>/
# <flashinfer's arch folder name, e.g. 90a>/<module name>/<module name>.so. A GPU probe points flashinfer's
# AOT folder there (``flashinfer.jit.env.FLASHINFER_AOT_DIR``, which every JitSpec's ``aot_path`` reads at
# call time, in every release the matrix holds), so flashinfer loads the library fi-jit built and proved
# instead of compiling it again inside the probe's watchdog and its turn on the GPU.
PREBUILT_ENV = "STACKPROBE_FI_PREBUILT"  # the root, when the host names it; else under the compile cache


def prebuilt_root(env: Mapping[str, str] | None = None) -> Path | None:
    """Where this cell's published modules live: ``STACKPROBE_FI_PREBUILT``, else ``prebuilt/<cell>`` in the
    shared compile cache (a cell's own folder: cells of one flashinfer release differ in toolkit and torch).
    None when neither is known (nothing is published or read)."""
    env = os.environ if env is None else env
    if env.get(PREBUILT_ENV):
        return Path(env[PREBUILT_ENV])
    cache, cell = env.get(_compile_cache.ENV, ""), env.get(_compile_cache.CELL_ENV, "")
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in cell)
    return Path(cache) / "prebuilt" / safe if cache and safe.strip("._") else None


def prebuilt_dir(release: str | None, arch_dir: str, env: Mapping[str, str] | None = None) -> Path | None:
    """The AOT-shaped folder of one flashinfer release and one arch folder name."""
    root = prebuilt_root(env)
    return root / (release or "unknown") / arch_dir if root is not None and arch_dir else None


def publish(name: str, library: str, release: str | None, arch_dir: str) -> str | None:
    """Copy a built, loaded library to ``<prebuilt>/<name>/<name>.so`` (a copy renamed into place, so a probe
    never loads half a file); the path written, or None when there is nowhere to publish or it failed."""
    folder = prebuilt_dir(release, arch_dir)
    if folder is None or not library or not os.path.isfile(library):
        return None
    target = folder / name / f"{name}.so"
    try:
        atomic.write_bytes(target, Path(library).read_bytes())
    except OSError:
        return None
    return str(target)


def published(name: str, release: str | None, arch_dir: str, env: Mapping[str, str] | None = None) -> bool:
    folder = prebuilt_dir(release, arch_dir, env)
    return folder is not None and (folder / name / f"{name}.so").is_file()


def use_prebuilt() -> str | None:
    """Point flashinfer's AOT folder at what this cell has for the local GPU; the folder flashinfer then
    loads from, or None when it has nothing (it compiles what it needs).

    A cell that carries its kernels (``_carried``) keeps them in flashinfer's own AOT folder: when every
    carried module holds SASS for the local GPU that folder serves as it is; else flashinfer is pointed at a
    folder of links to the carried modules that run here and the modules fi-jit published for this GPU, so
    a module built for other GPUs is compiled instead of loaded. A cell without carried kernels gets the
    modules fi-jit published (or keeps the AOT modules of flashinfer-jit-cache or of its package). Imports
    flashinfer only when there is something to point at, and a probe that calls it imports flashinfer next."""
    own_dir = _carried.aot_dir()
    carried, refused = _carried.usable(own_dir)  # refused: in the folder, but never to be loaded here
    root = prebuilt_root()
    if not carried and not refused and (root is None or not (root / (version() or "unknown")).is_dir()):
        return None
    try:
        from flashinfer.jit import env as jit_env
    except Exception:
        return None
    folder = prebuilt_dir(version(), Path(jit_env.FLASHINFER_WORKSPACE_DIR).name)
    published = {p.parent.name: p for p in folder.glob("*/*.so")} if folder is not None and folder.is_dir() else {}
    if (carried or refused) and own_dir is not None:
        capability = local_capability()
        if capability is None:
            return str(own_dir)
        fit = {c.name for c in carried.values() if c.runs_on(capability)}
        extra = {name: lib for name, lib in published.items() if name not in fit}
        scratch = Path(os.environ.get("STACKPROBE_JIT_CACHE") or tempfile.gettempdir())
        linked = _carried.fitting_folder(own_dir, capability, scratch, extra)
        if linked is None:
            return str(own_dir)
        jit_env.FLASHINFER_AOT_DIR = linked
        return str(linked)
    own = Path(jit_env.FLASHINFER_AOT_DIR)
    if own.is_dir() and any(own.glob("*/*.so")):
        return None
    if not published or folder is None:
        return None
    jit_env.FLASHINFER_AOT_DIR = folder
    return str(folder)


def local_capability() -> str | None:
    """The compute capability of GPU 0 ("9.0"), or None without torch or a GPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(0)
    except Exception:
        return None
    return f"{major}.{minor}"


# The comm modules each GPU probe's variant loads, by probe id: a function of the variant's parameters.
PROBE_MODULES: dict[str, Any] = {
    "fi-fusion": lambda p: ("trtllm_comm",),
    "ep-a2a": lambda p: ("moe_a2a",),
    "pcie-ipc": lambda p: ("pcie_ipc",) if p.get("op", "all-reduce") == "all-reduce" else ("pcie_ipc_ag_rs",),
    "ar-latency": lambda p: {"flashinfer-custom-ar": ("vllm_comm",),
                             "flashinfer-pcie-ipc": ("pcie_ipc",)}.get(p.get("backend", ""), ()),
    "custom-ar": lambda p: ("vllm_comm",) if p.get("impl", "flashinfer") == "flashinfer" else (),
}
MARK = ".published"  # beside a published module's folder: <arch folder>/<module><MARK> names it by module


def modules_for(probe_id: str, params: Mapping[str, str]) -> tuple[str, ...]:
    pick = PROBE_MODULES.get(probe_id)
    return tuple(pick(params)) if pick else ()


def mark_published(module: str, library: str) -> None:
    """Say, by the module's name here (``trtllm_comm``), which published library is it: the host reads
    these to tell a GPU variant that will compile from one that will not (:func:`unpublished`)."""
    with contextlib.suppress(OSError):
        Path(library).parent.parent.joinpath(module + MARK).write_text(Path(library).name + "\n")


def unpublished(modules: Iterable[str], release: str, env: Mapping[str, str]) -> list[str]:
    """Which of ``modules`` no fi-jit build has published for this cell and release (any arch folder); every
    one when nothing is known (no compile cache or cell in ``env``)."""
    root = prebuilt_root(env)
    base = root / release if root is not None else None
    return [m for m in modules if base is None or not any(base.glob(f"*/{m}{MARK}"))]


def will_compile(names: Iterable[str]) -> list[str]:
    """Which of these JIT module names flashinfer will compile in this process: not published for this
    cell and release (read before the import, from the folder names alone: every arch folder counts)."""
    root = prebuilt_root()
    base = root / (version() or "unknown") if root is not None else None
    return [n for n in names if base is None or not any(base.glob(f"*/{n}/{n}.so"))]


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


def package_root() -> Path | None:
    """The installed flashinfer package's folder, found without importing it (which takes 10-30 s with torch)."""
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def names_in_sources(names: Iterable[str], root: Path | None = None, first: Path | None = None) -> set[str] | None:
    """Which of ``names`` some Python source under ``root`` (default: the installed flashinfer) spells, read
    as bytes without importing anything, the folder ``first`` first, stopping once every name is found. None
    when there is no package or a source cannot be read (then nothing can be told). A name spelt nowhere
    cannot be found by any import of a pure-Python package."""
    root = root or package_root()
    if root is None:
        return None
    left = {n.encode() for n in names}
    found: set[str] = set()
    first = first or root
    paths = itertools.chain(first.rglob("*.py"), (p for p in root.rglob("*.py") if first not in p.parents))
    for path in paths:
        try:
            text = path.read_bytes()
        except OSError:
            return None
        hit = {n for n in left if n in text}
        found |= {n.decode() for n in hit}
        left -= hit
        if not left:
            break
    return found


def generator_named_in_sources(module: str) -> bool | None:
    """Whether any Python source of the installed flashinfer names one of ``module``'s generators; None when
    that cannot be told. False is conclusive: the module is absent from this release."""
    found = names_in_sources({attr for _mod, attr in JIT_GENERATORS[module]})
    return None if found is None else bool(found)


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
        self.fused(inp, pattern="rmsnorm", rank=rank, world=world, residual_in=residual, residual_out=residual_out,
                   gamma=gamma, eps=eps, norm_out=norm_out)

    # The fused patterns by name: residual + RMSNorm, and the quant-fused ones vLLM's allreduce fusion pass enables
    # (the normalized output quantized to FP8 with a per-tensor scale, or to NVFP4 with its block scale factors
    # swizzled 128x4); the quant-fused ones write the residual and the quantized output, not the normalized one.
    PATTERNS = {"rmsnorm": "kARResidualRMSNorm", "fp8": "kARResidualRMSNormFP8Quant",
                "nvfp4": "kARResidualRMSNormFP4Quant"}

    def nvfp4_layout(self) -> Any:
        """The swizzled 128x4 scale-factor layout (``QuantizationSFLayout``, ``FP4QuantizationSFLayout`` before)."""
        for holder, name in (("QuantizationSFLayout", "SWIZZLED_128x4"), ("FP4QuantizationSFLayout", "SWIZZLED")):
            layout = getattr(getattr(self.comm, holder, None), name, None)
            if layout is not None:
                return layout
        raise LookupError("this flashinfer names no swizzled 128x4 scale-factor layout")

    def fused(self, inp: Any, *, pattern: str, rank: int, world: int, residual_in: Any, residual_out: Any,
              gamma: Any, eps: float, norm_out: Any = None, quant_out: Any = None, scale_out: Any = None,
              scale_factor: Any = None, output: Any = None, use_oneshot: bool | None = None,
              launch_with_pdl: bool = False) -> None:
        """One fused allreduce of ``inp`` ([tokens, hidden]) in a pattern of :data:`PATTERNS`; ``use_oneshot`` None
        lets flashinfer choose one-shot or two-shot by size, ``launch_with_pdl`` launches with programmatic
        dependent launch; ``output`` (optional) is where the plain sum may go instead of a buffer made per call."""
        comm = self.comm
        code = getattr(comm.AllReduceFusionPattern, self.PATTERNS[pattern])
        layout = self.nvfp4_layout() if pattern == "nvfp4" else None
        if self.unified:
            comm.allreduce_fusion(
                input=inp,
                workspace=self.workspace,
                pattern=code,
                launch_with_pdl=launch_with_pdl,
                output=output,
                residual_out=residual_out,
                norm_out=norm_out,
                quant_out=quant_out,
                scale_out=scale_out,
                residual_in=residual_in,
                rms_gamma=gamma,
                rms_eps=eps,
                scale_factor=scale_factor,
                layout_code=layout,
                use_oneshot=use_oneshot,
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
            launch_with_pdl=launch_with_pdl,
            use_oneshot=use_oneshot,
            trigger_completion_at_end=True,
            fp32_acc=True,
            pattern_code=code,
            allreduce_out=output,
            residual_in=residual_in,
            residual_out=residual_out,
            norm_out=norm_out,
            quant_out=quant_out,
            scale_out=scale_out,
            rms_gamma=gamma,
            rms_eps=eps,
            scale_factor=scale_factor,
            layout_code=layout,
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

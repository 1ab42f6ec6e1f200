"""NCCL called directly through ctypes, on torch's streams: the path serving engines take in CUDA graphs.

SGLang and vLLM capture their NCCL allreduce through a thin ctypes wrapper (pynccl) rather than
torch.distributed. ar-latency measures this path as its own backend, beside torch.distributed's; on the
2x H200 the two are equal inside a graph (7.5 us per call at 14 KiB on a side stream), and both match
nccl-tests (benchmarks/bench_latency_factors.py).

The communicator is separate from torch's but uses the very library torch loaded (found in
``/proc/self/maps``), so versions cannot differ. Below it, what NCCL writes: its debug log (transports,
version, chosen algorithms) and its error text (reason codes). In-environment side: stdlib and torch only.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import Any

from inenv import selfcheck
from inenv.kit import _dist

_BFLOAT16 = 9  # ncclDataType_t
_FLOAT32 = 7
_SUM = 0  # ncclRedOp_t
WIN_COLL_SYMMETRIC = 0x01  # nccl.h NCCL_WIN_COLL_SYMMETRIC: a window NCCL's symmetric kernels may use (NCCL >= 2.27)
WINDOW_CALLS = ("ncclMemAlloc", "ncclMemFree", "ncclCommWindowRegister", "ncclCommWindowDeregister")


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def loaded_library(prefix: str = "libnccl.so", default: str = "libnccl.so.2") -> str:
    """Path of the library this process already mapped under ``prefix`` (torch's), else ``default``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if os.path.basename(path).startswith(prefix):
                    return path
    except OSError:
        pass
    return default


def runtime_version(torch: Any) -> str:
    """The NCCL release this process runs: the loaded libnccl.so.2 asked (``ncclGetVersion``, through
    ``inenv.selfcheck.loaded_nccl``), else the release ``torch`` was built against (``torch.cuda.nccl.version()``
    is that, whatever library is loaded: an overlay or an NCCL-axis cell loads another)."""
    found = selfcheck.loaded_nccl().get("nccl")
    if found:
        return str(found)
    built = torch.cuda.nccl.version()
    return ".".join(map(str, built)) if isinstance(built, tuple) else str(built)


class DirectComm:
    """One NCCL communicator over the ranks of ``gloo`` (used only to pass the unique id)."""

    def __init__(self, rank: int, world: int, gloo: Any) -> None:
        self.path = loaded_library()
        self.lib = ctypes.CDLL(self.path)
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        self.lib.ncclAllReduce.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        uid = _UniqueId()
        if rank == 0:
            self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        # .internal would stop at the first NUL byte: send all 128 as hex (images may lack numpy, which
        # all_gather_object needs).
        ids = _dist.gather_objects(ctypes.string_at(ctypes.addressof(uid), 128).hex(), gloo)
        ctypes.memmove(ctypes.addressof(uid), bytes.fromhex(ids[0]), 128)
        self.comm = ctypes.c_void_p()
        self._check(self.lib.ncclCommInitRank(ctypes.byref(self.comm), world, uid, rank), "ncclCommInitRank")
        version = ctypes.c_int()
        self._check(self.lib.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
        self.version = version.value

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            text = self.lib.ncclGetErrorString(code).decode(errors="replace")
            raise RuntimeError(f"{what} returned {code}: {text}")

    def has(self, name: str) -> bool:
        """Whether the loaded library exports ``name`` (an older NCCL lacks the window calls)."""
        try:
            getattr(self.lib, name)
        except AttributeError:
            return False
        return True

    def mem_alloc(self, nbytes: int) -> int:
        """Device memory from ``ncclMemAlloc`` (cuMem-backed, what a symmetric window needs), its address."""
        ptr = ctypes.c_void_p()
        self._check(self.lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "ncclMemAlloc")
        return int(ptr.value or 0)

    def mem_free(self, ptr: int) -> None:
        self._check(self.lib.ncclMemFree(ctypes.c_void_p(ptr)), "ncclMemFree")

    def window_register(self, ptr: int, nbytes: int, flags: int = WIN_COLL_SYMMETRIC) -> int:
        """``ncclCommWindowRegister`` of ``nbytes`` at ``ptr`` (collective: every rank registers together); the
        window handle NCCL returned (0: it registered nothing)."""
        win = ctypes.c_void_p()
        code = self.lib.ncclCommWindowRegister(self.comm, ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes),
                                               ctypes.byref(win), ctypes.c_int(flags))
        self._check(code, "ncclCommWindowRegister")
        return int(win.value or 0)

    def window_deregister(self, win: int) -> None:
        self._check(self.lib.ncclCommWindowDeregister(self.comm, ctypes.c_void_p(win)), "ncclCommWindowDeregister")

    def all_reduce_f32(self, ptr: int, count: int) -> None:
        """In-place float32 sum of ``count`` elements at device address ``ptr`` on the current torch stream."""
        import torch

        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self.lib.ncclAllReduce(ptr, ptr, count, _FLOAT32, _SUM, self.comm, stream), "ncclAllReduce")

    def all_reduce_bf16(self, tensor: Any) -> None:
        """In-place sum on the current torch stream (the capture stream while a graph is captured)."""
        import torch

        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if tensor.dtype != torch.bfloat16:
            raise TypeError(f"all_reduce_bf16 got {tensor.dtype}")
        ptr = tensor.data_ptr()
        code = self.lib.ncclAllReduce(ptr, ptr, tensor.numel(), _BFLOAT16, _SUM, self.comm, stream)
        self._check(code, "ncclAllReduce")


# --- what NCCL writes: its debug log and its error text ------------------------------------------------
_TRANSPORT_RE = re.compile(r"Channel \d+/\d+ : \d+\[\S+\] -> \d+\[\S+\] (?:\[\w+\] )?via (\S+)")
_NCCL_VERSION_RE = re.compile(r"NCCL version (\S+)")
_ALGO_RE = re.compile(r"(\w+): (\d+) Bytes -> Algo (\w+) proto (\w+)")


def nccl_debug_env(workdir: os.PathLike[str] | str, subsys: str = "INIT,ENV,TUNING") -> dict[str, str]:
    """Variables that make NCCL log its transports and algorithm choices to a per-process file."""
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": subsys,
        "NCCL_DEBUG_FILE": os.path.join(os.fspath(workdir), "nccl.%h.%p.log"),
    }


def nccl_log_files(workdir: os.PathLike[str] | str, pid: int | None = None) -> list[str]:
    pid = os.getpid() if pid is None else pid
    root = os.fspath(workdir)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.join(root, n) for n in names if n.startswith("nccl.") and n.endswith(f".{pid}.log")]


def parse_nccl_log(text: str) -> dict[str, Any]:
    """Transports (``P2P/CUMEM``, ``SHM/direct/direct``, ``NET/Socket``...), the NCCL version and
    the algorithm/protocol NCCL chose per collective, as far as the log shows them."""
    transports = sorted(set(_TRANSPORT_RE.findall(text)))
    version = _NCCL_VERSION_RE.search(text)
    algos: dict[str, list[str]] = {}
    for func, _size, algo, proto in _ALGO_RE.findall(text):
        choice = f"{algo}/{proto}"
        seen = algos.setdefault(func, [])
        if choice not in seen:
            seen.append(choice)
    return {
        "transports": transports,
        "nccl_version": version.group(1) if version else "",
        "algorithms": algos,
        "enabled": enable_matrix(text),
    }


def read_nccl_logs(workdir: os.PathLike[str] | str, pid: int | None = None) -> dict[str, Any]:
    text = ""
    for path in nccl_log_files(workdir, pid):
        try:
            with open(path, errors="replace") as f:
                text += f.read()
        except OSError:
            continue
    parsed = parse_nccl_log(text)
    errors = [ln.strip() for ln in text.splitlines() if " WARN " in ln][-5:]
    parsed["warnings"] = errors
    return parsed


ENABLE_MATRIX = "Enabled NCCL Func/Proto/Algo Matrix"  # the INFO line (ENV) NCCL's rank 0 logs when NCCL_ALGO
# or NCCL_PROTO is set, at communicator init, followed by the matrix on lines of their own


def enable_matrix(text: str) -> dict[str, dict[str, int]]:
    """How NCCL parsed NCCL_ALGO (and NCCL_PROTO) at communicator init, as its rank 0 logs it (``NCCL_DEBUG=INFO``,
    subsystem ``ENV``): per collective (``Broadcast``, ``AllReduce``...), each algorithm's enable value (0: off).
    The matrix follows the :data:`ENABLE_MATRIX` line, one row a line: ``Function | <protocols> | <algorithms>``,
    then ``<collective> | <protocol values> | <algorithm values>``. NCCL 2.32.6 logs a fourth section after the
    algorithms, its symmetric kernels (``AllReduce_AGxLL_R`` ...), which run only on registered windows, so no
    collective on ordinary buffers falls back on them: that section is not read, and the last row may be cut short
    inside it (NCCL's log line has a length limit; 2.32.6 on an H100 cut the AllReduce row at 300 characters). It is
    NCCL's reading of the setting, which does not depend on the world size; the last matrix in ``text`` is returned,
    {} when none was logged (2.28.9 logs none)."""
    matrix: dict[str, dict[str, int]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if ENABLE_MATRIX not in line:
            continue
        found: dict[str, dict[str, int]] = {}
        algos: list[str] = []
        for row in lines[i + 1:]:
            parts = row.split("|")
            if "NCCL INFO" in row or len(parts) < 3:
                break
            name = parts[0].strip()
            if name == "Function":
                algos = parts[2].split()
                continue
            values = parts[2].split()
            if not algos or len(values) != len(algos) or not all(v.lstrip("-").isdigit() for v in values):
                break
            found[name] = {a: int(v) for a, v in zip(algos, values, strict=True)}
        matrix = found or matrix
    return matrix


def without_algorithm(matrix: dict[str, dict[str, int]], funcs: tuple[str, ...]) -> list[str]:
    """The collectives of ``funcs`` for which ``matrix`` (:func:`enable_matrix`) enables no algorithm at all; a
    collective the matrix lacks is not counted (the caller checks that it holds each one)."""
    return [f for f in funcs if f in matrix and not any(v > 0 for v in matrix[f].values())]


# Named refusals the NCCL probes recognise in error text (the reason catalogue holds the remediation).
NCCL_ERROR_CODES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("nccl-algo-unavailable", re.compile(r"No algorithm/protocol available|NCCL_ALGO was set to", re.I)),
    (
        "nccl-capture-failed",
        re.compile(
            r"operation not permitted when stream is capturing|during capture|capture.*invalidat"
            r"|cudaErrorStreamCapture|stream is capturing",
            re.I,
        ),
    ),
    ("nccl-invalid-usage", re.compile(r"invalid usage|ncclInvalidUsage", re.I)),
)


def classify_error(text: str) -> str:
    for code, pat in NCCL_ERROR_CODES:
        if pat.search(text):
            return code
    return "nccl-error"

"""NCCL called directly through ctypes, on torch's streams: the path serving engines take in CUDA graphs.

SGLang and vLLM capture their NCCL allreduce through a thin ctypes wrapper (pynccl) rather than
torch.distributed. ar-latency measures this path as its own backend, beside torch.distributed's; on the
2x H200 the two are equal inside a graph (7.5 us per call at 14 KiB on a side stream), and both match
nccl-tests (benchmarks/bench_latency_factors.py).

The communicator is separate from torch's but uses the very library torch loaded (found in
``/proc/self/maps``), so versions cannot differ. In-environment side: stdlib and torch only.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from inenv.kit import _dist

_BFLOAT16 = 9  # ncclDataType_t
_SUM = 0  # ncclRedOp_t


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

    def all_reduce_bf16(self, tensor: Any) -> None:
        """In-place sum on the current torch stream (the capture stream while a graph is captured)."""
        import torch

        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if tensor.dtype != torch.bfloat16:
            raise TypeError(f"all_reduce_bf16 got {tensor.dtype}")
        ptr = tensor.data_ptr()
        code = self.lib.ncclAllReduce(ptr, ptr, tensor.numel(), _BFLOAT16, _SUM, self.comm, stream)
        self._check(code, "ncclAllReduce")

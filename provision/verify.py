"""Compare what the self-check found inside an image with what the cell asked for (pure)."""

from __future__ import annotations

from typing import Any

from packaging.version import InvalidVersion, Version


def _public(v: str) -> str:
    try:
        return Version(v).public
    except InvalidVersion:
        return v


def _release(v: str) -> tuple[int, ...]:
    try:
        return Version(v).release[:3]
    except InvalidVersion:
        return ()


def mismatches(expected: dict[str, Any], facts: dict[str, Any], compiled_toolkit: bool,
               nccl: str = "") -> list[str]:
    """Every way the image differs from its cell; empty when it is what the cell claims. ``nccl``: the NCCL
    release the cell names ("" for torch's own), compared with the one the process loaded (the self-check
    asks the loaded libnccl.so.2: torch.cuda.nccl.version() is the NCCL torch was compiled against)."""
    out: list[str] = []
    cuda = str(expected.get("cuda", ""))
    major = cuda.split(".")[0]
    torch = facts.get("torch") or {}
    if expected.get("torch"):
        if "error" in torch:
            out.append(f"torch does not import: {torch['error']}")
        else:
            if _public(str(torch.get("version"))) != _public(expected["torch"]):
                out.append(f"torch is {torch.get('version')}, the cell asks {expected['torch']}")
            if cuda and torch.get("cuda") != cuda:
                out.append(f"torch.version.cuda is {torch.get('cuda')}, the cell is CUDA {cuda} "
                           "(a registry wheel built for another CUDA?)")
            loaded = str(torch.get("nccl") or "")
            if nccl and not loaded:
                out.append(f"torch's NCCL version cannot be read ({torch.get('nccl_error') or 'no answer'}), "
                           f"the cell asks NCCL {nccl}")
            elif nccl and _release(loaded) != _release(nccl):
                out.append(f"torch loads NCCL {loaded}, the cell asks NCCL {nccl}")
    kernel = facts.get("sgl_kernel") or {}
    want_k = expected.get("sgl_kernel")
    if want_k and want_k != "none":
        if _public(str(kernel.get("version"))) != _public(want_k):
            out.append(f"sgl-kernel is {kernel.get('version') or 'absent'}, the cell asks {want_k}")
        elif major and kernel.get("cudart_major") and kernel["cudart_major"] != [major]:
            out.append(f"sgl-kernel links libcudart.so.{'/'.join(kernel['cudart_major'])}, the cell is CUDA {cuda}")
    fi = facts.get("flashinfer") or {}
    want_f = expected.get("flashinfer")
    if want_f and want_f != "none" and _public(str(fi.get("version"))) != _public(want_f):
        out.append(f"flashinfer-python is {fi.get('version') or 'absent'}, the cell asks {want_f}")
    want_e = str(expected.get("engine") or "")
    if want_e:
        name, _, version = want_e.partition("==")
        have = (facts.get("engines") or {}).get(name)
        if have is None or _public(str(have)) != _public(version):
            out.append(f"{name} is {have or 'absent'}, the cell asks {version}")
    tk = facts.get("toolkit") or {}
    if compiled_toolkit:
        if tk.get("error") or not tk.get("nvcc"):
            out.append(f"no working nvcc in CUDA_HOME: {tk.get('error') or 'not found'}")
        else:
            if cuda and tk["nvcc"] != cuda:
                out.append(f"nvcc is CUDA {tk['nvcc']}, the cell is CUDA {cuda}")
            if tk.get("compile_sm_120a", "ok") != "ok":
                out.append(f"nvcc cannot compile for sm_120a: {tk['compile_sm_120a']}")
    return out

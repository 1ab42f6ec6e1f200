"""What NCCL writes: its debug log (transports, version, chosen algorithms) and its error text (reason codes).

In-environment side: standard library only.
"""

from __future__ import annotations

import os
import re
from typing import Any

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

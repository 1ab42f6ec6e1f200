"""What a cell's carried kernel set is, module by module: a digest per carried flashinfer comm module, for
`checks run` to tell whether a result made with a module still answers (checks.run.incremental).

A variant's verdict depends on the carried modules it loads and on nothing else of the set: installing the
long modules after the quick pass changes nothing a variant that loads none of them (inventory, engine, NCCL)
answered. So the set is not part of the environment's one fingerprint; each module is digested apart, and a
variant's inputs name the digests of the modules it loads.

A module's digest covers its record (which flashinfer, torch, nvcc and sources built it, for which targets) and
its library's bytes, read as :mod:`inenv.kit._carried` reads the set: only the modules its reader accepts
(plain files, our record, flashinfer's entry points), nothing followed through a link.

In-environment side: standard library only. ``python -c "import inenv.kernelprint as k; print(k.installed())"``
in the cell's interpreter reads the set flashinfer loads there.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from inenv.kit import _carried

DIGEST_CHARS = 16
ABSENT = "none"  # the digest a variant's inputs give a module its cell does not carry


def module_digest(carried: _carried.Carried) -> str:
    """The digest of one carried module: its record (canonical JSON) and its library's bytes."""
    h = hashlib.sha256(json.dumps(dict(carried.record), sort_keys=True, default=str).encode())
    h.update(b"\0")
    h.update(_carried.read_bytes(carried.library, _carried.MAX_LIBRARY_BYTES) or b"unreadable")
    return h.hexdigest()[:DIGEST_CHARS]


def module_digests(folder: Path | None) -> dict[str, str]:
    """Module -> digest for every module of a kernel-set folder its reader accepts; {} for none or no folder."""
    return {module: module_digest(c) for module, c in sorted(_carried.kernel_set(folder).items())}


def installed() -> dict[str, str]:
    """The digests of the set installed where flashinfer loads ahead-of-time modules in this environment."""
    return module_digests(_carried.aot_dir())

"""Build several comm modules at once, longest first, into the shared compile cache, and publish each one
that loads for the GPU probes.

Run as ``python -m inenv.probes.fiprebuild MODULE...`` in the environment a build runs in (the arch list,
the JIT workspace and the compile cache already set). fi-jit's first variant for the local GPU starts it
for the cell's other local modules and waits for it before it ends: each build holds its key in the compile cache
(``_compile_cache.building``), so the variant of that module, when its turn comes, waits for the build
already running and finds its library, and the modules compile side by side on a host with the cores for it
instead of one variant after another. Each build also loads its library on the GPU, as a probe would, and a
library that loaded is published where the GPU probes read it (``_flashinfer.publish``): a quick run, which
runs fi-jit's smallest module only, gives its GPU probes every module without one of them compiling in its
turn. The order: the longest first, by what the compile cache recorded for the module (its ``compile_s``),
else by the bytes of the sources its ninja file compiles.

Not a probe (no SPEC): a part of fi-jit, which imports it and carries it in its hash. In-environment side:
standard library at import time; flashinfer is imported inside functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from inenv.kit import _compile_cache, _fi_build
from inenv.kit._flashinfer import JIT_GENERATORS, jit_generator, mark_published, publish

# A build's own limit; the variant that started the builds stops them sooner, at its watchdog.
BUILD_LIMIT_S = 4 * 3600.0


def recorded_s(store: Path | None, module: str, arch_list: str) -> float | None:
    """The longest compile the store recorded for ``module`` built for ``arch_list``; None when none."""
    if store is None or not store.is_dir():
        return None
    seen: list[float] = []
    for record in store.glob(f"*/*/{_compile_cache.RECORD}"):
        try:
            body = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        took = body.get("compile_s") if isinstance(body, dict) else None
        if body.get("module") == module and body.get("arch_list") == arch_list and isinstance(took, int | float):
            seen.append(float(took))
    return max(seen) if seen else None


def source_bytes(module: str) -> int:
    """The bytes of the sources the module's ninja file compiles (0 when flashinfer cannot say)."""
    gen = jit_generator(module)
    try:
        spec = gen() if gen is not None else None
        return sum(os.path.getsize(s) for s in getattr(spec, "sources", []) or [] if os.path.isfile(s))
    except Exception:
        return 0


# The comm modules' local builds, longest first, as measured (1x H100, 16 cores, sm_90a, flashinfer 0.7.4:
# trtllm_comm 280-330 s of compiling, moe_a2a 75 s, vllm_comm about 17 s, pcie_ipc_ag_rs 15 s, pcie_ipc 11 s).
# Source bytes do not predict it: moe_a2a's sources are several times trtllm_comm's three files, whose fusion
# kernels' templates make the long compile.
MEASURED_ORDER = ("trtllm_comm", "moe_a2a", "vllm_comm", "pcie_ipc_ag_rs", "pcie_ipc")


def longest_first(modules: list[str], recorded: Mapping[str, float | None], sizes: Mapping[str, int]) -> list[str]:
    """Modules with a recorded time first, longest first; then those of :data:`MEASURED_ORDER` in its order (a
    build measured on a GPU host is the better guess); then any other by source bytes, largest first (a recorded
    time and a byte count are not on one scale)."""
    known = {m: i for i, m in enumerate(MEASURED_ORDER)}
    timed = sorted((m for m in modules if recorded.get(m) is not None), key=lambda m: -float(recorded[m] or 0))
    measured = sorted((m for m in modules if recorded.get(m) is None and m in known), key=lambda m: known[m])
    rest = sorted((m for m in modules if recorded.get(m) is None and m not in known), key=lambda m: -sizes.get(m, 0))
    return timed + measured + rest


def longest(modules: list[str], arch_list: str = "local") -> str:
    """The module of ``modules`` whose build should take longest here (:func:`longest_first`'s first)."""
    store = _compile_cache.root()
    return longest_first(modules, {m: recorded_s(store, m, arch_list) for m in modules},
                         {m: source_bytes(m) for m in modules})[0]


def publish_loaded(module: str, result: Mapping[str, Any]) -> str | None:
    """Publish the library of a build that finished and loaded on this GPU for the cell's GPU probes, and mark
    it by the module's name for the host (``_flashinfer.unpublished``); where it went, or None when the build
    did not load or there is nowhere to publish."""
    if not (result.get("ok") and result.get("loaded")):
        return None
    where = publish(str(result.get("name") or module), str(result.get("library") or ""), result.get("flashinfer"),
                    str(result.get("arch_dir") or ""))
    if where:
        mark_published(module, where)
    return where


def build_and_publish(order: list[str], env: Mapping[str, str]) -> dict[str, str | None]:
    """Build every module of ``order`` side by side (each in its own interpreter, started in that order) with
    a load, and publish each one that loaded as it finishes; module -> where it was published, or None."""
    def one(module: str) -> str | None:
        result = _fi_build.run_build_subprocess(module, dict(env), timeout_s=BUILD_LIMIT_S, load=True)
        return publish_loaded(module, result)

    with ThreadPoolExecutor(max_workers=max(1, len(order))) as pool:
        futures = {m: pool.submit(one, m) for m in order}
    return {m: f.result() for m, f in futures.items()}


def start(modules: list[str], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    """Start this module's main in the background, or None when it could not start. Its output goes nowhere:
    each build's result is read from the compile cache by that module's variant, and each published
    library from the cell's prebuilt folder."""
    try:
        return subprocess.Popen([sys.executable, "-m", "inenv.probes.fiprebuild", *modules], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None


def _main(argv: list[str]) -> int:
    modules = [m for m in argv if m in JIT_GENERATORS]
    if not modules or len(modules) != len(argv):
        sys.stderr.write("usage: python -m inenv.probes.fiprebuild MODULE...\n")
        return 2
    import flashinfer  # noqa: F401  (fixes the arch list from the environment, as each build will)

    store = _compile_cache.root()
    arch_list = os.environ.get("FLASHINFER_CUDA_ARCH_LIST") or "local"
    order = longest_first(modules, {m: recorded_s(store, m, arch_list) for m in modules},
                          {m: source_bytes(m) for m in modules})
    published = build_and_publish(order, os.environ)
    return 0 if all(published.values()) else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

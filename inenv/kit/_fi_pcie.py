"""flashinfer's PCIe IPC collectives (flashinfer >= 0.7): the all-reduce workspace with its launch policy and
per-machine tuning, and the all-gather / reduce-scatter workspaces, behind one small interface.

Facts the probes rely on, from flashinfer's own contract:

- Every collective call is collective and must be issued identically on every rank (same shape, same launch
  configuration), or the group hangs. So every call here passes an explicit configuration that all ranks
  derived the same way (the seed is a pure function of shape and world size; tuned ones are agreed by
  flashinfer with a collective when resolved, eagerly).
- A workspace binds to the first stream that runs it and rejects another one; a caller that has ordered the
  streams (synchronised) says so with ``rebind_stream``. Calls recorded in a CUDA graph capture are exempt.
- A shape the kernels cannot run gets no configuration (``None``) and the call raises ``ValueError`` with
  flashinfer's own words, on every rank alike, before any collective step.

In-environment side: standard library at import time; torch and flashinfer inside functions.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inenv.kit import _api
from inenv.kit import _flashinfer as fi

PACKAGE = "flashinfer-python"
DISTRIBUTIONS = ("flashinfer-python", "flashinfer")
OPS = ("all-reduce", "all-gather", "reduce-scatter")
_GENERATIONS: dict[str, _api.Generation] = {
    "all-reduce": _api.Generation(
        "pcie-ipc all-reduce",
        ("flashinfer.comm:PcieIpcAllReduceWorkspace", "flashinfer.comm.pcie_ipc_policy:get_pcie_ipc_launch_config"),
    ),
    "all-gather": _api.Generation("pcie-ipc all-gather", ("flashinfer.comm:PcieIpcAllGatherWorkspace",)),
    "reduce-scatter": _api.Generation("pcie-ipc reduce-scatter", ("flashinfer.comm:PcieIpcReduceScatterWorkspace",)),
}


def detect(op: str) -> _api.Generation | _api.ApiUnknown:
    return _api.detect((_GENERATIONS[op],), PACKAGE, DISTRIBUTIONS)


def unknown_without_import(op: str) -> _api.ApiUnknown | None:
    """What ``detect(op)`` answers when flashinfer's files alone show that the op's API is not there; None
    when they do not (then the ranks import and detect).

    ``detect`` resolves every name by importing it, so a name cannot resolve when its module has no file
    (nor package folder, nor extension) or when its attribute is spelt in none of the package's Python
    sources. Reading them takes tens of milliseconds where importing flashinfer costs each rank seconds,
    so a variant whose flashinfer predates the API is decided before any rank starts. A module folder that
    holds an extension (whose names need no source line) is left to ``detect``."""
    root = fi.package_root()
    if root is None:
        return None  # not installed: the ranks report that as they always did
    needs = _GENERATIONS[op].needs
    missing_attrs: list[str] = []
    first = root
    for name in needs:
        module, _, attr = name.partition(":")
        where = _module_file(root, module)
        if where is None:
            return _api.ApiUnknown(PACKAGE, _api.package_version(*DISTRIBUTIONS), needs)
        if attr:
            if where == "" or any(where.parent.glob("*.so")):
                return None  # an extension module, or cannot tell
            missing_attrs.append(attr.split(".")[0])
            first = where.parent
    if missing_attrs and _spelt_nowhere(root, missing_attrs, first):
        return _api.ApiUnknown(PACKAGE, _api.package_version(*DISTRIBUTIONS), needs)
    return None


def _module_file(root: Path, module: str) -> Path | str | None:
    """The source file of ``module`` (a dotted name under flashinfer) found without importing anything,
    None when it certainly does not exist, "" when that cannot be told from the files."""
    parts = module.split(".")[1:]
    folder = root
    found: Path | None = root / "__init__.py"
    for i, part in enumerate(parts):
        if not folder.is_dir():
            return ""  # a parent that is a plain module could still provide it
        sub = importlib.machinery.PathFinder.find_spec(".".join(module.split(".")[: i + 2]), [str(folder)])
        if sub is None:
            return None
        if sub.origin is None or not sub.origin.endswith(".py"):
            return ""  # a namespace package or an extension module
        found = Path(sub.origin)
        folder = found.parent if found.name == "__init__.py" else folder / part
    return found


def _spelt_nowhere(root: Path, names: list[str], first: Path) -> bool:
    """Whether some name in ``names`` appears in none of the Python sources under ``root``; the folder
    ``first`` (where the attribute's module lives, so where a name that exists is usually spelt) is read first."""
    found = fi.names_in_sources(names, root, first)
    return found is not None and bool(set(names) - found)


def describe(config: Any) -> dict[str, Any] | None:
    """A launch configuration as JSON (the variant by its name: it names the kernel)."""
    if config is None:
        return None
    variant = config.variant
    return {
        "blocks": int(config.blocks),
        "threads": int(config.threads),
        "variant": getattr(variant, "name", str(variant)),
    }


@dataclass(frozen=True)
class Refusal:
    """flashinfer declined a shape: its own message."""

    message: str


class Collective:
    """One PCIe IPC workspace for one op. ``run(inp, out, config)`` issues one call with that configuration."""

    def __init__(
        self,
        op: str,
        group: Any,
        max_numel: int,
        tune_cache: str | None = None,
        tune_batches: tuple[int, ...] | None = None,
    ) -> None:
        """``tune_cache`` None: flashinfer's own per-machine file (what a server would load); ``tune_batches``
        None: the batch ladder flashinfer derives from ``max_numel``."""
        import flashinfer.comm as comm
        import torch

        self.op = op
        if op == "all-reduce":
            self.ws = comm.PcieIpcAllReduceWorkspace(
                group=group, max_numel=max_numel, dtype=torch.bfloat16, tune_cache=tune_cache, tune_batches=tune_batches
            )
        elif op == "all-gather":
            self.ws = comm.PcieIpcAllGatherWorkspace(group=group, max_numel=max_numel, dtype=torch.bfloat16)
        else:
            self.ws = comm.PcieIpcReduceScatterWorkspace(group=group, max_numel=max_numel, dtype=torch.bfloat16)

    def evidence(self) -> dict[str, Any]:
        ws = self.ws
        out: dict[str, Any] = {}
        for name in (
            "profile",
            "profile_reason",
            "memop_supported",
            "slow_hops",
            "ordered_4plus4",
            "ordered_4plus4_reason",
            "max_numel",
            "max_blocks",
        ):
            with contextlib.suppress(Exception):
                value = getattr(ws, name)
                if isinstance(value, (bool, int, str)):
                    out[name] = value
        return out

    def seed(self, inp: Any) -> Any:
        """flashinfer's seed configuration for ``inp`` (None: it cannot run this shape)."""
        return self.ws.launch_config(inp)

    def resolved(self, inp: Any) -> Any:
        """The configuration flashinfer itself would use now (tuned when a measurement exists). Collective
        for the all-reduce the first time a shape is seen: call eagerly, on every rank."""
        return self.ws.tuned_launch_config(inp)

    def run(self, inp: Any, out: Any, config: Any) -> None:
        import torch

        if not torch.cuda.is_current_stream_capturing():
            self.ws.rebind_stream()  # callers order their streams (sync or capture's own wait) before switching
        if self.op == "all-reduce":
            self.ws.all_reduce(inp, out=out, config=config)
        elif self.op == "all-gather":
            self.ws.all_gather(inp, out=out, config=config)
        else:
            self.ws.reduce_scatter(inp, out=out, config=config)

    def refusal(self, inp: Any, out: Any) -> Refusal | None:
        """Ask flashinfer to run a shape it has no configuration for; its error message, or None if it ran."""
        try:
            self.run(inp, out, None)
        except ValueError as exc:
            return Refusal(str(exc))
        return None

    def tune(self, hiddens: tuple[int, ...]) -> dict[str, Any]:
        """The all-reduce's per-machine tuning (collective). Returns ``{"BATCHxHIDDEN": config}`` as measured."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # it warns when a shape it was asked about is not admitted
            tuned = self.ws.tune(list(hiddens))
        return {f"{batch}x{hidden}": describe(cfg) for (hidden, batch), cfg in tuned.items()}

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.destroy()

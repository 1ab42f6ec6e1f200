"""engine: the gates a serving engine installed in the cell puts on its allreduce backends, read from the
engine's own modules.

SGLang and vLLM decide per host which allreduce path runs: a custom allreduce only at the world sizes its
class lists, symmetric memory only up to a per-architecture size table, PCIe IPC only at some world sizes.
Those rules are data in the engine's modules. This probe imports each module the engine defines the data
in and records the values as the engine holds them (keys as the engine spells them: vLLM keys its tables
by ``"major.minor"``, SGLang by the major as an integer). Nothing here restates an engine's rule: a value
the release does not define where this probe looks is recorded as not found, with the module and name,
so a moved gate is a visible fact instead of a guess. It reads no GPU, so a GPU-less host records the gates
for every architecture the tables name, and the host side compares them with a GPU host's facts. Where the
engine has a function that applies a gate table (FUNCTIONS), the probe calls it at each compute capability
and records the engine's own answer per tp; a release without that function has nothing to ask there.

One variant per engine. The engine absent from the cell: ``skip`` (missing-package). Its top-level package
failing to import: ``fail`` (engine-import-error), since a user of that cell cannot start it either. A gate
module that cannot be imported here (one needing the CUDA driver on a host without one, or one that calls
``sys.exit`` at import), a name the release does not define, or an attribute whose access raises: ``partial``,
naming each gate and why, with every other gate still recorded. A Ctrl-C stops the run as anywhere else.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import sys
from dataclasses import dataclass
from typing import Any

from inenv.probe import HostView, ProbeSpec, RankContext, Variant, outcome

SPEC = ProbeSpec(
    id="engine",
    title="Engine allreduce gates",
    feature="Which allreduce backends will SGLang or vLLM itself use on my GPUs at my tensor-parallel size: "
    "the world sizes and per-architecture message-size limits its own modules hold?",
    ranks=(1,),
    needs_gpu=False,
    timeout_s=240.0,
)


@dataclass(frozen=True)
class Gate:
    """One piece of an engine's backend rule: where it lives and what it limits."""

    name: str  # the id results use, one meaning for every engine
    module: str
    attribute: str  # dotted inside the module: "CustomAllreduce._SUPPORTED_WORLD_SIZES"
    backend: str  # the stackprobe backend it gates (ar-latency's names)


# gate -> the stackprobe backend it gates, the same for every engine. What each holds:
# custom-ar-world-sizes, pcie-ipc-world-sizes: the world sizes that allreduce accepts;
# custom-ar-max-bytes, symm-mem-max-bytes: its largest message in bytes (per compute capability and world size,
# or one limit); symm-mem-multimem-world-sizes: the world sizes that use the multimem (multicast) kernel, per
# compute capability.
BACKEND = {"custom-ar-world-sizes": "custom-ar", "custom-ar-max-bytes": "custom-ar", "symm-mem-max-bytes": "symm-mem",
           "symm-mem-multimem-world-sizes": "symm-mem", "pcie-ipc-world-sizes": "pcie-ipc"}
# engine -> (its distribution, the package its gates live under, gate -> (module, attribute) there)
WHERE: dict[str, tuple[str, str, dict[str, tuple[str, str]]]] = {
    "vllm": ("vllm", "vllm.distributed.device_communicators", {
        "custom-ar-world-sizes": ("custom_all_reduce", "CustomAllreduce._SUPPORTED_WORLD_SIZES"),
        "custom-ar-max-bytes": ("all_reduce_utils", "CUSTOM_ALL_REDUCE_MAX_SIZES"),
        "symm-mem-max-bytes": ("all_reduce_utils", "SYMM_MEM_ALL_REDUCE_MAX_SIZES"),
        "symm-mem-multimem-world-sizes": ("symm_mem", "SymmMemCommunicator._WORLD_SIZES_MULTIMEM"),
        "pcie-ipc-world-sizes": ("flashinfer_pcie_ipc_all_reduce", "_SUPPORTED_WORLD_SIZES"),
    }),
    "sglang": ("sglang", "sglang.srt.distributed.device_communicators", {
        "custom-ar-world-sizes": ("custom_all_reduce", "CustomAllreduce._SUPPORTED_WORLD_SIZES"),
        "custom-ar-max-bytes": ("custom_all_reduce", "CustomAllreduce._MAX_CAR_SIZE"),
        "symm-mem-max-bytes": ("all_reduce_utils", "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES"),
        "symm-mem-multimem-world-sizes": ("torch_symm_mem", "TorchSymmMemCommunicator._WORLD_SIZES_MULTIMEM"),
        "pcie-ipc-world-sizes": ("pcie_ipc_ar", "_SUPPORTED_WORLD_SIZES"),
    }),
}
# Functions of an engine's that apply one of its gate tables, where the engine has one: engine -> answer id ->
# (module, function, the stackprobe backend it gates). Each answers for the GPU torch reports, so the probe asks
# it at every capability below (torch's answer substituted for the call) and records the world sizes it admits.
# vLLM 0.33.0 has none: its gates are applied inside its communicators' constructors, which need a process group.
FUNCTIONS: dict[str, dict[str, tuple[str, str, str]]] = {
    "sglang": {
        # CustomAllReduceV2, SGLang's custom allreduce on CUDA: the world sizes its per-architecture table holds
        "custom-ar-v2-world-sizes": ("sglang.srt.distributed.device_communicators.configs.custom_all_reduce_v2",
                                     "get_supported_world_sizes", "custom-ar"),
    },
}
# The compute capabilities an engine function is asked at (with the GPU's own, where there is one), and the tp
# sizes its answer is recorded for.
CAPABILITIES = ("8.0", "8.6", "8.9", "9.0", "10.0", "10.3", "10.7", "11.0", "12.0", "12.1")
TPS = tuple(range(2, 9))
ENGINES: dict[str, tuple[str, tuple[Gate, ...]]] = {  # engine -> (distribution, its gates)
    engine: (dist, tuple(Gate(name, f"{package}.{module}", attr, BACKEND[name])
                         for name, (module, attr) in where.items()))
    for engine, (dist, package, where) in WHERE.items()
}


def variants(host: HostView) -> list[Variant]:
    return [Variant(SPEC.id, 1, (("engine", name),)) for name in ENGINES]


def plain(value: Any, depth: int = 0) -> Any:
    """The engine's value as JSON: mapping keys as strings (the engine's spelling kept: ``9`` -> ``"9"``),
    tuples and sets as lists, numbers and strings as they are; anything else as its repr, so a type this
    probe did not expect is recorded instead of dropped."""
    if depth > 6:
        return repr(value)
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v, depth + 1) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((plain(v, depth + 1) for v in value), key=repr)
    return repr(value)


def key_kind(value: Any) -> str | None:
    """How a table's keys are spelled: ``int`` (compute capability major), ``str`` ("major.minor"), or None
    for a value that is not a table."""
    if not isinstance(value, dict) or not value:
        return None
    kinds = {type(k).__name__ for k in value}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _one_line(exc: BaseException) -> str:
    try:
        text = str(exc).strip().splitlines()
    except Exception:  # an exception whose own text raises: its type is what is left to say
        text = ["(its message could not be read)"]
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _interrupt(exc: BaseException) -> bool:
    """A Ctrl-C (or a generator closing): what stops the run, never a fact about one gate."""
    return isinstance(exc, KeyboardInterrupt | GeneratorExit)


def read_gate(gate: Gate) -> dict[str, Any]:
    """The gate's value as the engine holds it, or why it could not be read. Whatever an engine module does
    at import or on an attribute's access (an error, ``sys.exit``) is recorded against this gate alone; a
    Ctrl-C is re-raised."""
    where = f"{gate.module}:{gate.attribute}"
    try:
        obj: Any = importlib.import_module(gate.module)
    except BaseException as exc:  # the engine module's own import error (or exit) is the fact recorded
        if _interrupt(exc):
            raise
        return {"found": False, "where": where, "why": f"import {gate.module} failed: {_one_line(exc)}",
                "kind": "import"}
    for part in gate.attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return {"found": False, "where": where, "kind": "absent",
                    "why": f"{gate.module} defines no {gate.attribute} in this release"}
        except BaseException as exc:  # a property or module __getattr__ of the engine's that raises or exits
            if _interrupt(exc):
                raise
            return {"found": False, "where": where, "kind": "access",
                    "why": f"reading {gate.attribute} raised {_one_line(exc)}"}
    try:
        out: dict[str, Any] = {"found": True, "where": where, "value": plain(obj)}
        kind = key_kind(obj)
    except BaseException as exc:  # a value whose iteration or repr raises: unreadable, said so
        if _interrupt(exc):
            raise
        return {"found": False, "where": where, "kind": "access",
                "why": f"reading the value of {gate.attribute} raised {_one_line(exc)}"}
    if kind is not None:
        out["keys"] = kind
    return out


def _gpu(ctx: RankContext) -> tuple[str, int] | None:
    """(compute capability, SM count) of this rank's GPU, or None without one (or without torch)."""
    if ctx.device_index is None:
        return None
    try:
        import torch

        p = torch.cuda.get_device_properties(ctx.device_index)
        return f"{p.major}.{p.minor}", int(p.multi_processor_count)
    except Exception:
        return None


def ask(module: str, function: str, capabilities: tuple[str, ...], sm_count: int) -> dict[str, Any]:
    """The engine function's answer at each capability: the world sizes it returns and, per tp in TPS, whether
    it admits that size. The function reads the GPU from torch.cuda; for each call torch's two answers
    (capability, and the properties the function reads the SM count from) are the capability asked and
    ``sm_count``. The module's cached functions (functools) are cleared before each call and after the last, so
    no answer leaks from one capability into the next, nor a substituted one into the engine's caches."""
    where = f"{module}:{function}"
    try:
        mod = importlib.import_module(module)
        fn = getattr(mod, function)
        import torch
    except BaseException as exc:
        if _interrupt(exc):
            raise
        # a release without the function (its module or name absent) has that rule nowhere to ask: not a failure
        absent = isinstance(exc, AttributeError) or (
            isinstance(exc, ModuleNotFoundError) and bool(exc.name) and module.startswith(str(exc.name)))
        return {"found": False, "where": where, "kind": "absent" if absent else "import",
                "why": f"{where} could not be read: {_one_line(exc)}"}
    from types import SimpleNamespace
    from unittest import mock

    caches = [f for f in vars(mod).values() if callable(getattr(f, "cache_clear", None))]
    at: dict[str, Any] = {}
    try:
        for cap in capabilities:
            major, minor = (int(x) for x in cap.split("."))
            props = SimpleNamespace(major=major, minor=minor, multi_processor_count=sm_count,
                                    name=f"sm_{major}{minor}")
            try:
                for f in caches:
                    f.cache_clear()
                with mock.patch.object(torch.cuda, "get_device_capability", return_value=(major, minor)), \
                        mock.patch.object(torch.cuda, "get_device_properties", return_value=props):
                    answer = fn()
                sizes = sorted(int(n) for n in answer)
            except BaseException as exc:
                if _interrupt(exc):
                    raise
                at[cap] = {"why": _one_line(exc)}
                continue
            at[cap] = {"world_sizes": sizes, "admits": {str(n): n in sizes for n in TPS}}
    finally:
        for f in caches:
            f.cache_clear()
    return {"found": True, "where": where, "sm_count": sm_count, "at": at}


def answers(name: str, ctx: RankContext) -> dict[str, Any]:
    """Every gate function the engine has (FUNCTIONS), asked at CAPABILITIES and this GPU's own."""
    gpu = _gpu(ctx)
    caps = tuple(dict.fromkeys((*CAPABILITIES, *((gpu[0],) if gpu else ()))))
    return {aid: ask(module, function, caps, gpu[1] if gpu else 1) | {"backend": backend}
            for aid, (module, function, backend) in FUNCTIONS.get(name, {}).items()}


def run(ctx: RankContext) -> dict[str, Any]:
    name = ctx.param("engine", "") or ""
    if name not in ENGINES:
        return outcome("fail", f"unknown engine {name!r}; known: {', '.join(ENGINES)}", "probe-bug")
    dist, gates = ENGINES[name]
    try:
        version = md.version(dist)
    except md.PackageNotFoundError:
        return outcome("skip", f"{dist} is not installed in this cell", "missing-package")
    evidence: dict[str, Any] = {"engine": name, "version": version, "python": sys.version.split()[0]}
    try:
        importlib.import_module(name)
    except BaseException as exc:  # the engine's own package does not import: a user of this cell cannot start it
        if _interrupt(exc):
            raise
        evidence["import_error"] = _one_line(exc)
        return outcome("fail", f"import {name} ({dist} {version}) failed: {_one_line(exc)}",
                       "engine-import-error", {"gates_read": 0}, evidence)
    read = {g.name: read_gate(g) | {"backend": g.backend} for g in gates}
    evidence["gates"] = read
    evidence["answers"] = answers(name, ctx)
    found = [g for g in gates if read[g.name]["found"]]
    metrics = {"gates_read": len(found), "headline": f"{dist} {version}: {len(found)} of {len(gates)} gates read"}
    missing = [g for g in gates if not read[g.name]["found"]]
    unanswered = _unanswered(evidence["answers"])
    if not missing and not unanswered:
        return outcome("pass", metrics=metrics, evidence=evidence)
    moved = [g for g in missing if read[g.name]["kind"] == "absent"]
    parts = [f"{g.name}: {read[g.name]['why']}" for g in missing] + unanswered
    code = "engine-gate-moved" if len(moved) == len(missing) and not unanswered else "engine-gate-unread"
    return outcome("partial", f"{dist} {version}: " + "; ".join(parts), code, metrics, evidence)


def _unanswered(asked: dict[str, Any]) -> list[str]:
    """One line per engine function that could not be read, or gave no answer at some capability."""
    out = []
    for aid, ans in asked.items():
        if not ans.get("found"):
            if ans.get("kind") != "absent":
                out.append(f"{aid}: {ans.get('why')}")
            continue
        failed = {cap: a["why"] for cap, a in ans["at"].items() if "why" in a}
        if failed:
            first = next(iter(failed.values()))
            out.append(f"{aid}: {ans['where']} gave no answer at {', '.join(failed)} ({first})")
    return out


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("headline", "text", "the engine, its version and how many of its gates were read", "headline"),
    ("gates_read", "count", "gates whose value the engine's modules gave", None),
)
EVIDENCE = (
    ("engine", "text", "the engine this variant read", None),
    ("version", "text", "the engine's installed version", None),
    ("gates", "record", "per gate: where it lives, whether it was found, the value as the engine holds it, how "
     "its table keys are spelled, the backend it gates", None),
    ("answers", "record", "per gate function the engine has: the function, and at each compute capability the "
     "world sizes it returned and whether it admits each tp from 2 to 8 (or why it could not answer)", None),
    ("import_error", "text", "the engine's own import error, when its package does not import", None),
)
# (param, value, distributions): a variant with that param value skips at once (missing-package) in a cell without
# those distributions; the host costs such a variant as a skip where the cell's build record lists what it holds
DISTRIBUTIONS = tuple(("engine", name, (dist,)) for name, (dist, _gates) in ENGINES.items())

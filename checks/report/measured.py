"""The measured step: a model's decode and verify step per allreduce backend as the ``step`` probe timed it on
one host, cell and rank count, ranked by the step time, and set beside the estimate (pure).

The probe times one CUDA graph per case holding every layer's row-parallel blocks (matmul, allreduce, residual
add, RMSNorm) and the same graph without the allreduce; it keys its cases ``decode:<batch>`` and
``verify:<batch>x<draft>`` (each sequence verifies 1 + draft tokens). `checks advise` counts the tokens each
sequence verifies in ``--draft``, so its verify step is the probe's ``verify:<batch>x<draft - 1>``.

Only results of ranks on GPUs of their own count: ranks sharing a GPU are checked, never timed. A backend that
launched NCCL's kernels instead of its own at a case is shown with that fact, never as its own speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checks.results.result import ProbeResult
from inenv.status import Status

STEP_PROBE = "step"
DISAGREE = 0.05  # the measured steps of two backends closer than this are a tie, whatever the estimate says


def case_keys(batch: int, draft: int) -> tuple[str, str]:
    """(decode, verify) case keys of the step probe for ``--batch`` and ``--draft`` (tokens verified per
    sequence, so draft tokens = draft - 1)."""
    return f"decode:{batch}", f"verify:{batch}x{max(draft - 1, 0)}"


@dataclass(frozen=True)
class StepTime:
    step_us: float
    baseline_us: float
    comm_share: float
    per_allreduce_us: float
    kernels: tuple[str, ...]  # the communication kernels the backend's graph launched (short names)
    fell_back: bool  # a non-NCCL backend whose graph launched NCCL's kernels


@dataclass(frozen=True)
class MeasuredRow:
    backend: str
    status: str
    decode: StepTime | None
    verify: StepTime | None
    ids: tuple[str, ...]
    comm_only_us: float | None = None  # one allreduce of the decode step's size, the step's calls back to back
    decode_bytes: int | None = None  # that allreduce's message bytes


@dataclass(frozen=True)
class Measured:
    model: str
    ranks: int
    batch: int
    draft: int
    cell_id: str
    rows: tuple[MeasuredRow, ...]  # fastest decode step first; rows without one last
    measured_cases: tuple[str, ...]  # every case key some backend timed, for "not measured at this batch"
    verdict: str  # how the ranking compares with the estimate's: agree | disagree | no-estimate
    estimated_fastest: str = ""  # the estimate's fastest decode backend among those measured ("": none)


def _num(obj: Any, *keys: str) -> float | None:
    for k in keys:
        obj = obj.get(k) if isinstance(obj, Mapping) else None
    return float(obj) if isinstance(obj, int | float) and not isinstance(obj, bool) else None


def short_kernel(name: str) -> str:
    """A kernel's name without its template arguments and parameter list (``cross_device_reduce_1stage``)."""
    head = name.replace("(anonymous namespace)::", "").split("(", 1)[0].split("<", 1)[0].strip()
    return head.rsplit("::", 1)[-1].split()[-1] if head else name[:60]


def _time(r: ProbeResult, model: str, key: str) -> StepTime | None:
    m = r.verdict.metrics
    step, base = _num(m, "step_us", model, key), _num(m, "baseline_us", model, key)
    if step is None or base is None:
        return None
    case = r.verdict.evidence.get("per_case", {})
    case = case.get(model, {}).get(key, {}) if isinstance(case, Mapping) and isinstance(case.get(model), Mapping) \
        else {}
    launched = case.get("launched", {}) if isinstance(case, Mapping) else {}
    kernels = launched.get("kernels", {}) if isinstance(launched, Mapping) else {}
    names = tuple(sorted({short_kernel(str(k)) for k in kernels})) if isinstance(kernels, Mapping) else ()
    share, per_ar = _num(m, "comm_share", model, key) or 0.0, _num(m, "per_allreduce_us", model, key) or 0.0
    return StepTime(step, base, share, per_ar, names,
                    bool(launched.get("nccl")) if isinstance(launched, Mapping) else False)


def measured(results: Iterable[ProbeResult], cell_id: str, ranks: int, model: str, batch: int, draft: int,
             estimated_order: Sequence[str] | None = None) -> Measured | None:
    """The step probe's timed results for this cell, rank count and model; None when it timed none.
    ``estimated_order``: the backends as the estimate ranks them (fastest decode first), to compare with."""
    dec_key, ver_key = case_keys(batch, draft)
    rows: list[MeasuredRow] = []
    cases: set[str] = set()
    for r in results:
        if (r.probe_id != STEP_PROBE or r.cell_id != cell_id or r.ranks != ranks or r.shared_gpu
                or r.verdict.status not in (Status.PASS, Status.PARTIAL)):
            continue
        per_model = r.verdict.metrics.get("step_us")
        timed = per_model.get(model) if isinstance(per_model, Mapping) else None
        if not isinstance(timed, Mapping) or not timed:
            continue
        cases.update(str(k) for k in timed)
        backend = r.params.get("backend", "?")
        models = r.verdict.evidence.get("models")
        hidden = _num(models, model, "hidden") if isinstance(models, Mapping) else None
        comm = _num(r.verdict.metrics, "comm_only_us", model, dec_key)
        rows.append(MeasuredRow(backend, r.verdict.status.value, _time(r, model, dec_key), _time(r, model, ver_key),
                                (r.result_id,), comm, int(hidden) * batch * 2 if hidden else None))
    if not rows:
        return None
    rows.sort(key=lambda x: (x.decode is None or x.decode.fell_back, x.decode.step_us if x.decode else 0.0, x.backend))
    verdict, estimated = compare(rows, estimated_order)
    return Measured(model, ranks, batch, draft, cell_id, tuple(rows), tuple(sorted(cases)), verdict, estimated)


def compare(rows: Sequence[MeasuredRow], estimated_order: Sequence[str] | None) -> tuple[str, str]:
    """(verdict, the backend compared): ``agree`` when the estimate's fastest backend among those measured is
    the measured fastest or within ``DISAGREE`` of it, ``disagree`` otherwise, ``no-estimate`` (and "") when
    there is nothing to compare."""
    timed = {r.backend: r.decode.step_us for r in rows if r.decode is not None and not r.decode.fell_back}
    order = [b for b in (estimated_order or ()) if b in timed]
    if not timed or not order:
        return "no-estimate", ""
    best = min(timed.values())
    return ("agree" if timed[order[0]] <= best * (1 + DISAGREE) else "disagree"), order[0]


def consistent(row: MeasuredRow, latency_us: Mapping[int, float], noise: float) -> bool | None:
    """Whether the step's allreduces alone cost what ar-latency measured for the same backend at the same
    message size, within ``noise`` (a fraction); None when either side lacks that size."""
    if row.comm_only_us is None or row.decode_bytes is None or row.decode_bytes not in latency_us:
        return None
    ref = latency_us[row.decode_bytes]
    return ref > 0 and abs(row.comm_only_us - ref) <= noise * ref


def untimed_step(r: ProbeResult) -> bool:
    """A step result that checked without timing: its ranks shared a GPU, or it ran the set-up and one agreement
    case at a world size outside the deep ones (``depth=setup``)."""
    return r.shared_gpu or r.params.get("depth") == "setup"


def checked_shared(results: Iterable[ProbeResult], cell_id: str, ranks: int, model: str) -> tuple[str, ...]:
    """``backend (kernel, ...)`` for every step variant of this cell and rank count that checked without timing
    and passed: ranks sharing one GPU, for ``model`` (its cases by model) or for every model (its
    ``shared_checks``: the backend's set-up and one agreement case per dtype), or a GPU per rank at a world size
    that runs only that set-up and case (``depth=setup``, its ``setup_checks``): exact there, never timed."""
    out = []
    for r in results:
        if (r.probe_id != STEP_PROBE or r.cell_id != cell_id or r.ranks != ranks or not untimed_step(r)
                or r.verdict.status is not Status.PASS):
            continue
        cases = r.verdict.evidence.get("per_case")
        ev = r.verdict.evidence
        mine = cases.get(model) if isinstance(cases, Mapping) else (ev.get("shared_checks") or ev.get("setup_checks"))
        if not isinstance(mine, Mapping) or not mine:
            continue
        names = sorted({short_kernel(str(k)) for c in mine.values() if isinstance(c, Mapping)
                        for k in ((c.get("launched") or {}).get("kernels") or {})})
        out.append(f"{r.params.get('backend', '?')} ({', '.join(names) or 'kernels not read'})")
    return tuple(sorted(out))

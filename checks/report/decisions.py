"""The decision notes of one host: advice per cell and rank count, launch settings, a model estimate, nearest green
cells and what the newest run changed; as text blocks (for `checks advise` and the report) and as JSON (pure).

Text names the results each line stands on by numbers, ``[1,3]``, listed in full under the block (``ids``), so
lines stay readable; the JSON carries the full result ids on every item.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from checks.report import launch
from checks.report.advise import (
    BASELINE,
    LATENCY_PROBE,
    NOISE,
    CellAdvice,
    Missing,
    advise_cell,
    human_bytes,
    rank_counts,
)
from checks.report.diff import Diff, since_previous
from checks.report.estimate import (
    DEFAULT_BATCH,
    DEFAULT_DRAFT,
    Acceptance,
    Estimate,
    Model,
    StepCost,
    default_acceptance,
    estimate,
    tokens_per_s,
)
from checks.report.gates import EngineGates, engine_gates, tp_sizes
from checks.report.gates import capabilities as gate_caps
from checks.report.measured import (
    STEP_PROBE,
    Measured,
    MeasuredRow,
    StepTime,
    checked_shared,
    consistent,
    measured,
    untimed_step,
)
from checks.report.nearest import Green, nearest_green
from checks.results import hwclass, ids, provenance
from checks.results.hostresults import HostResults
from common import reasons
from inenv.status import Status


@dataclass(frozen=True)
class CellDecision:
    advice: CellAdvice
    launch: launch.Launch
    estimate: Estimate | None = None
    usable: tuple[str, ...] = ()  # working backends some shown engine release can use on this host
    measured: Measured | None = None  # the step probe's timed steps for the model (ranked on, when present)
    shared_step: tuple[str, ...] = ()  # step backends exact with ranks sharing one GPU (checked, not timed)
    gated_off: tuple[str, ...] = ()  # an engine in this cell whose own gate data leaves an advised backend out
    accept: Acceptance | None = None  # the acceptance length verify-step tokens per second are counted at


@dataclass(frozen=True)
class HostDecision:
    host_id: str
    host: str  # "2x NVIDIA H200, NVLink (NV18), multicast no"
    cells: tuple[CellDecision, ...]
    green: tuple[Green, ...]
    changes: Diff | None
    note: str = ""  # why nothing is advised, when nothing is
    engines: tuple[EngineGates, ...] = ()  # the gates of the engines installed in the cells, at this host
    gate_reader: str = ""  # the version of the code that read them (checks/report/gates.py), when there are any
    contributed: tuple[str, ...] = ()  # "run R: contributed: imported from B, measured by ..." per imported run
    hardware_class: str = ""  # hwclass.of(facts).label: the grouping the table and `checks report --json` use


def describe_host(facts: Mapping[str, Any]) -> str:
    n, name = facts.get("gpu_count"), facts.get("gpu_name")
    if not (n and name):
        return "no GPU" if facts else "host facts unknown (no readable manifest)"
    parts = [f"{n}x {name}"]
    if facts.get("interconnect"):
        parts.append(str(facts["interconnect"]))
    mc = facts.get("multicast")
    if isinstance(mc, list) and mc:
        parts.append("multicast " + ("yes" if all(x is True for x in mc) else "no"))
    return ", ".join(parts)


def _why_nothing(h: HostResults) -> str:
    lat = [r for r in h.latest() if r.probe_id == LATENCY_PROBE]
    if not lat:
        return "no ar-latency result on this host"
    c = Counter(f"{r.verdict.status.value} ({r.verdict.reason_code})" if r.verdict.reason_code
                else r.verdict.status.value for r in lat)
    return "ar-latency: " + ", ".join(f"{_count(n, 'variant')} {w}" for w, n in sorted(c.items()))


def decide(h: HostResults, engines: launch.Engines, sglang_pins: Mapping[str, str], *, cell: str | None = None,
           tp: int | None = None, model: Model | None = None, batch: int = DEFAULT_BATCH,
           draft: int = DEFAULT_DRAFT, accept: float | None = None) -> HostDecision:
    latest = h.latest()
    acceptance = (Acceptance(accept, draft, "given with --accept") if accept is not None
                  else default_acceptance(model.name, draft) if model is not None else None)
    cells = [cell] if cell else sorted({r.cell_id for r in latest})
    caps = gate_caps(h.facts, latest)
    gates = engine_gates(latest, caps, tp_sizes(h.gpu_count, tp), cell)
    out = []
    for c in cells:
        for n in ([tp] if tp else _rank_counts(latest, c)):
            a = advise_cell(h.host_id, c, n, latest, h.facts, h.executor(c))
            if tp and h.gpu_count is not None and tp > h.gpu_count and not a.curves:
                a = dataclasses.replace(a, missing=(Missing(f"allreduce latency at {tp} ranks",
                                                            f"this host has {h.gpu_count} GPUs"),))
            est = estimate(a, model, batch, draft) if model is not None and a.curves else None
            order = [r.backend for r in sorted(est.rows, key=lambda r: (r.decode.total_us is None,
                                                                         r.decode.total_us or 0.0))] if est else None
            meas = measured(latest, c, n, model.name, batch, draft, order) if model is not None else None
            shared = checked_shared(latest, c, n, model.name) if model is not None and meas is None else ()
            usable = tuple(x.backend for x in a.curves if launch.usable(x.backend, a, engines, sglang_pins))
            off = tuple(f"{g.engine} {g.version} in this cell: its own gate data admits no {b} at tp {a.ranks} "
                        f"here: {line.text}"
                        for b in a.used for g in gates if g.cell_id == c for line in g.off_for(b, a.ranks))
            out.append(CellDecision(a, launch.plan(a, engines, sglang_pins), est, usable, meas, shared, off,
                                    acceptance))
    green = tuple(g for g in nearest_green(latest, reasons.default().host_bound_codes)
                  if cell is None or g.cell_id == cell)
    reader = provenance.verdict_code_versions().get("gates.py", "unknown") if gates else ""
    return HostDecision(h.host_id, describe_host(h.facts), tuple(out), green, since_previous(h),
                        "" if out or gates else _why_nothing(h), tuple(gates), reader,
                        tuple(f"run {r}: {text}" for r, text in sorted(h.contributed.items())),
                        hwclass.of(h.facts).label)


def says_something(c: CellDecision) -> bool:
    """Whether a cell's decision holds more than what is missing: a backend per size, one to avoid, one that works
    unranked, a measured or checked step, an engine's gate."""
    a = c.advice
    return bool(a.sizes or a.crossovers or a.avoid or a.untimed or a.not_for_verify or c.measured is not None
                or c.shared_step or c.gated_off)


def narrowed(d: HostDecision, cells: Collection[str]) -> HostDecision:
    """``d`` for ``cells`` only, without the cells whose decision says nothing but what is missing (a host
    without a GPU, or with fewer than the ranks: a host with a GPU per rank would time them); the note says so
    where no cell is left."""
    kept = tuple(c for c in d.cells if c.advice.cell_id in cells and says_something(c))
    engines = tuple(g for g in d.engines if g.cell_id in cells)
    green = tuple(g for g in d.green if g.cell_id in cells)
    note = d.note
    if not kept and not engines and not note:
        note = ("no allreduce latency measured at 2 ranks or more here: a host with a GPU per rank times the "
                "backends and gets advice per decode size")
    changes = d.changes
    if changes is not None:  # keys and result ids name their cell: (cell, probe, variant), run/cell/probe/variant
        changes = dataclasses.replace(
            changes, changes=tuple(c for c in changes.changes if c.key[:1] and c.key[0] in cells),
            only_a=tuple(i for i in changes.only_a if i.split("/")[1:2] and i.split("/")[1] in cells),
            only_b=tuple(i for i in changes.only_b if i.split("/")[1:2] and i.split("/")[1] in cells))
    return dataclasses.replace(d, cells=kept, engines=engines, green=green, note=note, changes=changes)


def _rank_counts(results: Sequence[Any], cell_id: str) -> list[int]:
    """The rank counts ar-latency was measured at in a cell, and those the step probe ran at there."""
    timed = {r.ranks for r in results if r.cell_id == cell_id and r.probe_id == STEP_PROBE and r.ranks is not None
             and (r.verdict.metrics.get("step_us") or (untimed_step(r) and r.verdict.status is Status.PASS))}
    return sorted(set(rank_counts(results, cell_id)) | timed)


# --------------------------------------------------------------------------------------------------
# Text


@dataclass
class Block:
    title: str
    lines: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def ref(self, ids: Sequence[str]) -> str:
        nums = []
        for i in ids:
            if i not in self.ids:
                self.ids.append(i)
            nums.append(self.ids.index(i) + 1)
        return f" [{','.join(map(str, sorted(set(nums))))}]" if nums else ""


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _us(x: float) -> str:
    return f"{x:.2f} µs"


def _size(n: int, tokens: int | None) -> str:
    return f"{human_bytes(n)} ({tokens} token{'s' if tokens != 1 else ''})" if tokens else human_bytes(n)


def _tie(a: CellAdvice, backend: str, nbytes: int) -> str:
    """The tie threshold at one size, and whether it was measured."""
    t = a.spread.tie(backend, nbytes)
    measured = any((b, nbytes) in a.spread.by for b in (backend, BASELINE))
    return f"the {t:.1%} run-to-run spread" if measured else f"the assumed {NOISE:.0%}: no repeated timing here"


def _spread_line(a: CellAdvice) -> str:
    """What the ties stand on: each backend's largest run-to-run spread over the sizes and how many cells of
    this CUDA and torch build timed it."""
    per = a.spread.per_backend()
    if not per:
        return (f"Ties: no backend was timed twice at {a.ranks} ranks in a cell of this build; a gain under "
                f"{NOISE:.0%} (assumed) keeps NCCL")
    shown = ", ".join(f"{b} ≤{x:.1%} ({n} cells)" for b, x, n in per)
    return (f"Ties: a gain smaller than the larger run-to-run spread of the two backends at a size keeps NCCL; "
            f"spread (range over median of the latest ar-latency at {a.ranks} ranks in every cell of this CUDA and "
            f"torch build): {shown}")


def recorded(text: object) -> str:
    """Text a result recorded, placed inside a line composed here: its backticks shown as ' so it opens no code
    span (or fence) of its own where the line's own code spans are kept (the Markdown page's decision notes)."""
    return str(text).replace("`", "'")


def advice_block(d: CellDecision) -> Block:
    a = d.advice
    shape = f"bf16, hidden {a.hidden}" if a.hidden else "bf16"
    b = Block(f"Advice — cell `{a.cell_id}`, {a.ranks} ranks (from recorded results only; messages {shape})")
    if a.sizes:
        b.lines.append("Fastest backend per decode message, among those exact eagerly and in a CUDA graph "
                       "(median of one captured call):")
        for s in a.sizes:
            ratio = f", {s.ratio_vs_nccl:.2f}× NCCL" if s.ratio_vs_nccl is not None else ""
            nxt = f"; next {s.runner_up} {_us(s.runner_up_us)}" if s.runner_up and s.runner_up_us else ""
            why = "" if s.use == s.fastest else f" (the gain is under {_tie(a, s.fastest, s.nbytes)})"
            b.lines.append(f"- {_size(s.nbytes, s.tokens)}: {s.fastest} {_us(s.fastest_us)}{ratio}{nxt} → use "
                           f"{s.use}{why}{b.ref(s.ids)}")
    if a.sizes:
        b.lines.append(_spread_line(a))
    for c in a.crossovers:
        at = f"; the measured curves cross near {human_bytes(c.at)}" if c.at is not None else ""
        b.lines.append(f"Crossover: {c.below} up to {human_bytes(c.lo)}, {c.above} from {human_bytes(c.hi)}{at}"
                       f"{b.ref(c.ids)}")
    for x in a.avoid:
        why = f"{x.status} ({x.reason_code})" if x.reason_code else x.status
        b.lines.append(f"Avoid: {x.what}: {why}: {recorded(x.why)}{b.ref(x.ids)}")
    for u in a.untimed:
        b.lines.append(f"Works, not ranked: {u.feature}: {recorded(u.why)}{b.ref(u.ids)}")
    for x in a.not_for_verify:
        b.lines.append(f"Not for a speculative verify step: {x.backend}: {recorded(x.why)}{b.ref(x.ids)}")
    for x in d.gated_off:
        b.lines.append(f"Engine gate: {x}")
    for m in a.missing:
        run = f"; run `{m.run}`" if m.run else ""
        b.lines.append(f"Missing: {m.what}: {recorded(m.why)}{run}")
    for note in d.launch.scope:
        b.lines.append(f"Launch settings: {note} (sources per setting: checks/report/launch_flags.yaml)")
    for s in d.launch.settings:
        where = f" ({s.sizes})" if s.sizes else ""
        what = {"set": "set " + " ".join(f"`{x}`" for x in s.settings), "default": "nothing to set",
                "unavailable-here": "not available here", "unsupported": "not supported by this release",
                "not-covered": "not covered"}[s.state]
        b.lines.append(f"- {s.engine} {s.release} · {s.backend}{where}: {what}" + (f" — {s.note}" if s.note else ""))
    return b


def _saving(s: StepCost) -> str:
    if s.saving is None:
        return ""
    return ", same as NCCL" if abs(s.saving) < 0.005 else f", {-s.saving:+.0%} vs NCCL"


def _step(s: StepCost, label: str) -> str:
    if s.per_call is None or s.total_us is None:
        return f"{label} not estimated ({human_bytes(s.nbytes)} is above the largest measured size)"
    mark = {"measured": "", "interpolated": "", "below-range": "≤ "}[s.per_call.how]
    return f"{label} {mark}{s.total_us:.1f} µs/step ({mark}{_us(s.per_call.us)} per call{_saving(s)})"


def _best(e: Estimate, kind: str, among: Sequence[str] | None, leave: Sequence[str] = ()) -> str:
    rows = [(getattr(r, kind), r.backend) for r in e.rows if (among is None or r.backend in among)
            and r.backend not in leave]
    rows = [(s, b) for s, b in rows if s.total_us is not None]
    if not rows:
        return f"{kind}: none"
    s, b = min(rows, key=lambda x: (x[0].total_us, x[1]))
    return f"{kind} {b} {s.total_us:.1f} µs/step{_saving(s)}"


def _per_token(e: Estimate, s: StepCost, base: StepCost | None, accept: Acceptance) -> str:
    """A verify step's allreduce time per generated token at ``accept``, its saving against NCCL's, and the
    tokens per second the allreduces alone would allow."""
    if s.total_us is None:
        return ""
    tokens = e.batch * accept.length
    saved = "" if base is None or base.total_us is None else \
        f", {(base.total_us - s.total_us) / tokens:+.2f} µs/token vs NCCL"
    ceiling = tokens_per_s(e.batch, accept.length, s.total_us)
    return (f"; at acceptance {accept.length:g}: {s.total_us / tokens:.2f} µs of allreduce per generated token"
            f"{saved}, at most {ceiling:,.0f} tok/s from the allreduces alone" if ceiling else "")


def estimate_block(e: Estimate, usable: Sequence[str] | None = None, accept: Acceptance | None = None,
                   leave: Sequence[Any] = ()) -> Block:
    """``usable``: the backends an engine release can use on this host (None: not known, nothing marked);
    ``accept``: the acceptance length to count verify-step tokens at; ``leave``: the backends not for the
    verify step (``advise.NotForVerify``), left out of the fastest verify and marked."""
    m = e.model
    b = Block(f"Estimate, not a measurement — {m.label}, tp {e.ranks}, cell `{e.cell_id}`")
    dec, ver = e.rows[0].decode if e.rows else None, e.rows[0].verify if e.rows else None
    b.lines.append(f"Inputs: hidden {m.hidden}, {m.layers} layers × {m.allreduces_per_layer} allreduces = "
                   f"{m.allreduces} allreduces per forward pass, {m.dtype} ({m.dtype_bytes} bytes); decode step "
                   f"{e.batch} tokens"
                   + (f" = {human_bytes(dec.nbytes)} per allreduce" if dec else "")
                   + f"; verify step {e.batch} × {e.draft} draft tokens = {e.batch * e.draft} tokens"
                   + (f" = {human_bytes(ver.nbytes)} per allreduce" if ver else "") + ".")
    b.lines.append(f"Method: each backend's measured curve ({e.measured_dtype}, captured calls back to back; the "
                   f"model's compute between calls is not included), linear between measured sizes; ≤: below the "
                   f"smallest measured size, its latency is used; savings against the {e.baseline} curve.")
    if m.source:
        b.lines.append(f"Model shape: {m.source}")
    if accept is not None:
        b.lines.append(f"Acceptance length {accept.length:g} tokens per sequence per verify step ({accept.source}).")
    off = {x.backend: x for x in leave}
    base = next((r.verify for r in e.rows if r.backend == e.baseline), None)
    for r in e.rows:
        mark = "" if usable is None or r.backend in usable else " † no engine release shown can use it on this host"
        if r.backend in off:
            mark += " ‡ not for the verify step: its ranks' outputs differ bit for bit"
        per_token = _per_token(e, r.verify, base, accept) if accept is not None else ""
        b.lines.append(f"- {r.backend}: {_step(r.decode, 'decode')}; {_step(r.verify, 'verify')}{per_token}{mark}"
                       f"{b.ref(r.ids)}")
    if e.rows:
        left = tuple(off)
        usable_best = "" if usable is None else (f" Fastest an engine release can use here: "
                                                 f"{_best(e, 'decode', usable)}; {_best(e, 'verify', usable, left)}.")
        b.lines.append(f"Fastest measured: {_best(e, 'decode', None)}; {_best(e, 'verify', None, left)}.{usable_best}")
        for x in leave:
            b.lines.append(f"‡ {x.backend} left out of the verify step: {x.why}{b.ref(x.ids)}")
    return b


def _ms(t: StepTime | None, label: str) -> str:
    if t is None:
        return f"{label} not timed"
    fell = "; launched NCCL's kernels: not its own speed" if t.fell_back else ""
    kern = f"; kernel {', '.join(t.kernels)}" if t.kernels else ""
    return (f"{label} {t.step_us / 1000:.3f} ms ({t.comm_share:.0%} communication, {t.per_allreduce_us:.1f} µs "
            f"per allreduce over the {t.baseline_us / 1000:.3f} ms without it{kern}{fell})")


def _row_line(r: MeasuredRow, rate: str = "") -> str:
    status = "" if r.status == "pass" else f" [{r.status}]"
    return f"- {r.backend}{status}: {_ms(r.decode, 'decode')}; {_ms(r.verify, 'verify')}{rate}"


def _rate(m: Measured, r: MeasuredRow, base: MeasuredRow | None, accept: Acceptance, off: bool) -> str:
    """The measured verify step in tokens per second at ``accept``, and its difference from NCCL's."""
    mine = tokens_per_s(m.batch, accept.length, r.verify.step_us if r.verify else None)
    if mine is None:
        return ""
    theirs = tokens_per_s(m.batch, accept.length, base.verify.step_us if base and base.verify else None)
    vs = "" if theirs is None or base is r else f", {mine - theirs:+,.0f} tok/s vs NCCL"
    bad = " ‡ not for the verify step: its ranks' outputs differ bit for bit" if off else ""
    return f"; verify at acceptance {accept.length:g}: {mine:,.0f} tok/s of this step{vs}{bad}"


def measured_block(m: Measured, est: Estimate | None, curves: Sequence[Any] = (), accept: Acceptance | None = None,
                   leave: Sequence[Any] = ()) -> Block:
    """The step probe's measured steps, fastest decode first, how the estimate's ranking compares, and whether
    each backend's allreduces alone cost in the step what ar-latency measured (``curves``) at that size."""
    dec, ver = case_keys_text(m)
    b = Block(f"Measured step — {m.model}, tp {m.ranks}, cell `{m.cell_id}` (ranked on this)")
    b.lines.append(f"Cases: decode {dec}, verify {ver}; each a CUDA graph of every layer's row-parallel matmuls, "
                   "allreduces, residual adds and RMSNorms, checked exactly, against the same graph without the "
                   "allreduce.")
    latency = {c.backend: c.latency_us for c in curves}
    base = next((r for r in m.rows if r.backend == BASELINE), None)
    off = {x.backend for x in leave}
    if accept is not None:
        b.lines.append(f"Tokens per second of the measured step (its row-parallel blocks only: the rest of the model "
                       f"adds time, so a server's rate is lower) at acceptance length {accept.length:g} "
                       f"({accept.source}).")
    for r in m.rows:
        rate = _rate(m, r, base, accept, r.backend in off) if accept is not None else ""
        b.lines.append(_row_line(r, rate) + b.ref(r.ids))
        agree = consistent(r, latency.get(r.backend, {}), NOISE)
        if agree is not None and r.comm_only_us is not None and r.decode_bytes is not None:
            ref = latency[r.backend][r.decode_bytes]
            b.lines.append(f"  its allreduces alone: {r.comm_only_us:.2f} µs per call; ar-latency at "
                           f"{human_bytes(r.decode_bytes)}: {ref:.2f} µs "
                           + ("(agree within the noise)" if agree else f"(differ by more than {NOISE:.0%})"))
    if all(r.decode is None for r in m.rows):
        b.lines.append(f"Not timed at this batch and draft: the probe timed {', '.join(m.measured_cases)}.")
    if est is not None and m.verdict != "no-estimate":
        fastest = next((r.backend for r in m.rows if r.decode is not None and not r.decode.fell_back), "")
        word = {"agree": "agrees with", "disagree": "disagrees with"}[m.verdict]
        b.lines.append(f"The estimate below {word} the measurement: measured fastest decode {fastest}, estimated "
                       f"{m.estimated_fastest} (the estimate's fastest among the measured backends).")
    return b


def case_keys_text(m: Measured) -> tuple[str, str]:
    return (f"{m.batch} tokens", f"{m.batch} × {m.draft} tokens ({m.draft - 1} draft)")


def green_block(greens: Sequence[Green]) -> Block:
    b = Block("Nearest green: for each variant that fails in a cell, the nearest cell of this host where it passes")
    for g in greens:
        if g.nearest:
            why = f"{g.status} ({g.reason_code})" if g.reason_code else g.status
            b.lines.append(f"- {g.probe_id} {g.variant} in `{g.cell_id}`: {why} → passes in `{g.nearest}` "
                           f"({'; '.join(g.changes) or 'same axes'}){b.ref([g.failing_id, g.passing_id])}")
    nowhere = [g for g in greens if not g.nearest]
    if nowhere:
        kinds = Counter(f"{g.probe_id} {g.status}" + (f" ({g.reason_code})" if g.reason_code else "") for g in nowhere)
        b.lines.append(f"- passing in no other cell of this host: {_count(len(nowhere), 'variant')} ("
                       f"{'; '.join(f'{k} ×{n}' for k, n in sorted(kinds.items()))})"
                       f"{b.ref([g.failing_id for g in nowhere])}")
    return b


def diff_lines(d: Diff, b: Block) -> None:
    for c in d.changes:
        parts = []
        if c.verdict_changed:
            parts.append(f"verdict {c.a_verdict} → {c.b_verdict}")
        if c.headline_changed:
            parts.append(f"headline {c.a_headline or '-'} → {c.b_headline or '-'}")
        b.lines.append(f"- {' / '.join(c.key)}: {'; '.join(parts)}{b.ref([c.a_id, c.b_id])}")
    if not d.changes:
        b.lines.append(f"- no verdict or headline changed among the {_count(d.compared, 'variant')} on both sides")


def diff_block(d: Diff) -> Block:
    b = Block(f"Changes from {d.a} to {d.b} ({d.kind}s; {_count(d.compared, 'variant')} on both sides)")
    diff_lines(d, b)
    for side, only in (("only in " + d.a, d.only_a), ("only in " + d.b, d.only_b)):
        if only:
            probes = Counter(i.split("/")[2] if i.count("/") >= 3 else i for i in only)
            per_probe = ", ".join(f"{p} {n}" for p, n in sorted(probes.items()))
            b.lines.append(f"- {side}: {_count(len(only), 'result')} ({per_probe})")
    return b


def gates_block(g: EngineGates, reader: str = "") -> Block:
    at = f"compute capability {recorded(g.capability)}" if g.capability else "no compute capability to look up"
    b = Block(f"Engine gates — cell `{g.cell_id}`: {recorded(g.engine)} {recorded(g.version)} ({at}, tp "
              f"{'/'.join(map(str, g.tps))})")
    b.lines.append("The engine's own world-size lists and size tables, read from its modules in the cell"
                   f"{b.ref([g.result_id])}")
    if g.rules:
        b.lines.append(recorded(g.rules))
    if g.status != Status.PASS.value and g.note:
        b.lines.append(f"{g.status}: {recorded(g.note)}")
    b.lines += [f"- {recorded(line.text)}" for line in g.lines]
    if reader:  # the host-side code that applied the data here: a change to it changes these lines, named
        b.lines.append(f"Read by stackprobe's gate reader gates.py {reader}.")
    return b


def changes_block(d: Diff) -> Block:
    b = Block(f"Since the newest run `{d.b}`: what it changed against the latest earlier result of each variant it "
              f"reran ({_count(d.compared, 'variant')})")
    diff_lines(d, b)
    if d.only_b:
        b.lines.append(f"- first recorded in this run: {_count(len(d.only_b), 'variant')}")
    return b


def blocks(d: HostDecision) -> list[Block]:
    out = []
    for c in d.cells:
        out.append(advice_block(c))
        if c.measured is not None:
            out.append(measured_block(c.measured, c.estimate, c.advice.curves, c.accept, c.advice.not_for_verify))
        elif c.shared_step:
            out.append(Block(f"Step — tp {c.advice.ranks}, cell `{c.advice.cell_id}`: checked, not timed",
                             ["The step probe checked these backends without timing them, with the ranks sharing "
                              "one GPU or with their set-up and one agreement case at a world size the full grid "
                              "skips: exact, with the kernels they launched, but nothing is ranked on it; the full "
                              "grid with its times runs with a GPU per rank at the deep world sizes (powers of two "
                              "and the host's GPU count).",
                              *(f"- {recorded(x)}" for x in c.shared_step)]))
        if c.estimate is not None:
            out.append(estimate_block(c.estimate, c.usable, c.accept, c.advice.not_for_verify))
    for g in d.engines:
        out.append(gates_block(g, d.gate_reader))
    if not d.cells and not d.engines:
        out.append(Block("Advice", [f"Nothing to advise on this host: {d.note}."]))
    if d.green:
        out.append(green_block(d.green))
    if d.changes is not None:
        out.append(changes_block(d.changes))
    return out


def by_class(found: Sequence[HostDecision]) -> list[tuple[str, list[HostDecision]]]:
    """Decisions grouped by hardware class, in the order each class first appears (the order `checks advise`
    chose: this host's first)."""
    out: dict[str, list[HostDecision]] = {}
    for d in found:
        out.setdefault(d.hardware_class, []).append(d)
    return list(out.items())


def render(d: HostDecision) -> str:
    """The decision as terminal text: each line one line whatever the recorded text in it holds."""
    lines = [ids.one_line(f"host {d.host_id}: {d.host}")]
    if d.hardware_class:
        lines.append(ids.one_line(f"  hardware class: {d.hardware_class}"))
    lines += [ids.one_line(f"  {c}") for c in d.contributed]  # what was measured elsewhere, said first
    for b in blocks(d):
        lines += ["", *block_lines(b)]
    return "\n".join(lines) + "\n"


def block_lines(b: Block) -> list[str]:
    """A block's lines for a terminal, recorded text made one line each (ids.one_line)."""
    out = [b.title, *b.lines, *(["ids:"] if b.ids else []), *(f"  [{n}] {i}" for n, i in enumerate(b.ids, 1))]
    return [ids.one_line(ln) for ln in out]


# --------------------------------------------------------------------------------------------------
# JSON


def plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(x) for x in obj]
    if isinstance(obj, Status):
        return obj.value
    return obj


def to_json(d: HostDecision) -> dict[str, Any]:
    out = plain(d)
    if not d.engines:  # the gate reader's version goes with the gates it read, and only with them
        out.pop("gate_reader", None)
    out["estimate_is"] = "an estimate from measured latency curves, not a measurement"
    return out

"""Rank agreement: whether every rank of an allreduce holds the same bits, call after call, and how far they are
from the exact sum.

Under tensor parallelism every rank runs the rest of the model on its allreduce's output. Speculative decoding
decides on each rank how many draft tokens to accept from that output; ranks whose outputs differ by one bit can
accept different numbers and then wait for each other forever in the next collective. A backend's result can be
exact on the small integers ``_data`` sends (every sum representable) and still differ between ranks on real
activations, where the order of the additions decides the rounding. So a check here sends random normal values
in bf16 (and fp16), and for one case (a dtype, a message of ``tokens x hidden``, eager or in a CUDA graph):

- every rank's output is compared bit for bit with every other rank's (``identical``, ``differing`` elements,
  ``max_ulp_between_ranks``), with +0 and -0 one value: a sum that cancels to zero may carry either sign by the
  order of its additions, the two compare equal in every operation a model's step and its acceptance of draft
  tokens run (products, sums, norms, argmax, sampling), so ranks that differ only there decide alike; such
  elements are counted apart (``zero_signs``);
- a second identical call on the same inputs is compared with the first (``deterministic``, zeros' signs alike);
- every output is compared with the float64 sum of all ranks' inputs (``max_ulp_vs_reference``: the error in
  units in the last place of the output's dtype at the size of what was added, the sum of the inputs'
  magnitudes where the caller gives it: a sum that cancels to near zero has a tiny ulp of its own, and an error
  from adding large terms is not the backend's fault, so measured at the result alone any order of addition
  would read as thousands of ulps).

Each rank makes every rank's inputs from the seed (a CPU generator, so the same numbers on every rank and
device), so the reference needs no collective; the outputs travel as bytes over the group given (gloo beside
NCCL, so the backend under test never checks itself). Every rank reaches the same verdict from the same
gathered bytes.

In-environment side: standard library at module level, torch inside the functions.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inenv import models
from inenv.kit import _data, _device, _dist, _errors
from inenv.probe import LEVEL_ENV, QUICK

REASON = "rank-divergent"
DTYPES = ("bf16", "fp16")
MANTISSA_BITS = {"bf16": 7, "fp16": 10}  # stored fraction bits
MIN_EXPONENT = {"bf16": -126, "fp16": -14}  # of the smallest normal number
MODES = ("eager", "graph")
# Decode steps of 1 and 32 sequences; a speculative verify step of 32 sequences x (1 + 7 draft tokens)
TOKENS = (1, 32, 256)
SEED = 11
EXACT_SEED = 12
DEADLINE_S = 60.0
UNTOUCHED = 1024.0  # what an output holds before a call: far beyond any sum of a few normal values


def max_numel() -> int:
    """The most elements one case sends: what a probe's buffers must hold for the agreement check."""
    return max(TOKENS) * max(hiddens())


def hiddens() -> tuple[int, ...]:
    """The hidden sizes of the model shapes ``checks advise`` knows (``inenv.models``), smallest first."""
    return tuple(sorted({int(str(d["hidden"])) for d in models.SHAPES.values()}))


@dataclass(frozen=True)
class Case:
    """One agreement check: ``tokens x hidden`` elements of ``dtype``, called eagerly or replayed in a graph."""

    dtype: str
    tokens: int
    hidden: int
    mode: str

    @property
    def numel(self) -> int:
        return self.tokens * self.hidden

    @property
    def key(self) -> str:
        return f"{self.dtype}:{self.mode}:{self.tokens}x{self.hidden}"


def cases(dtypes: Sequence[str], quick: bool | None = None) -> tuple[Case, ...]:
    """Every dtype x model hidden size x decode/verify token count x mode; ``quick`` (by default: a quick run,
    ``inenv.probe.LEVEL_ENV``): the largest size only, per dtype and mode."""
    if quick is None:
        quick = os.environ.get(LEVEL_ENV) == QUICK
    sizes = [(t, h) for h in hiddens() for t in TOKENS]
    if quick:
        sizes = [(TOKENS[-1], max(hiddens()))]
    return tuple(Case(d, t, h, m) for d in dtypes for t, h in sizes for m in MODES)


# The shallow selection: what a multi-rank probe checks where its full grid is not asked. Two placements run it:
# ranks sharing one GPU (``placement=shared``), which wait for each other's turn at every call, and ranks with a
# GPU each at a world size outside ``inenv.probe.deep_sizes`` (``depth=setup``), where engines' gates and the
# backends' set-up (a world size a kernel refuses) are the question. What either can tell (whether the backend
# sets up at that world size, whether its kernel computes the sum and the ranks agree on it) one case shows: a
# verify step of 32 x 8 tokens at the largest hidden size, replayed from a CUDA graph as a served step runs it.
# Shapes and steps are checked (and timed) at the deep world sizes, every rank on a GPU of its own.
SHALLOW_MODE = "graph"
SHALLOW_WHAT = "set-up and one exact agreement case per dtype"
SHALLOW_WHAT_QUICK = "set-up and one exact agreement case"
# Where the full grid runs, as a shallow result's evidence says it (``checked``), by placement
FULL_GRID_SHARED = "shapes are checked at a GPU per rank"
FULL_GRID_SETUP = "every shape, case and timing runs at the deep world sizes (powers of two and the host's GPU count)"


def shallow_cases(dtypes: Sequence[str], quick: bool | None = None) -> tuple[Case, ...]:
    """The shallow selection's agreement cases: one case per dtype, ``TOKENS[-1] x`` the largest hidden size in a
    graph; ``quick`` (by default: a quick run) the first dtype only. Run them with ``exact=True``."""
    if quick is None:
        quick = os.environ.get(LEVEL_ENV) == QUICK
    return tuple(Case(d, TOKENS[-1], max(hiddens()), SHALLOW_MODE) for d in (dtypes[:1] if quick else dtypes))


def full_grid_at(shared: bool) -> str:
    """Where a shallow variant's probe runs its full grid, in the words of its evidence: at a GPU per rank for ranks
    sharing a GPU (``shared``), at the deep world sizes for a ``depth=setup`` variant."""
    return FULL_GRID_SHARED if shared else FULL_GRID_SETUP


def shallow_checked(shared: bool, quick: bool | None = None) -> str:
    """The evidence line (``checked``) saying what a shallow variant checked at this level and where the rest runs:
    ``shared`` for ranks sharing a GPU, else a ``depth=setup`` variant with a GPU per rank."""
    if quick is None:
        quick = os.environ.get(LEVEL_ENV) == QUICK
    return f"{SHALLOW_WHAT_QUICK if quick else SHALLOW_WHAT}; {full_grid_at(shared)}"


def torch_dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def dtype_name(dtype: Any) -> str:
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def random_input(shape: Sequence[int], rank: int, seed: int, dtype: str, device: Any = "cpu") -> Any:
    """Normal values (mean 0, std 1) rounded to ``dtype``, different per rank and seed, the same on every rank
    that makes them (a CPU generator: a CUDA one would give other numbers on another device). ``rank`` -1 gives
    a tensor every rank holds the same (a residual stream)."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank + 1)
    vals = torch.randn(tuple(shape), generator=gen, dtype=torch.float32)
    return vals.to(torch_dtype(dtype)).to(device)


def exact_sum(shape: Sequence[int], world: int, seed: int, dtype: str, device: Any = "cpu",
              magnitude: bool = False) -> Any:
    """The float64 sum of :func:`random_input` over ranks 0..world-1 (exact: 16-bit inputs, few ranks); with
    ``magnitude`` the sum of their absolute values (the scale the additions rounded at). Both come from one pass
    over the ranks' inputs, kept for the next call with the same arguments (a binding asks for the reference and
    then its scale): the returned tensor is shared, read it only."""
    key = (tuple(int(n) for n in shape), int(world), int(seed), dtype, str(device))
    if _SUMS.get("key") != key:
        _SUMS.clear()
        _SUMS.update(key=key, sums=_sum_and_magnitude(shape, world, seed, dtype, device))
    return _SUMS["sums"][1 if magnitude else 0]


_SUMS: dict[str, Any] = {}  # the last exact_sum's key and (sum, magnitude): one case's pair, about 2 x 8 bytes x numel


def _sum_and_magnitude(shape: Sequence[int], world: int, seed: int, dtype: str, device: Any) -> tuple[Any, Any]:
    import torch

    total = torch.zeros(tuple(shape), dtype=torch.float64, device=device)
    size = torch.zeros_like(total)
    part = torch.empty_like(total)
    for r in range(world):
        part.copy_(random_input(shape, r, seed, dtype, device))
        total += part
        size += part.abs_()
    return total, size


def rms_norm64(x: Any, gamma: Any, eps: float) -> Any:
    """RMSNorm of ``x`` over its last dimension in float64: the reference for a fused allreduce's norm output."""
    import torch

    x = x.to(torch.float64)
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * gamma.to(torch.float64)


# --------------------------------------------------------------------------------------------------
# Units in the last place (pure, CPU)


def ordered(t: Any) -> Any:
    """A 16-bit float tensor's bit patterns as int32 on a line where neighbours differ by 1 (sign-magnitude
    folded: -0 and +0 are both 0), so the distance of two patterns is their distance in ulps."""
    import torch

    bits = t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    mag = bits & 0x7FFF
    return torch.where(bits >= 0x8000, -mag, mag)


def ulps_between(a: Any, b: Any) -> Any:
    """Per element, how many representable values of their (shared 16-bit) dtype lie between ``a`` and ``b``."""
    return (ordered(a) - ordered(b)).abs()


def spacing(ref: Any, dtype: str) -> Any:
    """The distance between neighbouring ``dtype`` values at each (float64, finite) value of ``ref``: 2 to the
    power of ``floor(log2|x|)`` less the dtype's fraction bits, read off the float64 bits (the exponent field alone
    is that power of two), with values below the dtype's smallest normal number at its subnormal spacing."""
    import torch

    exp_bits = 0x7FF0000000000000  # a float64's exponent field: with the fraction cleared, 2**floor(log2|x|)
    power = (ref.to(torch.float64).contiguous().view(torch.int64) & exp_bits).view(torch.float64)
    return power.clamp_(min=2.0 ** MIN_EXPONENT[dtype]).mul_(2.0 ** -MANTISSA_BITS[dtype])


def ulp_at(ref: Any, dtype: str, scale: Any = None) -> Any:
    """Per element, one ulp of ``dtype`` at the float64 ``ref`` (or at ``scale`` where that is larger): what
    :func:`error_ulps` divides by, worked out once for every output compared with the same reference."""
    import torch

    at = ref.detach().to("cpu", torch.float64).reshape(-1).abs()
    if scale is not None:
        at = torch.maximum(at, scale.detach().to("cpu", torch.float64).reshape(-1).abs())
    return spacing(at, dtype)


def error_ulps(out: Any, ref: Any, scale: Any = None, ulp: Any = None) -> float:
    """The largest error of ``out`` against the float64 ``ref``, in ulps of ``out``'s dtype at ``ref`` (or at
    ``scale`` where that is larger: the magnitude of the terms summed); inf when an element is not finite.
    ``ulp``: :func:`ulp_at` of the same reference and scale, when the caller has it."""
    import torch

    got = out.detach().to("cpu", torch.float64).reshape(-1)
    if not got.numel():
        return 0.0
    if not bool(torch.isfinite(got).all()):
        return math.inf
    want = ref.detach().to("cpu", torch.float64).reshape(-1)
    if ulp is None:
        ulp = ulp_at(want, dtype_name(out.dtype), scale)
    return round(float((got - want).abs_().div_(ulp).max()), 3)


@dataclass(frozen=True)
class Agreement:
    """What one case found, the same on every rank."""

    numel: int
    identical: bool  # every rank's output equals every other's in both calls, bit for bit but for zero's sign
    differing: int  # elements where some rank differs from rank 0 (the worse of the two calls)
    max_ulp_between_ranks: int
    divergent_ranks: tuple[int, ...]  # ranks whose output differs from rank 0's
    deterministic: bool  # the second identical call gave every rank the same bits as the first
    changed_on_repeat: int  # elements that changed between the calls (the most on any rank)
    max_ulp_vs_reference: float  # the largest error of any rank's output against the float64 sum
    outputs: tuple[str, ...] = ()
    zero_signs: int = 0  # elements where some rank's zero has the other sign (equal as numbers; the worse call)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": "ok",
            "numel": self.numel,
            "identical": self.identical,
            "differing": self.differing,
            "max_ulp_between_ranks": self.max_ulp_between_ranks,
            "divergent_ranks": list(self.divergent_ranks),
            "deterministic": self.deterministic,
            "changed_on_repeat": self.changed_on_repeat,
            "max_ulp_vs_reference": self.max_ulp_vs_reference,
            "outputs": list(self.outputs),
            "zero_signs": self.zero_signs,
        }


def own_error(first: Mapping[str, Any], second: Mapping[str, Any], reference: Mapping[str, Any],
              scale: Mapping[str, Any] | None = None) -> float:
    """The largest error in ulps of one rank's outputs of both calls against the float64 reference (the second
    call measured only where its bits differ from the first's: the same bits have the same error)."""
    import torch

    worst = 0.0
    for name in reference:
        a, b = first[name], second[name]
        if not a.numel():
            continue
        ulp = ulp_at(reference[name], dtype_name(a.dtype), (scale or {}).get(name))
        worst = max(worst, error_ulps(a, reference[name], ulp=ulp))
        same = a.shape == b.shape and a.dtype == b.dtype and bool(
            torch.equal(a.detach().reshape(-1).view(torch.int16), b.detach().reshape(-1).view(torch.int16)))
        if not same:
            worst = max(worst, error_ulps(b, reference[name], ulp=ulp))
    return worst


def judge(first: Sequence[Mapping[str, Any]], second: Sequence[Mapping[str, Any]],
          reference: Mapping[str, Any] | None, scale: Mapping[str, Any] | None = None,
          error: float | None = None) -> Agreement:
    """The agreement of every rank's outputs (``first[r][name]``, ``second[r][name]``: the two calls, CPU
    tensors of one 16-bit dtype) with each other and with the float64 ``reference[name]``, its error in ulps
    at ``scale[name]`` where given (see :func:`error_ulps`); ``error``: that error already worked out (each
    rank its own, the largest of all), and then ``reference`` names the outputs only (pure)."""
    import torch

    names = tuple(sorted(reference or first[0]))
    numel, differing, max_ulp, changed, err, zero_signs = 0, 0, 0, 0, 0.0, 0
    divergent: set[int] = set()
    for name in names:
        numel += int(first[0][name].numel())
        worst_differing = worst_signs = 0
        for call in (first, second):
            base = call[0][name].reshape(-1)
            base_at = ordered(base)  # +0 and -0 one point: equal as numbers
            apart = torch.zeros(base.numel(), dtype=torch.bool)
            signs = torch.zeros(base.numel(), dtype=torch.bool)
            for r in range(1, len(call)):
                other = call[r][name].reshape(-1)
                other_at = ordered(other)
                values_differ = base_at != other_at
                signs |= (base.view(torch.int16) != other.view(torch.int16)) & ~values_differ
                if bool(values_differ.any()):
                    divergent.add(r)
                    apart |= values_differ
                    max_ulp = max(max_ulp, int((base_at - other_at).abs().max()))
            worst_differing = max(worst_differing, int(apart.sum()))
            worst_signs = max(worst_signs, int(signs.sum()))
        differing += worst_differing
        zero_signs += worst_signs
        for r in range(len(first)):
            a, b = first[r][name].reshape(-1), second[r][name].reshape(-1)
            changed = max(changed, int((ordered(a) != ordered(b)).sum()))
    if error is None and reference is not None:
        err = max((own_error(first[r], second[r], reference, scale) for r in range(len(first))), default=0.0)
    return Agreement(numel, not divergent, differing, max_ulp, tuple(sorted(divergent)), changed == 0, changed,
                     err if error is None else error, names, zero_signs)


def gather_outputs(outputs: Mapping[str, Any], group: Any = None) -> list[dict[str, Any]]:
    """Every rank's ``outputs`` (name -> tensor of one 16-bit dtype), in rank order, as CPU tensors: the bytes
    travel over ``group`` (on the GPU for an NCCL group, else on the CPU)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    on_gpu = dist.get_backend(group) == "nccl"
    out: list[dict[str, Any]] = [{} for _ in range(world)]
    for name in sorted(outputs):
        t = outputs[name].detach().contiguous()
        data = t.reshape(-1).view(torch.uint8)
        data = data.to(torch.device("cuda", torch.cuda.current_device())) if on_gpu else data.cpu()
        parts = [torch.empty_like(data) for _ in range(world)]
        dist.all_gather(parts, data, group=group)
        for r, p in enumerate(parts):
            out[r][name] = p.cpu().view(t.dtype).reshape(t.shape)
    return out


# --------------------------------------------------------------------------------------------------
# One case on a backend


@dataclass(frozen=True)
class Exact:
    """The same buffers on integer-valued inputs (``_data.pattern``: small integers, so every sum is exact in
    either dtype): ``load(seed)`` writes this rank's and fills the outputs with ``_data.SENTINEL``, which no sum
    reaches; ``verify(seed)`` compares the outputs with the exact sum, ``{"verdict": "exact" | "wrong" | "no-op" |
    "zero", ...}`` (``_data.check_exact``: a kernel that silently did nothing reads ``no-op``)."""

    load: Callable[[int], None]
    verify: Callable[[int], dict[str, Any]]


@dataclass
class Bound:
    """A backend bound to the buffers of one case.

    ``load(seed)`` writes this rank's inputs (and resets outputs); ``step()`` is one call of the backend on those
    buffers (what a graph captures); ``outputs()`` the tensors to compare; ``reference(seed)`` their float64
    values, and ``scale(seed)`` (optional) the magnitudes their errors are measured at (``error_ulps``);
    ``after_capture`` registers a captured graph's buffers with the peers where the backend needs it; ``exact``
    the integer-valued check of the same call (``check(..., exact=True)``)."""

    load: Callable[[int], None]
    step: Callable[[], None]
    outputs: Callable[[], Mapping[str, Any]]
    reference: Callable[[int], Mapping[str, Any]]
    after_capture: Callable[[], None] = field(default=lambda: None)
    scale: Callable[[int], Mapping[str, Any]] | None = None
    exact: Exact | None = None


def allreduce_bound(case: Case, inp: Any, out: Any, step: Callable[[], None], rank: int, world: int,
                    after_capture: Callable[[], None] = lambda: None) -> Bound:
    """A plain allreduce(sum) bound to its buffers: ``inp`` (this rank's input; ``out`` is ``inp`` in place)
    holds ``case.numel`` elements of ``case.dtype``; ``step`` reduces it into ``out``. The output is reset
    before each call to a value no sum of these inputs reaches, so a call that wrote nothing is not read as
    agreeing ranks."""
    shape = (case.tokens, case.hidden)
    if inp.numel() != case.numel or inp.dtype != torch_dtype(case.dtype) or out.dtype != inp.dtype:
        raise ValueError(f"buffers of {inp.numel()} {inp.dtype} for case {case.key}")
    in_place = out.data_ptr() == inp.data_ptr()  # two views of one buffer are two objects

    def load(seed: int) -> None:
        inp.view(shape).copy_(random_input(shape, rank, seed, case.dtype, inp.device))
        if not in_place:
            out.fill_(UNTOUCHED)

    def load_exact(seed: int) -> None:
        inp.view(shape).copy_(_data.pattern(shape, rank, seed, inp.device, inp.dtype))
        if not in_place:
            out.fill_(_data.SENTINEL)

    def verify(seed: int) -> dict[str, Any]:
        # in place the sentinel is overwritten by the input: a call that did nothing leaves this rank's own input
        own = _data.pattern(shape, rank, seed, dtype=inp.dtype)
        return _data.check_exact(out.view(shape), _data.pattern_sum(shape, world, seed, out.device, out.dtype),
                                 prior=None if in_place else _data.filled(shape), own_input=own).to_json()

    return Bound(load, step, lambda: {"out": out.view(shape)},
                 lambda seed: {"out": exact_sum(shape, world, seed, case.dtype)},
                 after_capture, lambda seed: {"out": exact_sum(shape, world, seed, case.dtype, magnitude=True)},
                 Exact(load_exact, verify))


def _wait(outputs: Mapping[str, Any], deadline_s: float) -> None:
    if any(getattr(t, "is_cuda", False) for t in outputs.values()):
        _device.wait_device(deadline_s)


def check(bound: Bound, mode: str, group: Any, deadline_s: float = DEADLINE_S, exact: bool = False,
          profile: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Run one case twice (eagerly, or as replays of one captured call) and judge it on every rank; every rank
    reaches every exchange whatever failed where (``_dist.settle``). Never raises; a verdict other than ``ok``
    (``error``, ``hang``) says the case could not be judged. ``exact``: the same call (the same graph) once more
    on ``bound.exact``'s integer inputs, its worst rank's check under ``exact`` in the result (its ``verdict``
    ``exact`` or why not: ``wrong``, ``no-op``, ``zero``, ``error``, ``hang``, ``unchecked`` for a bound without
    one). ``profile``: called once the case is judged with what ran (the captured graph, kept for reading its
    kernels: ``_device.capture(keep=True)``; the eager call), its return under ``launched``."""
    call: Callable[[], None] = bound.step
    ran: Any = call
    local: dict[str, Any] = {"verdict": "ok"}
    try:
        if mode == "graph":
            bound.load(SEED)
            ran = _device.capture(bound.step, calls=1, warmup=1, keep=profile is not None)
            bound.after_capture()
            call = ran.replay
    except Exception as exc:
        local = {"verdict": "error", "error": f"capture: {_errors.error_tail(exc)}"}
    if (stopped := _dist.settle(local, group)) is not None:
        return stopped
    snaps: list[dict[str, Any]] = []
    try:
        for _ in range(2):
            bound.load(SEED)
            call()
            outs = bound.outputs()
            _wait(outs, deadline_s)
            snaps.append({k: v.detach().clone() for k, v in outs.items()})
    except Exception as exc:
        local = _dist.raised(exc)
    if (stopped := _dist.settle(local, group)) is not None:
        return stopped
    # Each rank measures its own outputs against the reference; the bits of every rank travel to every rank.
    mine: float | str
    try:
        mine = own_error(snaps[0], snaps[1], bound.reference(SEED), bound.scale(SEED) if bound.scale else None)
    except Exception as exc:
        mine = f"judging: {_errors.error_tail(exc)}"
    errors = _dist.gather_objects(mine if isinstance(mine, str) or math.isfinite(mine) else "inf", group)
    if any(isinstance(e, str) and e != "inf" for e in errors):
        return {"verdict": "error", "error": next(e for e in errors if isinstance(e, str) and e != "inf")}
    worst = max((math.inf if e == "inf" else float(e) for e in errors), default=0.0)
    try:
        found = judge(gather_outputs(snaps[0], group), gather_outputs(snaps[1], group), None, error=worst)
    except Exception as exc:  # the same bytes on every rank: every rank fails alike here
        return {"verdict": "error", "error": f"judging: {_errors.error_tail(exc)}"}
    res = found.to_json()
    if exact:
        res["exact"] = exact_call(bound, call, group, deadline_s)
    if profile is not None and res.get("exact", {}).get("verdict") != "hang":
        try:
            res["launched"] = profile(ran)
        except Exception as exc:
            res["launched"] = {"error": _errors.error_tail(exc, 200)}
    return res


def exact_call(bound: Bound, call: Callable[[], None], group: Any, deadline_s: float = DEADLINE_S) -> dict[str, Any]:
    """One ``call`` on ``bound.exact``'s integer inputs, checked exactly on every rank; the worst rank's check
    (every rank returns the same record)."""
    if bound.exact is None:
        return {"verdict": "unchecked", "detail": "this binding has no integer-valued check"}
    local: dict[str, Any]
    try:
        bound.exact.load(EXACT_SEED)
        call()
        _wait(bound.outputs(), deadline_s)
        local = bound.exact.verify(EXACT_SEED)
    except Exception as exc:
        local = _dist.raised(exc)
    everyone = _dist.gather_objects(local, group)
    bad = [(r, e) for r, e in enumerate(everyone) if e.get("verdict") != "exact"]
    if not bad:
        return everyone[0]
    order = {v: i for i, v in enumerate(_dist.VERDICT_ORDER)}
    rank, worst = max(bad, key=lambda b: order.get(str(b[1].get("verdict")), order["error"]))
    return {**worst, "rank": rank}


def run_cases(bind: Callable[[Case], Bound], wanted: Sequence[Case], group: Any,
              log: Callable[[str], None] = lambda _: None, exact: bool = False,
              profile: Callable[[Any], Any] | None = None) -> dict[str, dict[str, Any]]:
    """Every case of ``wanted`` through ``check`` (``exact`` and ``profile`` passed on); a case the backend cannot
    bind (a dtype it refuses) is recorded as ``unsupported`` on every rank. Stops after a hang (the stream is
    stuck behind it)."""
    results: dict[str, dict[str, Any]] = {}
    for case in wanted:
        bound: Bound | None = None
        local: dict[str, Any] = {"verdict": "ok"}
        try:
            bound = bind(case)
        except Exception as exc:
            local = {"verdict": "unsupported", "error": _errors.error_tail(exc, 300)}
        if (stopped := _dist.settle(local, group)) is not None:
            results[case.key] = stopped
            continue
        assert bound is not None
        results[case.key] = res = check(bound, case.mode, group, exact=exact, profile=profile)
        log(f"agreement {case.key}: {res.get('verdict')} identical={res.get('identical')} "
            f"deterministic={res.get('deterministic')} max_ulp_vs_reference={res.get('max_ulp_vs_reference')}"
            + (f" exact={res.get('exact', {}).get('verdict')}" if exact else ""))
        if res.get("verdict") == "hang" or res.get("exact", {}).get("verdict") == "hang":
            break
    return results


# --------------------------------------------------------------------------------------------------
# Summary and verdict (pure)


def summarize(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The result fields over every judged case: ranks identical, differing elements, max ulp between ranks,
    deterministic, error against the reference; the cases that diverged, were not judged or were refused."""
    judged = {k: r for k, r in results.items() if r.get("verdict") == "ok"}
    return {
        "cases": len(results),
        "judged": len(judged),
        "ranks_identical": bool(judged) and all(r.get("identical") is True for r in judged.values()),
        "differing_elements": sum(int(r.get("differing", 0)) for r in judged.values()),
        "max_ulp_between_ranks": max((int(r.get("max_ulp_between_ranks", 0)) for r in judged.values()), default=0),
        "zero_sign_elements": sum(int(r.get("zero_signs", 0)) for r in judged.values()),
        "deterministic": bool(judged) and all(r.get("deterministic") is True for r in judged.values()),
        "max_ulp_vs_reference": max((float(r.get("max_ulp_vs_reference", 0.0)) for r in judged.values()),
                                    default=0.0),
        "divergent_cases": sorted(k for k, r in judged.items() if r.get("identical") is not True),
        "nondeterministic_cases": sorted(k for k, r in judged.items() if r.get("deterministic") is not True),
        "unsupported": sorted(k for k, r in results.items() if r.get("verdict") == "unsupported"),
        "not_judged": sorted(k for k, r in results.items() if r.get("verdict") not in ("ok", "unsupported")),
        **({"inexact_cases": sorted(k for k, _ in _inexact(results))}
           if any("exact" in r for r in results.values()) else {}),
    }


def _inexact(results: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(k, dict(r["exact"])) for k, r in results.items()
            if isinstance(r.get("exact"), Mapping) and r["exact"].get("verdict") != "exact"]


def inexact(results: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """The first case whose integer-valued check (``check(..., exact=True)``) did not give the exact sum, and
    that check's record; None when every such check did (pure)."""
    found = _inexact(results)
    return found[0] if found else None


def shallow_outcome(result: dict[str, Any], agreed: Mapping[str, Mapping[str, Any]], backend: str, wrong: str,
                    noop: str, failed: str) -> dict[str, Any]:
    """``result``, a probe's outcome on its own checks, with its shallow agreement cases (:func:`run_cases` with
    ``exact``) applied (pure): a case whose integer-valued call was not the exact sum makes a pass or partial
    ``fail`` (``noop`` for an output left untouched or zero, else ``wrong``); a case that could not be judged (it
    raised or hung, or its exact call did) makes a pass ``partial`` with ``failed``; ranks apart make it
    ``rank-divergent`` (:func:`apply`). A case the backend does not take (``unsupported``: a dtype it refuses, a
    shape its policy refuses) is listed in the summary and judges nothing. A worse verdict stays."""
    status = result.get("status")
    for key, r in agreed.items():
        chk = r.get("exact") if isinstance(r.get("exact"), Mapping) else {}
        if status in ("pass", "partial") and chk.get("verdict") in ("no-op", "zero", "wrong"):
            note = f"{backend}: agreement case {key}: integer inputs gave {chk['verdict']} ({chk.get('detail', '')})"
            code = wrong if chk["verdict"] == "wrong" else noop
            return apply({**result, "status": "fail", "reason_code": code, "note": note[:400]}, summarize(agreed),
                         backend)
    for key, r in agreed.items():
        chk = r.get("exact") if isinstance(r.get("exact"), Mapping) else {}
        if r.get("verdict") == "unsupported" or (r.get("verdict") == "ok" and chk.get("verdict") == "exact"):
            continue
        if status == "pass":
            why = str(r.get("error") or chk.get("error") or chk.get("detail") or chk.get("verdict") or r.get("verdict"))
            note = f"{backend}: its own checks exact; agreement case {key} could not be judged: {why}"
            return apply({**result, "status": "partial", "reason_code": failed, "note": note[:400]},
                         summarize(agreed), backend)
    return apply(result, summarize(agreed), backend)


def apply(result: dict[str, Any], summary: Mapping[str, Any], backend: str) -> dict[str, Any]:
    """``result`` (a probe outcome) with the agreement summary in its metrics; a pass whose ranks diverged
    becomes ``partial`` with ``rank-divergent`` (its numbers are right, but ranks may decide differently on
    them), naming the cases. A worse verdict stays as it is."""
    result.setdefault("metrics", {})["agreement"] = dict(summary)
    if result.get("status") != "pass" or not summary.get("divergent_cases"):
        return result
    cases_ = summary["divergent_cases"]
    note = (f"{backend}: ranks' outputs differ bit for bit in {len(cases_)} of {summary.get('judged')} agreement "
            f"cases ({', '.join(cases_[:4])}{' ...' if len(cases_) > 4 else ''}; {summary.get('differing_elements')} "
            f"elements, up to {summary.get('max_ulp_between_ranks')} ulp apart): not for a speculative verify step")
    return {**result, "status": "partial", "reason_code": REASON, "note": note[:400]}

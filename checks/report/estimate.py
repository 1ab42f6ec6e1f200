"""Model-aware estimate: the allreduce time of one decode step and one speculative verify step (pure; the model
shapes are ``inenv.models``, which the ``step`` probe measures in the cells too).

Under tensor parallelism every decoder layer ends its attention and its MLP/MoE block with an allreduce of
``tokens x hidden`` elements, so a forward pass of ``tokens`` tokens issues ``layers x allreduces_per_layer``
allreduces of ``tokens x hidden x dtype bytes`` each. A decode step carries ``batch`` tokens; a verify step
carries ``batch x draft`` (each sequence's draft tokens checked at once). The time of one allreduce at that
exact size is read off a backend's measured latency curve (ar-latency: K captured calls back to back, so the
model's compute between the calls is not in it), linearly between the two measured sizes around it. Below the
smallest measured size the smallest size's latency is used (an upper bound when latency grows with size);
above the largest, nothing is estimated. It is an estimate, and every output says so and shows its inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from checks.report.advise import BASELINE, CellAdvice, Curve
from inenv import models as model_table

DEFAULT_BATCH = 8  # decode tokens per step
DEFAULT_DRAFT = 4  # tokens each sequence verifies per speculative step (ar-latency's 4x verify sizes)



@dataclass(frozen=True)
class Acceptance:
    """A published mean acceptance length: tokens each sequence keeps per verify step (the verified token
    included), for a model shape at a number of tokens verified per sequence (``--draft``)."""

    length: float
    draft: int
    source: str


# Published figures only, one per model shape where one exists; `--accept` gives any other.
ACCEPTANCE: dict[str, Acceptance] = {
    # Kimi-K2.5 (the kimi-k2 shape: the same hidden 7168, 61 layers, 64 heads, 8 of 384 experts + 1 shared)
    # with an EAGLE-3 draft model, 3 draft tokens per step (4 verified per sequence): mean acceptance length 2.88,
    # as published with SGLang's Kimi K2.5 EAGLE-3 support (sgl-project/sglang pull request 19689: the
    # AQ-MedAI/Kimi-K25-eagle3 draft, 3 steps, top-k 1, 4 draft tokens, tp 8 on H200)
    "kimi-k2": Acceptance(2.88, 4, "Kimi-K2.5 with an EAGLE-3 draft, 3 draft tokens: published mean acceptance "
                          "length (SGLang's Kimi K2.5 EAGLE-3 support, 8x H200)"),
}


def default_acceptance(model: str, draft: int) -> Acceptance | None:
    """The published acceptance length for ``model`` at ``draft`` tokens verified per sequence, if one exists."""
    found = ACCEPTANCE.get(model)
    return found if found is not None and found.draft == draft else None


def tokens_per_s(batch: int, accept: float, step_us: float | None) -> float | None:
    """Tokens a step of ``step_us`` yields per second when each of ``batch`` sequences keeps ``accept``
    tokens per step; None without a time."""
    return None if step_us is None or step_us <= 0 else batch * accept / (step_us * 1e-6)


class ModelError(ValueError):
    """A --model value that names no model shape and is not hidden=..,layers=..[,dtype=..][,allreduces=..]."""


@dataclass(frozen=True)
class Model:
    name: str
    label: str
    hidden: int
    layers: int
    dtype: str
    dtype_bytes: int
    allreduces_per_layer: int = 2
    source: str = ""  # where the shape comes from ("" for one given on the command line)

    @property
    def allreduces(self) -> int:
        return self.layers * self.allreduces_per_layer

    def message_bytes(self, tokens: int) -> int:
        return tokens * self.hidden * self.dtype_bytes


def model_shapes() -> dict[str, Model]:
    """The model shapes of ``inenv.models`` by name."""
    sizes = model_table.DTYPE_BYTES
    out: dict[str, Model] = {}
    for name, d in model_table.SHAPES.items():
        dtype, src = str(d["dtype"]), model_table.SOURCES[name]
        out[name] = Model(name, src["label"], int(str(d["hidden"])), int(str(d["layers"])), dtype, sizes[dtype],
                          int(str(d.get("allreduces_per_layer", 2))), f"{src['config']}. {src['checked']}")
    return out


def default_shape() -> Model:
    return model_shapes()[model_table.DEFAULT]


def parse_model(spec: str) -> Model:
    """A model shape's name, or ``hidden=7168,layers=61[,dtype=bf16][,allreduces=2]``; ModelError says what is wrong."""
    known = model_shapes()
    if spec in known:
        return known[spec]
    sizes: dict[str, int] = model_table.DTYPE_BYTES
    if "=" not in spec:
        raise ModelError(f"unknown model {spec!r}; model shapes: {', '.join(sorted(known))}, "
                         "or give hidden=..,layers=..[,dtype=bf16][,allreduces=2]")
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("hidden", "layers", "dtype", "allreduces"):
            raise ModelError(f"{part.strip()!r} is not one of hidden=N, layers=N, dtype={'|'.join(sizes)}, "
                             "allreduces=N")
        fields[key] = value.strip()
    for key in ("hidden", "layers", "allreduces"):
        if key in fields and not (fields[key].isdigit() and int(fields[key]) > 0):
            raise ModelError(f"{key}={fields[key]!r}: give a positive integer")
    if "hidden" not in fields or "layers" not in fields:
        raise ModelError("give both hidden=N and layers=N")
    dtype = fields.get("dtype", "bf16")
    if dtype not in sizes:
        raise ModelError(f"dtype={dtype!r}: one of {', '.join(sizes)}")
    return Model("custom", f"hidden {fields['hidden']}, {fields['layers']} layers", int(fields["hidden"]),
                 int(fields["layers"]), dtype, int(sizes[dtype]), int(fields.get("allreduces", "2")))


# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    us: float
    how: str  # measured | interpolated | below-range (the smallest size's latency: an upper bound)


def interpolate(curve: Mapping[int, float], nbytes: int) -> Point | None:
    """One call's latency at ``nbytes`` from a measured curve; None above the largest measured size."""
    if not curve:
        return None
    xs = sorted(curve)
    if nbytes in curve:
        return Point(curve[nbytes], "measured")
    if nbytes < xs[0]:
        return Point(curve[xs[0]], "below-range")
    if nbytes > xs[-1]:
        return None
    hi = next(x for x in xs if x > nbytes)
    lo = max(x for x in xs if x < nbytes)
    t = (nbytes - lo) / (hi - lo)
    return Point(curve[lo] + t * (curve[hi] - curve[lo]), "interpolated")


@dataclass(frozen=True)
class StepCost:
    tokens: int
    nbytes: int  # one allreduce
    per_call: Point | None
    total_us: float | None  # per step: allreduces x per_call
    saving: float | None  # 1 - total / NCCL's total


@dataclass(frozen=True)
class Row:
    backend: str
    decode: StepCost
    verify: StepCost
    ids: tuple[str, ...]


@dataclass(frozen=True)
class Estimate:
    model: Model
    ranks: int
    batch: int
    draft: int
    measured_dtype: str
    rows: tuple[Row, ...]
    baseline: str
    host_id: str
    cell_id: str


def _step(model: Model, curve: Curve, tokens: int) -> tuple[int, Point | None, float | None]:
    n = model.message_bytes(tokens)
    p = interpolate(curve.latency_us, n)
    return n, p, (None if p is None else p.us * model.allreduces)


def estimate(advice: CellAdvice, model: Model, batch: int = DEFAULT_BATCH, draft: int = DEFAULT_DRAFT) -> Estimate:
    """Per working backend of ``advice`` (the same backends, so the same exact-both-ways evidence), the
    allreduce time of a decode step and a verify step, and the saving against NCCL's curve."""
    curves: Sequence[Curve] = advice.curves
    base = next((c for c in curves if c.backend == BASELINE), None)
    base_cost = {}
    if base is not None:
        base_cost = {"decode": _step(model, base, batch)[2], "verify": _step(model, base, batch * draft)[2]}
    rows = []
    for c in curves:
        steps = {}
        for kind, tokens in (("decode", batch), ("verify", batch * draft)):
            n, point, total = _step(model, c, tokens)
            ref = base_cost.get(kind)
            saving = None if total is None or not ref else 1 - total / ref
            steps[kind] = StepCost(tokens, n, point, total, saving)
        rows.append(Row(c.backend, steps["decode"], steps["verify"], c.ids))
    return Estimate(model, advice.ranks, batch, draft, "bf16", tuple(rows), BASELINE, advice.host_id, advice.cell_id)

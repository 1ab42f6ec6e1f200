"""The step probe's model step: the cases (a decode step, a speculative verify step), the model shapes' blocks as
one rank runs them under tensor parallelism (Model: matmul, allreduce through a backend's adapter, residual add
and RMSNorm), one case built, checked exactly and timed against its baseline (run_case), and the agreement check
bound to a backend (agreement_bind), and the shallow selection run by another probe's ranks (shallow_agreement). Not a
probe (no SPEC): step, pcie-ipc and fi-fusion carry it in their hashes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inenv import models
from inenv.kit import _agree, _data, _device, _dist, _errors, _kernels, _timing
from inenv.kit._data import EPS, norm_check, reference
from inenv.probes.stepcomm import Comm, make_comm

DECODE_BATCHES = (1, 8, 32)
VERIFY = ((8, 3), (8, 7), (32, 3), (32, 7))  # (batch, draft): EAGLE-3 / MTP draft lengths
REPLAYS = 10  # timed replays per graph: a replay is a whole step of 122-188 allreduces, so 10 give a steady median
OP_DEADLINE_S = 60.0


@dataclass(frozen=True)
class Case:
    phase: str  # decode | verify
    batch: int
    draft: int = 0

    @property
    def tokens(self) -> int:
        return self.batch * (1 + self.draft)

    @property
    def key(self) -> str:
        return f"decode:{self.batch}" if self.phase == "decode" else f"verify:{self.batch}x{self.draft}"


CASES = (*(Case("decode", b) for b in DECODE_BATCHES), *(Case("verify", b, d) for b, d in VERIFY))
MAX_TOKENS = max(c.tokens for c in CASES)


def same_graph(cases: tuple[Case, ...]) -> dict[str, str]:
    """Case key -> the key of the first earlier case of the same token count. A case's graphs depend on its token
    count alone (the blocks have no attention, so a decode step of 32 tokens and a verify step of 8 x (1 + 3) are
    one graph), so such a case is measured once and reported under both keys."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for case in cases:
        if case.tokens in first:
            out[case.key] = first[case.tokens]
        else:
            first[case.tokens] = case.key
    return out


# --------------------------------------------------------------------------------------------------
# The model's blocks


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    attn_in: int  # this rank's o_proj input width (attn_out / tp)
    mlp_in: int  # this rank's down_proj input width (mlp_out / tp)

    @property
    def blocks(self) -> int:
        return 2 * self.layers


def shapes(world: int) -> list[Shape]:
    out = []
    for name, d in models.SHAPES.items():
        if d.get("dtype") != "bf16":
            continue
        attn, mlp = int(str(d["attn_out"])), int(str(d["mlp_out"]))
        out.append(Shape(name, int(str(d["hidden"])), int(str(d["layers"])), max(1, attn // world),
                         max(1, mlp // world)))
    return out


def _perm(width: int, hidden: int, mul: int, add: int, device: Any) -> Any:
    """Column j of a one-hot weight picks input element ``(j * mul + add) % width``."""
    import torch

    return (torch.arange(hidden, device=device, dtype=torch.int64) * mul + add) % width


def _one_hot(perm: Any, width: int, hidden: int, device: Any) -> Any:
    import torch

    w = torch.zeros(width, hidden, dtype=torch.bfloat16, device=device)
    w[perm, torch.arange(hidden, device=device)] = 1
    return w


class Model:
    """One rank's weights, inputs and outputs for one shape; ``load(seed)`` rewrites the inputs and resets every
    output to the sentinel, ``expected(seed)`` is the exact final residual from the input formula."""

    def __init__(self, shape: Shape, rank: int, world: int, device: Any, comm: Comm | None,
                 flat: dict[str, Any]) -> None:
        import torch

        self.s, self.rank, self.world, self.device = shape, rank, world, device
        h = shape.hidden
        self.perm_a = _perm(shape.attn_in, h, 7, 1, device)
        self.perm_m = _perm(shape.mlp_in, h, 5, 3, device)
        self.w_a = _one_hot(self.perm_a, shape.attn_in, h, device)
        self.w_m = _one_hot(self.perm_m, shape.mlp_in, h, device)
        self.x_a = torch.empty(MAX_TOKENS, shape.attn_in, dtype=torch.bfloat16, device=device)
        self.x_m = torch.empty(MAX_TOKENS, shape.mlp_in, dtype=torch.bfloat16, device=device)
        self.nx_a, self.nx_m = torch.empty_like(self.x_a), torch.empty_like(self.x_m)
        self.gamma = (1 + torch.arange(h, device=device) % 3).to(torch.bfloat16)
        self.flat = flat
        self.comm = comm
        self.tokens = 0

    def view(self, name: str, tokens: int) -> Any:
        return self.flat[name][: tokens * self.s.hidden].view(tokens, self.s.hidden)

    def load(self, tokens: int, seed: int) -> None:
        self.tokens = tokens
        self.x_a[:tokens].copy_(_data.pattern((tokens, self.s.attn_in), self.rank, seed, self.device))
        self.x_m[:tokens].copy_(_data.pattern((tokens, self.s.mlp_in), self.rank, seed + 1, self.device))
        self.nx_a[:tokens].copy_(-self.x_a[:tokens])
        self.nx_m[:tokens].copy_(-self.x_m[:tokens])
        self.view("res0", tokens).copy_(_data.pattern((tokens, self.s.hidden), 0, seed + 1000, self.device))
        for name in ("res_a", "res_b", "norm", "out"):
            self.view(name, tokens).fill_(_data.SENTINEL)

    def sums(self, tokens: int, seed: int, world: int) -> tuple[Any, Any]:
        """(attention block sum, MLP block sum) over ``world`` ranks of the positive-sign layers, as int64."""
        import torch

        a = _data.pattern_sum((tokens, self.s.attn_in), world, seed, self.device, torch.int64)[:, self.perm_a]
        m = _data.pattern_sum((tokens, self.s.mlp_in), world, seed + 1, self.device, torch.int64)[:, self.perm_m]
        return a, m

    def expected(self, tokens: int, seed: int, with_comm: bool) -> tuple[Any, Any, Any]:
        """(final residual, the residual before the last block, the last block's sum): layer l adds
        ``(-1)**l * (attention + MLP)``, so after an odd layer count the residual is res0 + attention + MLP."""
        import torch

        if with_comm:
            a, m = self.sums(tokens, seed, self.world)
        else:  # the baseline: each rank's own block outputs, no allreduce
            a = _data.pattern((tokens, self.s.attn_in), self.rank, seed, self.device, torch.int64)[:, self.perm_a]
            m = _data.pattern((tokens, self.s.mlp_in), self.rank, seed + 1, self.device, torch.int64)[:, self.perm_m]
        res0 = _data.pattern((tokens, self.s.hidden), 0, seed + 1000, self.device, torch.int64)
        if self.s.layers % 2:  # the last layer adds: res0 before it, + attention, then + MLP
            before_last, last = res0 + a, m
        else:  # the last layer subtracts: res0 + attention + MLP before it, - attention, then - MLP
            before_last, last = res0 + m, -m
        final = before_last + last
        return final.to(torch.bfloat16), before_last.to(torch.bfloat16), last.to(torch.bfloat16)

    def step(self, tokens: int, with_comm: bool) -> Callable[[], None]:
        """The graph body: every block's matmul, allreduce (skipped for the baseline), residual add and RMSNorm."""
        import torch

        comm = self.comm
        fused = with_comm and comm is not None and comm.fused
        inp = comm.comm_input(tokens * self.s.hidden).view(tokens, self.s.hidden) if comm else None
        local = self.view("out", tokens) if inp is None else inp
        out = self.view("out", tokens)
        res = [self.view("res_a", tokens), self.view("res_b", tokens)]
        res0, norm, gamma = self.view("res0", tokens), self.view("norm", tokens), self.gamma
        rms = getattr(torch.nn.functional, "rms_norm", None)
        blocks = [(x, w) for layer in range(self.s.layers)
                  for x, w in (((self.x_a, self.w_a), (self.x_m, self.w_m)) if layer % 2 == 0
                               else ((self.nx_a, self.w_a), (self.nx_m, self.w_m)))]

        def body() -> None:
            res_in = res0
            for i, (x, w) in enumerate(blocks):
                res_out = res[i % 2]
                torch.matmul(x[:tokens], w, out=local)
                if fused:
                    comm.fused_op(local, res_in, gamma, res_out, norm)  # type: ignore[union-attr]
                else:
                    summed = local
                    if with_comm and comm is not None:
                        summed = local if comm.in_place else out
                        comm.reduce(local, summed)
                    torch.add(summed, res_in, out=res_out)
                    if rms is not None:
                        norm.copy_(rms(res_out, (self.s.hidden,), gamma, EPS))
                    else:
                        xf = res_out.float()
                        norm.copy_(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float())
                res_in = res_out

        return body

    def comm_only(self, tokens: int) -> Callable[[], None]:
        """The same allreduces back to back, nothing between them (the fused op for a fused backend)."""
        comm = self.comm
        assert comm is not None
        inp = comm.comm_input(tokens * self.s.hidden).view(tokens, self.s.hidden)
        out = inp if comm.in_place else self.view("out", tokens)
        res = [self.view("res_a", tokens), self.view("res_b", tokens)]
        norm, gamma = self.view("norm", tokens), self.gamma

        def body() -> None:
            for i in range(self.s.blocks):
                if comm.fused:
                    comm.fused_op(inp, res[i % 2], gamma, res[(i + 1) % 2], norm)
                else:
                    comm.reduce(inp, out)

        return body

    def final(self, tokens: int) -> Any:
        return self.view("res_b" if self.s.blocks % 2 == 0 else "res_a", tokens)


# --------------------------------------------------------------------------------------------------
# Measurement


def kernels_of(graph: Any) -> dict[str, Any]:
    """The communication kernels a replay of ``graph`` (captured with ``keep=True``, nothing but the backend's
    calls in it) launches (:func:`comm_kernels`), and how they were read (``read_from``: the graph itself, or
    one replay under torch's profiler where torch keeps no graph: ``inenv.kit._kernels.launched``)."""
    names, how = _kernels.launched(graph)
    return {**comm_kernels(names), "read_from": how}


def comm_kernels(launched: Counter[str] | str) -> dict[str, Any]:
    """The kernels a graph of the backend's calls alone launched, by name and count, and whether any is NCCL's; a
    reading that failed is its error (pure)."""
    if isinstance(launched, str):
        return {"error": launched}
    return {"kernels": dict(sorted(launched.items())), "nccl": any("nccl" in name.lower() for name in launched)}


def _check(model: Model, tokens: int, seed: int, with_comm: bool, fused: bool) -> dict[str, Any]:
    final, before_last, last = model.expected(tokens, seed, with_comm)
    got = model.final(tokens)
    chk = _data.check_exact(got, final, prior=_data.filled((tokens, model.s.hidden)))
    out: dict[str, Any] = {"verdict": "ok" if chk.ok else chk.verdict, "residual": chk.to_json()}
    if chk.ok and fused:
        _, ref_norm = reference(last, before_last, model.gamma)
        norm = norm_check(model.view("norm", tokens), ref_norm)
        out["norm"] = norm
        if not norm["within_1ulp"]:
            out["verdict"] = "wrong"
            out["detail"] = f"RMSNorm output off by up to {norm['max_abs_err']}"
    if not chk.ok:
        out["detail"] = chk.detail
    return out


def run_case(model: Model, case: Case, gloo: Any, barrier: Callable[[], None]) -> dict[str, Any]:
    """Capture, check on two inputs and time one case: the step and baseline graphs, then the allreduces-alone
    graph, whose kernels are read (:func:`kernels_of`) and which is timed. Every rank reaches every agreement point
    whatever failed where, so the ranks stay in step. Never raises."""
    tokens = case.tokens
    comm = model.comm
    assert comm is not None
    res: dict[str, Any] = {"tokens": tokens, "message_bytes": tokens * model.s.hidden * 2}
    refused, error = None, ""
    graphs: dict[str, Any] = {}
    try:
        model.load(tokens, 1)
        refused = comm.before_capture(comm.comm_input(tokens * model.s.hidden).view(tokens, model.s.hidden))
        res.update(comm.shape_facts())
        if refused is None:
            graphs["step"] = _device.capture(model.step(tokens, True), calls=1, warmup=1)
            comm.after_capture()
            graphs["baseline"] = _device.capture(model.step(tokens, False), calls=1, warmup=1)
    except Exception as exc:
        error = _errors.error_tail(exc)
    if not _dist.agree(refused is None and not error, gloo):
        if refused is not None:
            return {**res, "verdict": "refused", "detail": refused["refused"]}
        return {**res, "verdict": "error", "error": error or "a peer rank failed to capture"}
    local: dict[str, Any] = {"verdict": "ok"}
    for seed in (2, 3):
        try:
            for name, with_comm in (("step", True), ("baseline", False)):
                model.load(tokens, seed)
                graphs[name].replay()
                _device.wait_device(OP_DEADLINE_S)
                found = _check(model, tokens, seed, with_comm, with_comm and comm.fused)
                if found["verdict"] != "ok":
                    local = {**found, "graph": name, "seed": seed}
                    break
        except Exception as exc:
            local = _dist.raised(exc)
        if (stopped := _dist.settle(local, gloo)) is not None:
            return {**res, **stopped}
    try:
        timing = {name: _timing.timed_across_ranks(graphs[name].replay, REPLAYS, 1, barrier, gloo)
                  for name in ("step", "baseline")}
        model.load(tokens, 4)
        graphs["comm"] = _device.capture(model.comm_only(tokens), calls=1, warmup=1, keep=True)
        comm.after_capture()
        comm.comm_input(tokens * model.s.hidden).zero_()  # repeated in-place sums of zeros stay finite
        # the step graph's communication kernels are the allreduces-alone graph's: the same calls on the same
        # buffers at the same size, so that graph's kernels name them (no baseline to subtract)
        res["launched"] = kernels_of(graphs["comm"])
        timing["comm"] = _timing.timed_across_ranks(graphs["comm"].replay, REPLAYS, model.s.blocks, barrier, gloo)
    except Exception as exc:
        return {**res, "verdict": "error", "error": _errors.error_tail(exc)}
    res["timing"] = {name: {k: t.to_json()[k] for k in ("median_us", "p99_us", "min_us")} for name, t in timing.items()}
    return {**res, "verdict": "ok"}


def agreement_bind(comm: Comm, rank: int, world: int, flat: dict[str, Any],
                   refusals: dict[str, str] | None = None) -> Callable[[_agree.Case], _agree.Bound]:
    """How the agreement check (``_agree``) drives this backend: its own input buffer viewed in the case's dtype,
    one allreduce per call; a fused backend's residual and RMSNorm outputs both compared, against the float64
    sum plus residual and its float64 RMSNorm. A dtype the backend does not take, or a shape its policy
    refuses, raises: that case is recorded as unsupported (a refusal also in ``refusals``, by case key)."""

    def bind(case: _agree.Case) -> _agree.Bound:
        if case.dtype not in comm.dtypes:
            raise TypeError(f"{comm.name} is checked in {', '.join(comm.dtypes)} only")
        dtype = _agree.torch_dtype(case.dtype)
        shape = (case.tokens, case.hidden)
        comm.for_model(case.hidden)
        inp = comm.comm_input(case.numel).view(dtype).view(shape)
        if not comm.fused:
            refused = comm.before_capture(inp)
            if refused is not None:
                if refusals is not None:
                    refusals[case.key] = refused["refused"]
                raise ValueError(refused["refused"])
            out = inp if comm.in_place else flat["out"][: case.numel].view(dtype).view(shape)
            return _agree.allreduce_bound(case, inp.view(-1), out.view(-1), lambda: comm.reduce(inp, out), rank,
                                          world, comm.after_capture)
        return _fused_bound(case, comm, inp, rank, world, flat)

    return bind


def flat_buffers(max_numel: int, device: Any) -> dict[str, Any]:
    """The step's scratch buffers, ``max_numel`` bf16 elements each, that a fused backend's residual and RMSNorm
    outputs and a backend's separate output are viewed from (the model and :func:`agreement_bind`)."""
    import torch

    return {k: torch.empty(max_numel, device=device, dtype=torch.bfloat16)
            for k in ("res0", "res_a", "res_b", "norm", "out")}


def shallow_checks(comm: Comm, rank: int, world: int, flat: dict[str, Any], group: Any, device: Any,
                   log: Callable[[str], None] = lambda _: None,
                   refusals: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The shallow selection's agreement cases on a backend set up for them (``_agree.shallow_cases``: one per
    dtype it takes, in a graph), bound by :func:`agreement_bind` on a side stream, checked exactly, each graph's
    kernels read (:func:`kernels_of`): the records by case key, as ``_agree.run_cases`` gives them."""
    with _timing.side_stream(device):
        return _agree.run_cases(agreement_bind(comm, rank, world, flat, refusals), _agree.shallow_cases(comm.dtypes),
                                group, log, exact=True, profile=kernels_of)


def shallow_agreement(name: str, rank: int, world: int, device: Any, group: Any,
                      log: Callable[[str], None] = lambda _: None) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The step's shallow selection on backend ``name``, run by another probe's ranks sharing a GPU (pcie-ipc,
    fi-fusion), so the step need not start processes of its own there: the backend's adapter set up on ``group``
    at the largest model hidden size, then :func:`shallow_checks`. (agreement records by case key; the adapter's
    evidence). A set-up that fails raises, on this rank."""
    max_numel = _agree.max_numel()
    comm = make_comm(name, rank, world, device, group, max_numel, max(_agree.TOKENS))
    comm.for_model(max(_agree.hiddens()))
    return shallow_checks(comm, rank, world, flat_buffers(max_numel, device), group, device, log), comm.evidence()


def _fused_bound(case: _agree.Case, comm: Comm, inp: Any, rank: int, world: int,
                 flat: dict[str, Any]) -> _agree.Bound:
    """A fused allreduce + residual add + RMSNorm: the residual stream and gamma are the same on every rank."""
    import torch

    shape = (case.tokens, case.hidden)
    res_in, res_out, norm = (flat[k][: case.numel].view(shape) for k in ("res0", "res_a", "norm"))
    gamma = _agree.random_input((case.hidden,), -1, 99, case.dtype, inp.device)

    def load(seed: int) -> None:
        inp.copy_(_agree.random_input(shape, rank, seed, case.dtype, inp.device))
        res_in.copy_(_agree.random_input(shape, -1, seed + 1, case.dtype, inp.device))
        res_out.fill_(_agree.UNTOUCHED)
        norm.fill_(_agree.UNTOUCHED)

    def residual(seed: int) -> Any:
        return _agree.exact_sum(shape, world, seed, case.dtype) + _agree.random_input(
            shape, -1, seed + 1, case.dtype).to(torch.float64)

    def reference(seed: int) -> dict[str, Any]:
        res = residual(seed)
        return {"residual": res, "norm": _agree.rms_norm64(res, gamma.cpu(), EPS)}

    def scale(seed: int) -> dict[str, Any]:
        # the residual's terms' magnitude; the norm's is that magnitude carried through the same row scaling
        # (an element the norm leaves near zero still carries the rounding of terms of that size)
        magnitude = _agree.exact_sum(shape, world, seed, case.dtype, magnitude=True) + _agree.random_input(
            shape, -1, seed + 1, case.dtype).to(torch.float64).abs()
        res = residual(seed)
        row = torch.rsqrt(res.pow(2).mean(dim=-1, keepdim=True) + EPS)
        return {"residual": magnitude, "norm": magnitude * row * gamma.cpu().to(torch.float64).abs()}

    def load_exact(seed: int) -> None:
        inp.copy_(_data.pattern(shape, rank, seed, inp.device, inp.dtype))
        res_in.copy_(_data.pattern(shape, 0, seed + 1000, inp.device, inp.dtype))
        res_out.fill_(_data.SENTINEL)
        norm.fill_(_data.SENTINEL)

    def verify(seed: int) -> dict[str, Any]:
        # the residual is an integer sum, exact; the norm within one ulp of the fp32 RMSNorm of it, as fi-fusion
        total = _data.pattern_sum(shape, world, seed, inp.device, inp.dtype)
        want_res = (total.double() + res_in.double()).to(inp.dtype)
        want_norm = _rms_norm32(want_res, gamma)
        res = _data.check_exact(res_out, want_res, prior=_data.filled(shape)).to_json()
        if res["verdict"] != "exact":
            return res
        checked = norm_check(norm, want_norm)
        if checked["within_1ulp"]:
            return {**res, "norm": checked}
        verdict = "no-op" if checked["untouched"] else "wrong"
        return {**res, "verdict": verdict, "norm": checked,
                "detail": f"RMSNorm output off by up to {checked['max_abs_err']}"}

    return _agree.Bound(load, lambda: comm.fused_op(inp, res_in, gamma, res_out, norm),
                        lambda: {"residual": res_out, "norm": norm}, reference, comm.after_capture, scale,
                        _agree.Exact(load_exact, verify))


def _rms_norm32(x: Any, gamma: Any) -> Any:
    """RMSNorm over the last dimension in fp32, rounded once to ``x``'s dtype: what a fused kernel computes."""
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + EPS) * gamma.float()).to(x.dtype)

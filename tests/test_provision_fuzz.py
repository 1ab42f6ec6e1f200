"""No matrix file, however broken, makes `provision plan` print a traceback: exit 0 or one line and exit 2."""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from provision.cli import main

WORDS = ["matrix", "cuda", "torch", "sgl_kernel", "flashinfer", "include", "exclude", "preset", "jit_cache",
         "description", "stable", "nightly", "none", "12.8", "13.0", "0.4.2", "0.6.17", "sglang-0.5.11", "x;y"]
scalars = st.one_of(st.sampled_from(WORDS), st.integers(-3, 20), st.floats(allow_nan=True), st.booleans(),
                    st.none(), st.text(max_size=12))
values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                      st.dictionaries(st.sampled_from(WORDS), kids, max_size=5)),
                      max_leaves=25)
axes = st.fixed_dictionaries({a: st.lists(st.sampled_from(WORDS[10:]), min_size=1, max_size=3)
                              for a in ("cuda", "torch", "sgl_kernel", "flashinfer")})
shaped = st.builds(lambda m, inc, exc: {"matrix": dict(m, include=inc, exclude=exc)}, axes,
                   st.lists(st.dictionaries(st.sampled_from(WORDS[:10]), scalars, max_size=5), max_size=3),
                   st.lists(st.dictionaries(st.sampled_from(WORDS[1:5]), scalars, max_size=3), max_size=2))


def run_plan(text: str) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "m.yaml"
        f.write_text(text)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(["plan", "--matrix", str(f), "--no-reach-check"])
            except SystemExit as e:
                return int(e.code or 0), err.getvalue()
    raise AssertionError("main() must end with SystemExit")


def check(text: str) -> None:
    code, err = run_plan(text)
    assert code in (0, 2), (code, err)
    if code == 2:
        assert err.startswith("provision: ") and err.count("\n") == 1 and "Traceback" not in err, err


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_any_yaml_value(data: object) -> None:
    check(yaml.safe_dump(data))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shaped)
def test_matrix_shaped_input(data: object) -> None:
    check(yaml.safe_dump(data))


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_any_text(text: str) -> None:
    check(text)


def test_alias_bomb_and_recursion() -> None:
    check("a: &a [*a]\n")
    check("matrix: &m {cuda: *m}\n")
    check("a: &x [1,2]\nb: &y [*x,*x,*x]\nc: [*y,*y,*y]\nmatrix: {cuda: [*y]}\n")

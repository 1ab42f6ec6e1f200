"""`provision plan` shows what a cell sets beyond its versions: carried-kernel archs and the pins an engine cell
would have replaced (refused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from provision import cli


def _plan(m: Path) -> int:
    try:
        return cli.main(["plan", "--matrix", str(m)])
    except SystemExit as exc:  # the command line ends with sys.exit
        return int(exc.code or 0)

AXES = 'matrix:\n  cuda: ["13.0"]\n  torch: ["2.14.1"]\n  sgl_kernel: ["0.4.10"]\n  flashinfer: ["0.7.2"]\n'


def test_plan_shows_kernel_archs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    m = tmp_path / "m.yaml"
    m.write_text("kernel_archs: [12.0f]\n" + AXES)
    assert _plan(m) == 0
    out = capsys.readouterr().out
    assert "cu130-torch2.14.1-sgl0.4.10-fi0.7.2" in out and "kernel archs: 12.0f" in out
    m.write_text(AXES)
    assert _plan(m) == 0
    assert "carried kernels built for 9.0a,12.0a,12.0f (kernel_archs) in 1 cell(s)" in capsys.readouterr().out


def test_an_engine_cell_whose_entry_replaces_a_pin_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    m = tmp_path / "m.yaml"
    m.write_text(AXES + '  include:\n    - {preset: vllm-0.33.0, cuda: "13.0", engine: true, torch: "2.14.1"}\n')
    assert _plan(m) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matrix.include[0].torch: vllm-0.33.0 with engine: true pins torch 2.14.0" in err[0]

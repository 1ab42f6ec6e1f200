"""Verdicts reached without importing the library under test, and exact checks made where the data lives.

- ``_fi_pcie.unknown_without_import`` decides pcie-ipc (and ar-latency's flashinfer-pcie-ipc backend) before any
  rank starts when flashinfer's files show the API is absent; its verdict must be the one the ranks' own
  ``detect`` gives after importing, and it must decline whenever the files cannot tell.
- custom-ar and ar-latency skip a variant whose package is not installed before any rank starts, so it takes
  no turn on the GPUs (and the next variant's start-up is not held behind it).
- ``_data.equal_exactly`` is the fast path of ``check_exact`` (on the GPU in the probes; CPU tensors here).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inenv import gpugate
from inenv.kit import _fi_pcie
from inenv.probe import Variant
from inenv.probes import ar_latency, pcie_ipc
from tests.checks_helpers import fixture_env, run_worker

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fake_flashinfer"


def _in(site: Path, code: str) -> dict:
    """Run ``code`` (which prints one JSON line) with ``site`` first on the path, as a rank would import."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(FAKES), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_BOTH = """
import json
from inenv.kit import _api, _fi_pcie
out = {}
for op in _fi_pcie.OPS:
    pre = _fi_pcie.unknown_without_import(op)
    ranks = _fi_pcie.detect(op)
    out[op] = {"pre": pre.outcome() if pre else None,
               "ranks": ranks.outcome() if isinstance(ranks, _api.ApiUnknown) else "found"}
print(json.dumps(out))
"""


def _fake(tmp_path: Path, comm_init: str, policy: str | None, version: str = "0.7.4") -> Path:
    site = tmp_path / "site"
    comm = site / "flashinfer" / "comm"
    comm.mkdir(parents=True)
    (site / "flashinfer" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (comm / "__init__.py").write_text(comm_init)
    if policy is not None:
        (comm / "pcie_ipc_policy.py").write_text(policy)
    meta = site / f"flashinfer_python-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: {version}\n")
    return site


def test_a_flashinfer_without_the_api_is_decided_as_the_ranks_would_decide_it() -> None:
    got = _in(FAKES / "fi06", _BOTH)  # the stand-in 0.6.18: no PCIe IPC names anywhere
    for op, both in got.items():
        assert both["pre"] is not None, op
        assert both["pre"] == both["ranks"], op  # same status, reason, note and evidence
        assert (both["pre"]["status"], both["pre"]["reason_code"]) == ("skip", "probe-api-unknown")
        assert "flashinfer-python 0.6.18" in both["pre"]["note"]


def test_a_flashinfer_with_the_api_is_left_to_the_ranks(tmp_path: Path) -> None:
    site = _fake(tmp_path, "class PcieIpcAllReduceWorkspace: ...\nclass PcieIpcAllGatherWorkspace: ...\n"
                 "class PcieIpcReduceScatterWorkspace: ...\n", "def get_pcie_ipc_launch_config(): ...\n")
    got = _in(site, _BOTH)
    assert all(both == {"pre": None, "ranks": "found"} for both in got.values()), got


def test_a_name_defined_in_another_file_of_the_package_counts_as_present(tmp_path: Path) -> None:
    # Re-exported from a submodule: the name is spelt in the package's sources, so only an import can tell.
    site = _fake(tmp_path, "from flashinfer.comm.pcie import *\n", "def get_pcie_ipc_launch_config(): ...\n")
    (site / "flashinfer" / "comm" / "pcie.py").write_text("class PcieIpcAllGatherWorkspace: ...\n")
    got = _in(site, _BOTH)
    assert got["all-gather"] == {"pre": None, "ranks": "found"}
    assert got["reduce-scatter"]["pre"] == got["reduce-scatter"]["ranks"] != "found"


def test_a_missing_module_decides_even_when_the_attribute_is_spelt_somewhere(tmp_path: Path) -> None:
    site = _fake(tmp_path, "class PcieIpcAllReduceWorkspace: ...\n", None)  # no pcie_ipc_policy module
    got = _in(site, _BOTH)
    assert got["all-reduce"]["pre"] == got["all-reduce"]["ranks"]
    assert "pcie_ipc_policy" in got["all-reduce"]["pre"]["note"]


def test_an_extension_module_beside_the_attribute_is_left_to_the_ranks(tmp_path: Path) -> None:
    # Names an extension module provides are spelt in no Python source: the files cannot tell.
    site = _fake(tmp_path, "from flashinfer.comm._native import *\n", "def get_pcie_ipc_launch_config(): ...\n")
    (site / "flashinfer" / "comm" / "_native.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    assert _in(site, "import json\nfrom inenv.kit import _fi_pcie\n"
               "print(json.dumps([_fi_pcie.unknown_without_import(op) is None for op in _fi_pcie.OPS]))") \
        == [True, True, True]


def test_the_probes_preflight_only_their_flashinfer_variants(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(_fake(tmp_path, "", None)))  # installed: its files decide the API
    unknown = _fi_pcie._api.ApiUnknown("flashinfer-python", "0.6.8.post1", ("flashinfer.comm:X",))
    asked: list[str] = []

    def fake(op: str) -> object:
        asked.append(op)
        return unknown

    monkeypatch.setattr(_fi_pcie, "unknown_without_import", fake)
    assert ar_latency.preflight(Variant("ar-latency", 2, (("backend", "nccl"),))) is None
    assert ar_latency.preflight(Variant("ar-latency", 2, (("backend", "flashinfer-pcie-ipc"),))) == unknown.outcome()
    assert pcie_ipc.preflight(Variant("pcie-ipc", 4, (("op", "all-gather"),), share_gpu=True)) == unknown.outcome()
    assert asked == ["all-reduce", "all-gather"]
    monkeypatch.setattr(_fi_pcie, "unknown_without_import", lambda op: None)
    assert pcie_ipc.preflight(Variant("pcie-ipc", 2, (("op", "all-reduce"),))) is None


_MISSING = """
import json
from inenv.probe import Variant
from inenv.probes import ar_latency, custom_ar
v = lambda probe, **params: Variant(probe, 2, tuple(params.items()))
print(json.dumps({"fi": custom_ar.preflight(v("custom-ar", impl="flashinfer")),
                  "sgl": custom_ar.preflight(v("custom-ar", impl="sgl_kernel")),
                  "ar_fi": ar_latency.preflight(v("ar-latency", backend="flashinfer-custom-ar")),
                  "ar_nccl": ar_latency.preflight(v("ar-latency", backend="nccl"))}))
"""


def test_a_variant_whose_package_is_not_installed_is_skipped_before_any_rank(tmp_path: Path) -> None:
    with_fi = _in(_fake(tmp_path, "", None), _MISSING)  # flashinfer installed, sgl_kernel not
    assert with_fi["fi"] is None and with_fi["ar_fi"] is None and with_fi["ar_nccl"] is None
    assert with_fi["sgl"]["status"] == "skip" and with_fi["sgl"]["reason_code"] == "missing-package"
    assert "sgl_kernel is not installed" in with_fi["sgl"]["note"]
    bare = _in(tmp_path / "nothing", _MISSING)
    assert bare["fi"]["reason_code"] == bare["ar_fi"]["reason_code"] == "missing-package"
    assert "flashinfer is not installed" in bare["fi"]["note"] and bare["ar_nccl"] is None


def test_a_variant_decided_before_launch_takes_no_turn_on_the_gpus(tmp_path: Path) -> None:
    """The GPU lock is held all along: a variant that needs no rank is still decided, not `gpus-busy`."""
    lock = tmp_path / "gpu.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result, _ = run_worker("custom-ar", ranks=2, params=[["impl", "sgl_kernel"]],
                               env=fixture_env(**{gpugate.ENV: str(lock)}), extra_args=["--gpus", "2", "--queue", "1"])
    assert result["status"] == "skip" and result["reason_code"] == "missing-package", result


# --- exact checks where the data lives -------------------------------------------------------------------------
def test_equal_exactly_and_check_exact_agree() -> None:
    torch = pytest.importorskip("torch")
    from inenv.kit import _data

    ref = _data.pattern_sum((4, 16), 4, 3, dtype=torch.float64)
    out = ref.to(torch.bfloat16)
    assert _data.equal_exactly(out, ref) and _data.check_exact(out, ref).verdict == "exact"
    wrong = out.clone()
    wrong[1, 2] += 1
    assert not _data.equal_exactly(wrong, ref) and _data.check_exact(wrong, ref).verdict == "wrong"
    assert not _data.equal_exactly(out.reshape(-1)[:10], ref)  # a different element count is never equal
    inf_ref = ref.clone()
    inf_ref[0, 0] = float("inf")
    inf_out = inf_ref.clone()
    # An infinite reference is no exact result (the full check counts inf - inf as a mismatch): both say so.
    assert not _data.equal_exactly(inf_out, inf_ref) and not _data.check_exact(inf_out, inf_ref).ok
    noop = torch.full((4, 16), _data.SENTINEL, dtype=torch.bfloat16)
    assert _data.check_exact(noop, ref, prior=_data.filled((4, 16))).verdict == "no-op"

"""The engine probe's reader, on engine packages laid out in a temporary folder.

Each case builds an installed-looking distribution (its dist-info, so importlib.metadata finds it) holding
the modules where a real engine release defines its gates, then runs the probe in a fresh interpreter with
that folder first on the path, the way the worker runs it in a cell. The values are written here and checked
as written: the probe must hand them over as the engine holds them, keys spelled as the engine spells them.
The run against a real vLLM release is recorded under results/ by `checks run --probe engine`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.checks_helpers import ROOT

VLLM_COMM = "vllm/distributed/device_communicators"

RUN = """
import json, sys
from pathlib import Path
from inenv.probe import RankContext, Variant
from inenv.probes import engine
ctx = RankContext(0, 1, 0, None, Variant("engine", 1, (("engine", sys.argv[1]),)), Path(sys.argv[2]))
print(json.dumps(engine.run(ctx)))
"""


def _dist(root: Path, name: str, version: str, files: dict[str, str]) -> None:
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _run(root: Path, engine: str) -> dict:
    env = {"PYTHONPATH": f"{root}:{ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", RUN, engine, str(root)], capture_output=True, text=True,
                          env=env, timeout=60, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _vllm(root: Path, utils: str, pcie: str = "_SUPPORTED_WORLD_SIZES = (2, 4, 8)\n") -> None:
    _dist(root, "vllm", "9.1.0", {
        "vllm/__init__.py": "",
        "vllm/distributed/__init__.py": "",
        f"{VLLM_COMM}/__init__.py": "",
        f"{VLLM_COMM}/all_reduce_utils.py": utils,
        f"{VLLM_COMM}/custom_all_reduce.py": "class CustomAllreduce:\n    _SUPPORTED_WORLD_SIZES = [2, 4, 6, 8]\n",
        f"{VLLM_COMM}/symm_mem.py": "class SymmMemCommunicator:\n    _WORLD_SIZES_MULTIMEM = {'9.0': [4, 8]}\n",
        f"{VLLM_COMM}/flashinfer_pcie_ipc_all_reduce.py": pcie,
    })


UTILS = """
CUSTOM_ALL_REDUCE_MAX_SIZES = {"9.0": {2: 1024, 4: 512}}
SYMM_MEM_ALL_REDUCE_MAX_SIZES = {"9.0": {2: 2048}, "10.0": {8: 4096}}
"""


def test_every_gate_read_as_the_engine_holds_it(tmp_path: Path) -> None:
    _vllm(tmp_path, UTILS)
    out = _run(tmp_path, "vllm")
    assert out["status"] == "pass", out
    assert out["metrics"]["gates_read"] == 5
    gates = out["evidence"]["gates"]
    assert gates["custom-ar-max-bytes"]["value"] == {"9.0": {"2": 1024, "4": 512}}
    assert gates["custom-ar-max-bytes"]["keys"] == "str"
    assert gates["symm-mem-max-bytes"]["value"] == {"9.0": {"2": 2048}, "10.0": {"8": 4096}}
    assert gates["custom-ar-world-sizes"]["value"] == [2, 4, 6, 8]
    assert gates["pcie-ipc-world-sizes"]["value"] == [2, 4, 8]
    assert gates["symm-mem-multimem-world-sizes"]["value"] == {"9.0": [4, 8]}
    assert gates["symm-mem-max-bytes"]["where"].endswith("all_reduce_utils:SYMM_MEM_ALL_REDUCE_MAX_SIZES")
    assert out["evidence"]["version"] == "9.1.0"


def test_a_gate_the_release_does_not_define_is_named_not_guessed(tmp_path: Path) -> None:
    _vllm(tmp_path, 'CUSTOM_ALL_REDUCE_MAX_SIZES = {"9.0": {2: 1024}}\n')
    out = _run(tmp_path, "vllm")
    assert out["status"] == "partial" and out["reason_code"] == "engine-gate-moved", out
    assert "SYMM_MEM_ALL_REDUCE_MAX_SIZES" in out["note"] and "9.1.0" in out["note"]
    assert out["evidence"]["gates"]["symm-mem-max-bytes"]["found"] is False
    assert out["metrics"]["gates_read"] == 4


def test_a_gate_module_that_does_not_import_is_unread_with_its_error(tmp_path: Path) -> None:
    _vllm(tmp_path, UTILS, pcie="import libcuda_driver_here  # noqa\n")
    out = _run(tmp_path, "vllm")
    assert out["status"] == "partial" and out["reason_code"] == "engine-gate-unread", out
    why = out["evidence"]["gates"]["pcie-ipc-world-sizes"]["why"]
    assert "ModuleNotFoundError" in why and "libcuda_driver_here" in why


def test_an_engine_that_does_not_import_fails_the_cell(tmp_path: Path) -> None:
    _dist(tmp_path, "vllm", "9.1.0", {"vllm/__init__.py": "raise ImportError('undefined symbol: _ZN3c10')\n"})
    out = _run(tmp_path, "vllm")
    assert out["status"] == "fail" and out["reason_code"] == "engine-import-error", out
    assert "undefined symbol: _ZN3c10" in out["note"]


def test_an_absent_engine_is_a_skip(tmp_path: Path) -> None:
    out = _run(tmp_path, "sglang")
    assert out["status"] == "skip" and out["reason_code"] == "missing-package"
    assert "sglang" in out["note"]


def test_sglang_tables_keep_their_integer_keys_spelled_as_integers(tmp_path: Path) -> None:
    comm = "sglang/srt/distributed/device_communicators"
    _dist(tmp_path, "sglang", "0.9.0", {
        "sglang/__init__.py": "", "sglang/srt/__init__.py": "", "sglang/srt/distributed/__init__.py": "",
        f"{comm}/__init__.py": "",
        f"{comm}/all_reduce_utils.py": "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES = {9: {2: 64}, 10: {2: 32}}\n",
        f"{comm}/custom_all_reduce.py": "class CustomAllreduce:\n    _SUPPORTED_WORLD_SIZES = [2, 4]\n"
                                        "    _MAX_CAR_SIZE = 8192\n",
        f"{comm}/torch_symm_mem.py": "class TorchSymmMemCommunicator:\n    _WORLD_SIZES_MULTIMEM = {9: [4]}\n",
        f"{comm}/pcie_ipc_ar.py": "_SUPPORTED_WORLD_SIZES = (2, 4, 8)\n",
    })
    out = _run(tmp_path, "sglang")
    assert out["status"] == "pass", out
    gates = out["evidence"]["gates"]
    assert gates["symm-mem-max-bytes"] == {**gates["symm-mem-max-bytes"], "keys": "int",
                                           "value": {"9": {"2": 64}, "10": {"2": 32}}}
    assert gates["custom-ar-max-bytes"]["value"] == 8192 and "keys" not in gates["custom-ar-max-bytes"]


def test_a_gate_module_that_exits_at_import_loses_only_that_gate(tmp_path: Path) -> None:
    _vllm(tmp_path, UTILS, pcie="import sys\nsys.exit('no PCIe IPC here')\n")
    out = _run(tmp_path, "vllm")
    assert out["status"] == "partial" and out["reason_code"] == "engine-gate-unread", out
    pcie = out["evidence"]["gates"]["pcie-ipc-world-sizes"]
    assert pcie["found"] is False and "SystemExit: no PCIe IPC here" in pcie["why"]
    assert out["metrics"]["gates_read"] == 4
    assert out["evidence"]["gates"]["custom-ar-world-sizes"]["value"] == [2, 4, 6, 8]


def test_a_gate_attribute_that_raises_on_access_loses_only_that_gate(tmp_path: Path) -> None:
    raising = ("class _Meta(type):\n"
               "    @property\n"
               "    def _SUPPORTED_WORLD_SIZES(cls):\n"
               "        raise RuntimeError('needs the CUDA driver')\n"
               "class CustomAllreduce(metaclass=_Meta):\n"
               "    pass\n")
    exits = "def __getattr__(name):\n    raise SystemExit(3)\n"
    _vllm(tmp_path, UTILS, pcie=exits)
    (tmp_path / VLLM_COMM / "custom_all_reduce.py").write_text(raising)
    out = _run(tmp_path, "vllm")
    assert out["status"] == "partial" and out["reason_code"] == "engine-gate-unread", out
    gates = out["evidence"]["gates"]
    assert gates["custom-ar-world-sizes"]["found"] is False
    assert "RuntimeError: needs the CUDA driver" in gates["custom-ar-world-sizes"]["why"]
    assert gates["pcie-ipc-world-sizes"]["found"] is False and "SystemExit: 3" in gates["pcie-ipc-world-sizes"]["why"]
    assert out["metrics"]["gates_read"] == 3
    assert gates["symm-mem-max-bytes"]["value"] == {"9.0": {"2": 2048}, "10.0": {"8": 4096}}
    assert "custom-ar-world-sizes" in out["note"] and "pcie-ipc-world-sizes" in out["note"]


def test_a_ctrl_c_during_a_gate_import_still_stops_the_run(tmp_path: Path) -> None:
    """SIGINT delivered to the probe's own process while a gate module imports: the run stops with
    KeyboardInterrupt instead of the gate being recorded as unread."""
    _vllm(tmp_path, UTILS, pcie="import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", RUN, "vllm", str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr, (proc.returncode, proc.stderr[-500:])
    assert '"status"' not in proc.stdout


def test_an_engine_package_that_exits_at_import_fails_the_cell_with_its_message(tmp_path: Path) -> None:
    _dist(tmp_path, "vllm", "9.1.0", {"vllm/__init__.py": "raise SystemExit('CUDA is required')\n"})
    out = _run(tmp_path, "vllm")
    assert out["status"] == "fail" and out["reason_code"] == "engine-import-error", out
    assert "SystemExit: CUDA is required" in out["note"]


SGL_COMM = "sglang/srt/distributed/device_communicators"
STANDIN_TORCH = """
class cuda:
    @staticmethod
    def get_device_capability(device=None):
        raise RuntimeError("Found no NVIDIA driver on your system")
    @staticmethod
    def get_device_properties(device=None):
        raise RuntimeError("Found no NVIDIA driver on your system")
"""


def _sglang(root: Path, configs: str) -> None:
    _dist(root, "sglang", "0.9.0", {
        "torch/__init__.py": STANDIN_TORCH,
        "sglang/__init__.py": "", "sglang/srt/__init__.py": "", "sglang/srt/distributed/__init__.py": "",
        f"{SGL_COMM}/all_reduce_utils.py": "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES = {9: {2: 64}}\n",
        f"{SGL_COMM}/custom_all_reduce.py": "class CustomAllreduce:\n    _SUPPORTED_WORLD_SIZES = [2, 4]\n"
                                            "    _MAX_CAR_SIZE = 8192\n",
        f"{SGL_COMM}/torch_symm_mem.py": "class TorchSymmMemCommunicator:\n    _WORLD_SIZES_MULTIMEM = {9: [4]}\n",
        f"{SGL_COMM}/pcie_ipc_ar.py": "_SUPPORTED_WORLD_SIZES = (2, 4, 8)\n",
        f"{SGL_COMM}/configs/custom_all_reduce_v2.py": configs,
    })


CONFIGS = """
from functools import cache
import torch

@cache
def _configs():
    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties().multi_processor_count
    assert sms == 1, sms
    if major == 9:
        return {n: "sm90" for n in (2, 4, 8)}
    if (major, minor) == (10, 3):
        return {n: "sm103" for n in (2, 3, 4, 5, 6, 7, 8, 16)}
    return {n: "default" for n in range(2, 17)}

@cache
def get_supported_world_sizes():
    return tuple(_configs())
"""


def test_an_engine_function_that_applies_its_gate_table_is_asked_per_capability(tmp_path: Path) -> None:
    """SGLang's custom allreduce world sizes come from a function reading the GPU through torch.cuda (cached).
    On a host without a GPU the probe asks it at each capability, and each answer is that capability's own:
    no answer from one capability leaks into the next through the engine's caches."""
    _sglang(tmp_path, CONFIGS)
    out = _run(tmp_path, "sglang")
    assert out["status"] == "pass", out
    ans = out["evidence"]["answers"]["custom-ar-v2-world-sizes"]
    assert ans["found"] is True and ans["backend"] == "custom-ar"
    assert ans["where"].endswith("configs.custom_all_reduce_v2:get_supported_world_sizes")
    assert ans["at"]["9.0"]["world_sizes"] == [2, 4, 8]
    assert ans["at"]["9.0"]["admits"] == {"2": True, "3": False, "4": True, "5": False, "6": False, "7": False,
                                          "8": True}
    assert ans["at"]["10.3"]["world_sizes"] == [2, 3, 4, 5, 6, 7, 8, 16]
    assert ans["at"]["12.0"]["world_sizes"] == list(range(2, 17))
    assert ans["at"]["10.0"]["world_sizes"] == list(range(2, 17))  # (10, 0) is not (10, 3): the default


def test_an_engine_function_that_fails_is_recorded_per_capability(tmp_path: Path) -> None:
    _sglang(tmp_path, CONFIGS.replace('return {n: "default" for n in range(2, 17)}',
                                      'raise SystemExit("unknown arch")'))
    out = _run(tmp_path, "sglang")
    at = out["evidence"]["answers"]["custom-ar-v2-world-sizes"]["at"]
    assert at["9.0"]["world_sizes"] == [2, 4, 8]
    assert at["12.0"] == {"why": "SystemExit: unknown arch"}
    assert (out["status"], out["reason_code"]) == ("partial", "engine-gate-unread"), out
    assert "custom-ar-v2-world-sizes" in out["note"] and "gave no answer at 8.0, 8.6" in out["note"]
    assert "SystemExit: unknown arch" in out["note"]
    assert out["metrics"]["gates_read"] == 5  # the gates themselves were all read


def test_an_engine_function_the_release_does_not_have_is_recorded_as_absent(tmp_path: Path) -> None:
    """An older release without the function: nothing to ask there, not a failure (the pass stands)."""
    _sglang(tmp_path, "def other():\n    return ()\n")
    out = _run(tmp_path, "sglang")
    ans = out["evidence"]["answers"]["custom-ar-v2-world-sizes"]
    assert ans["found"] is False and ans["kind"] == "absent" and "AttributeError" in ans["why"]
    assert out["status"] == "pass", out


def test_an_engine_function_whose_module_fails_to_import_makes_the_run_partial(tmp_path: Path) -> None:
    _sglang(tmp_path, "import sys\nsys.exit('JIT toolchain missing')\n")
    out = _run(tmp_path, "sglang")
    ans = out["evidence"]["answers"]["custom-ar-v2-world-sizes"]
    assert ans["found"] is False and ans["kind"] == "import" and "SystemExit: JIT toolchain missing" in ans["why"]
    assert (out["status"], out["reason_code"]) == ("partial", "engine-gate-unread"), out
    assert "custom-ar-v2-world-sizes" in out["note"]


def test_vllm_has_no_gate_function_to_ask(tmp_path: Path) -> None:
    _vllm(tmp_path, UTILS)
    assert _run(tmp_path, "vllm")["evidence"]["answers"] == {}

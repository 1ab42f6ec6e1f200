"""The Slurm executor's pure parts: reading squeue, sacct and scontrol as Slurm 22.05 really printed them
(tests/golden/checks/slurm/, recorded on the one-node cluster of tools/slurm_local.sh), the cause and
verdict of every way a job can end, the site survey's parsers, and how variants become jobs."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from checks.run.executor import hard_timeout, worker_args
from checks.run.plan import CellTarget, WorkItem
from checks.run.slurm import acct, batch, offer
from common import reasons
from inenv.probe import ProbeSpec, Variant
from inenv.status import Status

GOLDEN = Path(__file__).parent / "golden" / "checks" / "slurm"
CAT = reasons.default()


def _golden(name: str) -> str:
    return (GOLDEN / name).read_text()


# --- what Slurm printed ------------------------------------------------------------------------------------
def test_sacct_completion_log_gives_each_job_its_last_record() -> None:
    ends = acct.parse_sacct(_golden("sacct_completion.txt"), "sacct --completion")
    got = {j: (e.state, e.exit_code, e.signal) for j, e in ends.items()}
    assert got == {"1": ("COMPLETED", 0, 0), "2": ("TIMEOUT", 0, 0), "3": ("FAILED", 0, 9),
                   "4": ("OUT_OF_MEMORY", 0, 125), "5": ("FAILED", 3, 0), "6": ("CANCELLED", 0, 0),
                   # 7 and 8 were logged NODE_FAIL, requeued by the launch failure, then cancelled
                   "7": ("CANCELLED", 0, 0), "8": ("CANCELLED", 0, 0)}
    assert all(e.terminal and e.nodes == "localhost" for e in ends.values())


def test_sacct_steps_and_by_uid_suffix_are_read_as_the_job() -> None:
    text = "41|CANCELLED by 0|0:15||gpu-a07\n41.batch|CANCELLED|0:15||gpu-a07\n41.0|FAILED|1:0||gpu-a07\n"
    [(job, end)] = acct.parse_sacct(text, "sacct").items()
    assert (job, end.state, end.signal, end.nodes) == ("41", "CANCELLED", 15, "gpu-a07")


def test_scontrol_show_job_gives_state_reason_and_exit() -> None:
    ends = acct.parse_scontrol(_golden("scontrol_show_job.txt"))
    assert (ends["2"].state, ends["2"].reason, ends["2"].signal) == ("TIMEOUT", "TimeLimit", 15)
    assert (ends["4"].state, ends["4"].reason) == ("OUT_OF_MEMORY", "OutOfMemory")
    assert (ends["5"].state, ends["5"].exit_code, ends["5"].reason) == ("FAILED", 3, "NonZeroExitCode")
    assert ends["5"].source == "scontrol" and ends["5"].nodes == "localhost"


def test_scontrol_of_an_unknown_job_knows_nothing() -> None:
    assert acct.parse_scontrol("slurm_load_jobs error: Invalid job id specified") == {}


def test_squeue_lines() -> None:
    q = acct.parse_squeue("6|RUNNING|None|localhost\n7|PENDING|None|\n8|PENDING|Priority|\n")
    assert q["6"].describe() == "RUNNING on localhost"
    assert q["8"].describe() == "PENDING (Priority)" and q["7"].describe() == "PENDING"


# --- causes and verdicts -----------------------------------------------------------------------------------
def _end(line: str) -> acct.JobEnd:
    [end] = acct.parse_sacct(line, "sacct --completion").values()
    return end


@pytest.mark.parametrize(("line", "output", "code"), [
    ("2|TIMEOUT|0:0||localhost", "job2-output.txt", "slurm-timeout"),
    ("3|FAILED|0:9||localhost", "job3-output.txt", "slurm-oom"),  # no cgroups: slurmstepd's poller killed it
    ("4|OUT_OF_MEMORY|0:125||localhost", "job4-output.txt", "slurm-oom"),
    ("5|FAILED|3:0||localhost", None, "slurm-failed"),
    ("6|CANCELLED|0:0||localhost", None, "slurm-cancelled"),
    ("8|NODE_FAIL|0:0||localhost", None, "slurm-node-fail"),
    ("1|COMPLETED|0:0||localhost", None, "slurm-lost"),  # completed, yet this variant's outcome never came
])
def test_cause_of_each_recorded_end(line: str, output: str | None, code: str) -> None:
    assert acct.cause(_end(line), _golden(output) if output else "", CAT) == code


def test_the_oom_signatures_are_slurmstepds_own_words() -> None:
    assert CAT.match([_golden("job3-output.txt")]).code == "slurm-oom"
    assert CAT.match([_golden("job4-output.txt")]).code == "slurm-oom"
    assert CAT.match([_golden("job2-output.txt")]) is None


@pytest.mark.parametrize(("line", "output", "running", "status", "words"), [
    ("2|TIMEOUT|0:0||localhost", "job2-output.txt", True, Status.HANG, "at its time limit (1 min) while this"),
    ("2|TIMEOUT|0:0||localhost", "job2-output.txt", False, Status.NOT_RUN, "before this variant started"),
    ("4|OUT_OF_MEMORY|0:125||localhost", "job4-output.txt", True, Status.CRASH, "OUT_OF_MEMORY, exit 0 signal 125"),
    ("8|NODE_FAIL|0:0||localhost", None, True, Status.CRASH, "ended NODE_FAIL while this variant ran"),
    ("6|CANCELLED|0:0||localhost", None, True, Status.NOT_RUN, "before this variant finished"),
    ("5|FAILED|3:0||localhost", None, True, Status.FAIL, "ended FAILED, exit 3 while this variant ran"),
])
def test_unfinished_variant_verdicts(line: str, output: str | None, running: bool, status: Status,
                                     words: str) -> None:
    end = _end(line)
    v = acct.unfinished(end.job_id, end, running, _golden(output) if output else "", 1, "/shared/x", CAT)
    assert v.status is status and words in v.note, v.note
    assert v.remediation and v.evidence["slurm"]["state"] == end.state and v.evidence["reason"]


def test_failed_job_names_the_last_error_line_of_its_output() -> None:
    end = _end("5|FAILED|127:0||node1")
    tail = "/shared/venvs/x/bin/python: No such file or directory\n"
    v = acct.unfinished("5", end, True, tail, 5, "/shared/x", CAT)
    assert v.status is Status.FAIL and "No such file or directory" in v.note


@pytest.mark.parametrize("state", sorted(acct.TERMINAL))
@pytest.mark.parametrize("running", [True, False])
def test_no_way_a_job_ends_makes_an_unfinished_variant_pass(state: str, running: bool) -> None:
    end = acct.JobEnd("9", state, 0, 0, "", "n1", "sacct")
    v = acct.unfinished("9", end, running, "", 5, "/shared/x", CAT)
    assert v.status not in (Status.PASS, Status.PARTIAL, Status.SKIP)
    assert v.reason_code.startswith("slurm-") and CAT.get(v.reason_code) is not None


def test_a_job_nobody_remembers_is_recorded_not_lost() -> None:
    v = acct.unfinished("77", None, True, "", 5, "/shared/x", CAT)
    assert (v.status, v.reason_code) == (Status.NOT_RUN, "slurm-lost") and "77" in v.note


# --- the site ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("gres", "n"), [("(null)", 0), ("gpu:8", 8), ("gpu:h200:8(S:0-1)", 8),
                                         ("gpu:a100:4,nic:1", 4), ("nic:2", 0), ("gpu:l4:2,gpu:h100:4", 4)])
def test_gpus_per_node_from_sinfo_gres(gres: str, n: int) -> None:
    assert offer.gres_gpus(gres) == n


def test_partition_gpus_named_or_default() -> None:
    sinfo = "debug*|(null)\ngpu|gpu:h200:8(S:0-1)\ngpu|gpu:h200:4(S:0)\n"
    assert offer.partition_gpus(sinfo, None) == ("debug", 0)
    assert offer.partition_gpus(sinfo, "gpu") == ("gpu", 8)
    assert offer.partition_gpus(sinfo, "nope") is None
    assert offer.partition_gpus("debug*|(null)\n", None) == ("debug", 0)  # the local cluster's, as printed


def test_container_images_need_pyxis_and_22_05_has_only_oci_bundles() -> None:
    real = _golden("srun_help.txt")  # Slurm 22.05's srun: --container takes an OCI bundle path
    assert not offer.container_images(real)
    assert "OCI bundle" in offer.no_images_reason(real) and "pyxis" in offer.no_images_reason(real)
    # pyxis adds its options to srun's help under the plugins' section (option names from its option table)
    with_pyxis = real + ("\nOptions provided by plugins:\n      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH\n"
                         "                              [pyxis] the image to use for the container filesystem.\n")
    assert offer.container_images(with_pyxis)


# --- variants into jobs ------------------------------------------------------------------------------------
def _item(cell: str, probe: str, ranks: int, needs_gpu: bool, share: bool = False, timeout: float = 100,
          decided: bool = False) -> WorkItem:
    from checks.run.plan import Decided

    spec = ProbeSpec(id=probe, title=probe, feature="f", ranks=(ranks,), needs_gpu=needs_gpu, timeout_s=timeout,
                     distinct_gpus=not share)
    planned = Decided(Status.SKIP, "too-few-gpus", "x") if decided else None
    return WorkItem(CellTarget(cell, "local"), spec, Variant(probe, ranks, share_gpu=share), timeout, planned)


def test_gpu_variants_share_a_job_per_size_and_gpu_free_probes_get_one_job_each() -> None:
    items = [_item("c1", "inventory", 1, False), _item("c1", "fi-jit", 1, False), _item("c1", "fi-jit", 1, False),
             _item("c1", "nccl", 2, True), _item("c1", "symm", 2, True), _item("c1", "lat", 1, True),
             _item("c1", "shared", 4, True, share=True), _item("c1", "big", 8, True, decided=True),
             _item("c2", "nccl", 2, True)]
    jobs = batch.plan_jobs(items, 2, hard_timeout)
    got = [(j.cell_id, j.gpus, j.probe_id, j.items) for j in jobs]
    assert got == [("c1", 1, "inventory", (0,)), ("c1", 1, "fi-jit", (1, 2)), ("c1", 2, "", (3, 4, 6)),
                   ("c1", 1, "", (5,)), ("c2", 2, "", (8,))]  # the decided 8-GPU variant needs no job
    assert jobs[2].cpus == 4 and jobs[1].hard_timeouts_s == (130.0, 130.0)
    assert jobs[1].time_minutes() == 7  # (130 + 130 + 120) s, rounded up
    # on a CPU partition nothing asks for a GPU: the GPU variants are planned skip there
    assert {j.gpus for j in batch.plan_jobs(items[:3], 0, hard_timeout)} == {0}


def test_gpu_free_probes_see_one_gpu_where_the_partition_has_them() -> None:
    items = [_item("c1", "inventory", 1, False), _item("c1", "lat", 1, True)]
    jobs = batch.plan_jobs(items, 8, hard_timeout)
    assert [(j.gpus, j.probe_id, j.items) for j in jobs] == [(1, "inventory", (0,)), (1, "", (1,))]


def test_sbatch_asks_for_the_gpus_and_never_requeues() -> None:
    gpu = batch.JobPlan("c1", 2, "", (3,), (330.0,), 2)
    cpu = batch.JobPlan("c1", 0, "inventory", (0,), (330.0,), 1)
    req = batch.Request("gpu", None, ("--account=lab",))
    a = batch.sbatch_args(gpu, req, "stackprobe-r1", Path("/shared/j/3"))
    assert "--gres=gpu:2" in a and "--no-requeue" in a and "--partition=gpu" in a and a[-1] == "--account=lab"
    assert "--time=8" in a and "--job-name=stackprobe-r1" in a and "--output=/shared/j/3/slurm.out" in a
    b = batch.sbatch_args(cpu, batch.Request(None, 1), "stackprobe-r1", Path("/shared/j/0"))
    assert not any(x.startswith(("--gres", "--partition")) for x in b) and "--time=1" in b


def test_the_node_runs_the_local_executors_worker_command(tmp_path: Path) -> None:
    items = [_item("c1", "inventory", 1, False, timeout=200)]
    [job] = batch.plan_jobs(items, 0, hard_timeout)
    spec = json.loads(batch.job_json(job, items, worker_args, "/venvs/c1/bin/python"))
    [v] = spec["variants"]
    assert v["argv"] == ["/venvs/c1/bin/python", *worker_args(items[0].variant, 0, 200)]
    assert v["hard_timeout_s"] == hard_timeout(200) and v["index"] == 0
    launch = batch.Launch("/venvs/c1/bin/python", env=(("PATH", "/venvs/c1/bin:/usr/bin"),
                                                            ("PYTHONPATH", str(tmp_path))))
    script = batch.batch_script(batch.node_command(launch, tmp_path, tmp_path / "j"), tmp_path, "/p1:/p2",
                                     launch.env)
    lines = script.splitlines()
    assert lines[-1] == f"exec /venvs/c1/bin/python -m checks.run.slurm.node {tmp_path / 'j'}"
    assert "export STACKPROBE_PROBE_PATH=/p1:/p2" in lines and "unset VIRTUAL_ENV" in script
    # the cell's own settings come last, as the local executor applies them over the runner's environment
    assert lines[-3:-1] == ["export PATH=/venvs/c1/bin:/usr/bin", f"export PYTHONPATH={tmp_path}"]


def test_an_image_runs_through_pyxis_with_the_code_mounted(tmp_path: Path) -> None:
    cmd = batch.node_command(batch.Launch("python3", "nvcr.io#nvidia/pytorch:25.01-py3"), tmp_path,
                                  tmp_path / "j")
    assert cmd[:3] == ["srun", "--ntasks=1", "--container-image=nvcr.io#nvidia/pytorch:25.01-py3"]
    assert f"--container-mounts={tmp_path}:{tmp_path}:ro,{tmp_path / 'j'}:{tmp_path / 'j'}" in cmd
    assert shlex.join(cmd).endswith(f"python3 -m checks.run.slurm.node {tmp_path / 'j'}")

"""Leaves a grandchild behind in its own session (setsid), outliving the rank and the worker.

The grandchild sleeps for an hour; the harness must find and end it. Its pid is written to the file
named by STACKPROBE_TEST_PIDFILE so the test can check it is gone."""

import os
import subprocess
import sys

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-orphan", title="orphan", feature="cleanup", ranks=(1,), needs_gpu=False, timeout_s=30)


def run(ctx: RankContext) -> dict:
    code = "import os,time; os.setsid(); time.sleep(3600)"
    # Double fork: the intermediate child exits at once, so the sleeper is re-parented to init.
    launcher = (f"import subprocess,sys; p=subprocess.Popen([sys.executable,'-c',{code!r}],"
                f" stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)")
    pid = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True).stdout.strip()
    pidfile = os.environ.get("STACKPROBE_TEST_PIDFILE")
    if pidfile:
        with open(pidfile, "w") as f:
            f.write(pid)
    return outcome("pass", evidence={"orphan_pid": pid})

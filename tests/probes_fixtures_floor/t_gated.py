"""Needs a GPU and never touches it: holds "the GPUs" for STACKPROBE_TEST_HOLD_S seconds and writes when its
run began and ended to the file STACKPROBE_TEST_GATE_LOG, tagged with STACKPROBE_TEST_TAG. Its preload (a
stand-in module in preload/) writes when it was imported."""

import os
import time

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-gated", title="gated launch", feature="ranks start while another variant runs", ranks=(2,),
                 timeout_s=60, preload=("t_gate_preload",))


def note(event: str, rank: int) -> None:
    if "STACKPROBE_TEST_GATE_LOG" not in os.environ:  # in a container, which gets none of the test's variables
        return
    with open(os.environ["STACKPROBE_TEST_GATE_LOG"], "a") as f:
        f.write(f"{os.environ.get('STACKPROBE_TEST_TAG', '')} {event} {rank} {time.time():.6f}\n")


def run(ctx: RankContext) -> dict:
    note("run-start", ctx.rank)
    time.sleep(float(os.environ.get("STACKPROBE_TEST_HOLD_S", "0")))
    note("run-end", ctx.rank)
    return outcome("pass", evidence={"device": ctx.device_index})

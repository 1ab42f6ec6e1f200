"""Needs no GPU: its rank must not initialise the CUDA driver (STACKPROBE_TEST_CUINIT_MARK stays absent)."""

import os
import time
from pathlib import Path

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-nodevice", title="no driver warm-up", feature="no cuInit without a device", ranks=(1,),
                 needs_gpu=False, timeout_s=60)


def run(ctx: RankContext) -> dict:
    time.sleep(0.5)  # as long as a warm-up thread would need to create the file
    called = Path(os.environ["STACKPROBE_TEST_CUINIT_MARK"]).exists()
    return outcome("fail" if called else "pass", note="cuInit was called" if called else "",
                   evidence={"device": ctx.device_index})

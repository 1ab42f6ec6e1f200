"""Needs a GPU and never touches it: passes when the CUDA driver was initialised (cuInit called) in this rank
before the probe did anything, as the rank does for a rank with a device. The test supplies a stand-in
libcuda.so.1 whose cuInit creates the file named by STACKPROBE_TEST_CUINIT_MARK."""

import os
import time
from pathlib import Path

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-driver", title="driver warm-up", feature="cuInit overlaps the imports", ranks=(1,),
                 timeout_s=60)


def run(ctx: RankContext) -> dict:
    mark = Path(os.environ["STACKPROBE_TEST_CUINIT_MARK"])
    end = time.monotonic() + 10
    while not mark.exists() and time.monotonic() < end:
        time.sleep(0.01)
    return outcome("pass" if mark.exists() else "fail", note="" if mark.exists() else "cuInit was not called",
                   evidence={"device": ctx.device_index})

"""Never returns: the watchdog must fire, and the stacks of the rank must reach the log."""

import time

from inenv.probe import ProbeSpec, RankContext

SPEC = ProbeSpec(id="t-hang", title="hang", feature="watchdog", ranks=(2,), needs_gpu=False, timeout_s=3)


def sleep_forever() -> None:
    while True:
        time.sleep(60)


def run(ctx: RankContext) -> dict:
    sleep_forever()
    return {}

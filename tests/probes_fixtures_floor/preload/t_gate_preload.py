"""Stand-in for a library a gated probe preloads (tests/probes_fixtures_floor/t_gated.py): takes
STACKPROBE_TEST_PRELOAD_S seconds to import (0 unless set), then notes its import."""

import os
import time

time.sleep(float(os.environ.get("STACKPROBE_TEST_PRELOAD_S", "0")))
with open(os.environ["STACKPROBE_TEST_GATE_LOG"], "a") as _f:
    _f.write(f"{os.environ.get('STACKPROBE_TEST_TAG', '')} preload {os.environ.get('RANK', '?')} {time.time():.6f}\n")

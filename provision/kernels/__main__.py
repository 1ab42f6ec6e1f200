"""``python -m provision.kernels JOB.json``: the kernel stage `provision build` leaves running (detached)."""

import sys

from provision.kernels.detached import _main

sys.exit(_main(sys.argv[1:]))

"""Present but broken: importing it fails on a missing dependency, which is not an unknown API."""

import cutlass_dsl_that_is_not_installed  # noqa: F401

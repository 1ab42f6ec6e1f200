"""`provision abi`: export indexes of torch builds, import sets of compiled extensions, and the grid of
which extension release loads beside which torch build (the judgement itself is common/abi.py)."""

"""The last stage of `provision build`: each built cell with flashinfer carries its comm modules, compiled for
the cell's declared GPU architectures (``kernel_archs`` in matrix.yaml, ``--kernel-archs``), so a GPU host
loads them instead of compiling (the kit's carried sets and its ``fi-carry`` builder).

    plan (pure) -> compile into .cache/kernels/<cell>/ -> install into the cell -> the cell's record says so

One file per stage: what to build and what needs no build (``jobs``), where it is built and installed (one
carrier per backend behind one Protocol: ``carriers``), how long it has left (``estimate``), what is recorded
(``records``, through the one build-record reader and writer), the stage run in this process (``stage``) and
the one `provision build` leaves running after it returns (``detached``, ``python -m provision.kernels JOB``).

Each module of a cell is one job: one build for the whole arch list, run inside the cell (its venv's
interpreter, or a container of its image) through the builder fi-jit uses and the shared compile cache, so
the same sources, flags and nvcc give one object whoever asks. A job whose kernel set already holds that
module for the same list, flashinfer and torch compiles nothing: a kernel set made on another machine and
copied into ``.cache/kernels/<cell>/`` (a GPU host given the CPU machine's folder) is installed as it is.
Jobs run ``--jobs`` at a time, the longest first (fi-jit's declared build costs); the jobs of one build
(the same module, flashinfer, CUDA and list in several cells) run one after another, so the second finds
the first's library in the compile cache instead of holding a slot waiting for it.

Installing: a venv cell gets the set copied into flashinfer's AOT folder; a Docker cell gets an image of one
more layer (the set copied in), under the same tag, built from the image the builder made (its id is kept in
the record, so a new set replaces the layer instead of stacking another). The record's ``kernels`` key: the
list, per module carried or why not, the bytes carried.

What the rest of provision uses is named here.
"""

from __future__ import annotations

from inenv.kit import COMM_MODULES
from provision.kernels.carriers import (
    BUILDING,
    CARRIERS,
    JOB_LIMIT_S,
    KERNELS_LABEL,
    Carrier,
    DockerCarrier,
    VenvCarrier,
    container_cpu_s,
    install_tree,
    layer_context,
    parse_result,
)
from provision.kernels.detached import run, start, stop_builds
from provision.kernels.early import EarlyQuick, left_over
from provision.kernels.estimate import StageProgress, tree_cpu_s
from provision.kernels.jobs import (
    KERNELS,
    LONG_MODULES,
    QUICK_MODULES,
    Job,
    current,
    known_failure,
    no_nvcc,
    plan,
    ready_answer,
    retried,
    set_digest,
    uncovered,
)
from provision.kernels.records import finish, learned_costs, module_row, module_rows
from provision.kernels.stage import STAGE_TICK_S, carry, pending, prune

__all__ = ["BUILDING", "CARRIERS", "COMM_MODULES", "JOB_LIMIT_S", "KERNELS", "KERNELS_LABEL", "LONG_MODULES",
           "QUICK_MODULES", "STAGE_TICK_S", "Carrier", "DockerCarrier", "EarlyQuick", "Job", "StageProgress",
           "VenvCarrier", "carry", "container_cpu_s", "current", "finish", "install_tree", "known_failure",
           "layer_context", "learned_costs", "left_over", "module_row", "module_rows", "no_nvcc", "parse_result",
           "pending", "plan", "prune", "ready_answer", "retried", "run", "set_digest", "start", "stop_builds",
           "tree_cpu_s", "uncovered"]

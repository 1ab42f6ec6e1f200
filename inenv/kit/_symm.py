"""torch symmetric memory (``torch.distributed._symmetric_memory``) across torch versions.

In-environment side: torch inside the functions.
"""

from __future__ import annotations

from typing import Any


def symm_rendezvous(tensor: Any, group: Any) -> tuple[Any, bool]:
    """Rendezvous a symmetric tensor over ``group``; the one place that knows torch < 2.11 needs
    ``enable_symm_mem_for_group`` first. Returns the handle and whether that call was made."""
    import torch.distributed._symmetric_memory as symm_mem

    enabled_here = False
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    is_enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    if enable is not None and (is_enabled is None or not is_enabled(group.group_name)):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated (a no-op need) on newer torch
            enable(group.group_name)
        enabled_here = True
    return symm_mem.rendezvous(tensor, group), enabled_here


def symm_op(name: str) -> Any:
    """``torch.ops.symm_mem.<name>`` or None when this torch does not have it."""
    import torch

    try:
        return getattr(torch.ops.symm_mem, name)
    except (AttributeError, RuntimeError):
        return None

"""The labels of a Docker cell's kernel layer (host side): `provision build` writes them on the image it makes of
the cell's image plus one layer holding the carried kernel set, and `checks run` reads them to tell which of the
cell's results still answer (checks.run.incremental).

The layer changes the image's id, yet it adds only the carried modules; a variant that loads none of them answers
for the image below the layer as well. So the layer names that image (:data:`BASE_LABEL`, its id) and each
module's digest (:data:`MODULES_LABEL`, ``inenv.kernelprint.module_digest``), and the environment of a variant is
the base image plus the digests of the modules it loads. Labels are read as untrusted input: a value of any
other shape makes the image count as a whole (its own id, no module digests), as an image without the layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

KERNELS_LABEL = "org.stackprobe.kernels"  # a digest of the set's records (provision.kernels.set_digest)
BASE_LABEL = "org.stackprobe.kernels.base"  # the id of the image the layer was put on
MODULES_LABEL = "org.stackprobe.kernels.modules"  # "module=digest,module=digest", sorted by module

_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")
_MODULE = re.compile(r"([a-z0-9_]{1,64})=([0-9a-f]{16})")


def modules_value(digests: Mapping[str, str]) -> str:
    """The :data:`MODULES_LABEL` value of a set's module digests."""
    return ",".join(f"{m}={d}" for m, d in sorted(digests.items()))


def is_image_id(value: object) -> bool:
    """Whether ``value`` is a full image id (``sha256:`` and 64 hex digits), what :data:`BASE_LABEL` holds."""
    return isinstance(value, str) and _IMAGE_ID.fullmatch(value) is not None


def read(labels: Mapping[str, object] | None) -> tuple[str, dict[str, str]] | None:
    """(the base image id, module -> digest) from an image's labels; None when the image has no kernel layer of
    ours or a label of another shape."""
    if not isinstance(labels, Mapping):
        return None
    base, mods = labels.get(BASE_LABEL), labels.get(MODULES_LABEL)
    if not is_image_id(base) or not isinstance(mods, str):
        return None
    digests: dict[str, str] = {}
    for item in filter(None, mods.split(",")):
        m = _MODULE.fullmatch(item)
        if m is None or m.group(1) in digests:
            return None
        digests[m.group(1)] = m.group(2)
    return base, digests

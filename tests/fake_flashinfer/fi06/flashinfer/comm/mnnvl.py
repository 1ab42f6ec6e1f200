"""Stand-in of flashinfer.comm.mnnvl as of 0.6.8 (TorchDistBackend still lives here, not in comm_backend)."""

from dataclasses import dataclass
from typing import Any


class TorchDistBackend:
    def __init__(self, group: Any = None) -> None:
        self.group = group


@dataclass
class MnnvlConfig:
    comm_backend: Any = None

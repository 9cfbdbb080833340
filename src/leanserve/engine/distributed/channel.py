"""The per-step channel from rank 0 to the other ranks: the shared-memory ring for ranks on
rank 0's machine (``shm_ring``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .shm_ring import ChannelClosed, RingReader, RingWriter

__all__ = ["ChannelClosed", "ChannelSpec", "StepChannel"]


@dataclass(frozen=True)
class ChannelSpec:
    """What a rank needs to read the channel."""

    ring: str  # the shared-memory block's name
    readers: int
    slot_words: int

    def reader(self, index: int, alive) -> RingReader:
        return RingReader(self.ring, index, self.readers, self.slot_words, alive)


class StepChannel:
    """Rank 0's end."""

    def __init__(self, readers: int, slot_words: int):
        self.writer = RingWriter(readers, slot_words)
        self.spec = ChannelSpec(self.writer.name, readers, slot_words)

    def send(self, pieces: list[np.ndarray]) -> None:
        self.writer.write(pieces)

    def attached(self) -> None:
        """Every reader has attached (start-up is over)."""
        self.writer.unlink()

    def close(self) -> None:
        self.writer.close()

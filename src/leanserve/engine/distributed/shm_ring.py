"""A shared-memory ring: one writer (rank 0) hands each step's input to the other ranks of the
same machine, vLLM's answer to the same problem (its ``ShmRingBuffer``).

One shared-memory block holds ``SLOTS`` message slots and an int64 control array: per slot the
sequence number and length of the message in it, per reader the last sequence number it has
read. The writer copies a message into slot ``seq % SLOTS`` and then stores ``seq``; a reader
waits for ``seq`` in that slot, copies the message out and stores its own ack. On x86 stores
become visible in program order, which makes "payload, then sequence number" a publication
(ARM would need a fence here). Nothing is serialised: a message is int64 words
(``step_codec``), copied in and out once.

Against a ZeroMQ PUB socket over ipc, for a batch-64 decode step (1,351 words), on this 2-core
VM (``bench/results/tp.md``): the writer's cost 38 vs 88 us p50, the delay until the reader has
the message 57 vs 151 us p50.

Readers spin (yielding the core) while a step is likely to follow soon, then poll every
``IDLE_POLL_S``, so an idle server costs ~nothing and the first step after a pause waits at
most that long.
"""

from __future__ import annotations

import mmap
import os
import time
from multiprocessing import shared_memory

import numpy as np

SLOTS = 4  # the writer waits only if a reader is SLOTS - 1 steps behind; ranks stay within one
SPIN_S = 0.005  # busy-yield this long after the last message: decode steps come every few ms
IDLE_POLL_S = 0.001  # then poll at this period (the latency the first step after a pause pays)
WRITE_TIMEOUT_S = 60.0  # a reader that acks nothing for this long is gone


class ChannelClosed(Exception):
    """The writer closed the ring (shutdown); the reader has nothing more to do."""


class ShmRing:
    """The block's layout, shared by writer and readers."""

    def __init__(self, buf, readers: int, slot_words: int):
        self.readers, self.slot_words = readers, slot_words
        n_ctrl = 2 * SLOTS + readers + 1  # (seq, words) per slot, one ack per reader, closed flag
        self.ctrl = np.ndarray(n_ctrl, np.int64, buf)
        self.slots = np.ndarray((SLOTS, slot_words), np.int64, buf, offset=_aligned(8 * n_ctrl))

    @staticmethod
    def nbytes(readers: int, slot_words: int) -> int:
        return _aligned(8 * (2 * SLOTS + readers + 1)) + 8 * SLOTS * slot_words


class RingWriter:
    def __init__(self, readers: int, slot_words: int):
        """``slot_words``: the largest message, in int64 words."""
        self.shm = shm = shared_memory.SharedMemory(create=True, size=ShmRing.nbytes(readers, slot_words))
        self.ring = ShmRing(shm.buf, readers, slot_words)
        self.ring.ctrl[:] = -1
        self.name = shm.name
        self.seq = 0
        self._linked = True
        self._acks = self.ring.ctrl[2 * SLOTS : 2 * SLOTS + readers]
        self._all_read = -1  # every reader has read this message, as last seen (re-read when needed)

    def write(self, pieces: list[np.ndarray]) -> None:
        """One message: the pieces' int64 words (1-D) back to back."""
        ring, seq = self.ring, self.seq
        slot = seq % SLOTS
        if seq - SLOTS > self._all_read:  # the slot's last message may be unread: look again
            self._all_read = int(self._acks.min())
            if seq - SLOTS > self._all_read:
                self._wait_for_readers(seq - SLOTS)
        n = sum(p.size for p in pieces)
        np.concatenate(pieces, out=ring.slots[slot, :n])
        ring.ctrl[2 * slot + 1] = n
        ring.ctrl[2 * slot] = seq  # last: publishes the slot
        self.seq = seq + 1

    def _wait_for_readers(self, seq: int) -> None:
        acks = self._acks
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while acks.min() < seq:
            if time.monotonic() > deadline:
                raise TimeoutError(f"shm ring: readers {np.flatnonzero(acks < seq).tolist()} read nothing for "
                                   f"{WRITE_TIMEOUT_S:.0f} s")
            os.sched_yield()
        self._all_read = int(acks.min())

    def unlink(self) -> None:
        """Removes the block's name once every reader has attached: the memory lives on while
        mapped, and no crash of any process can leave the block behind in /dev/shm."""
        if self._linked:
            self._linked = False
            self.shm.unlink()

    def close(self) -> None:
        """Tells the readers to stop, and frees the block once they have let go of it."""
        self.ring.ctrl[-1] = 1
        self.unlink()
        del self.ring, self._acks
        self.shm.close()


class RingReader:
    def __init__(self, name: str, index: int, readers: int, slot_words: int, alive=lambda: True):
        """``index``: this reader's ack cell; ``alive()`` is asked while idle, and a False ends
        the wait (e.g. the writer's process is gone)."""
        # Mapped from /dev/shm, not through SharedMemory, which (before Python 3.13) registers the
        # block with this process's resource tracker as if it owned it: the tracker would unlink
        # it when this process exits, or, shared with the writer's process, forget the writer's
        # registration (which frees the block if the writer crashes).
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, ShmRing.nbytes(readers, slot_words))
        finally:
            os.close(fd)
        self.ring = ShmRing(self.map, readers, slot_words)
        self.index, self.alive = index, alive
        self.seq = 0

    def read(self) -> np.ndarray:
        """The next message (a copy: the slot is free again on return). Raises ChannelClosed."""
        ring, seq = self.ring, self.seq
        slot = seq % SLOTS
        ctrl = ring.ctrl
        if ctrl[2 * slot] != seq:
            self._wait(2 * slot, seq)
        msg = ring.slots[slot, : ctrl[2 * slot + 1]].copy()
        ctrl[2 * SLOTS + self.index] = seq
        self.seq = seq + 1
        return msg

    def _wait(self, cell: int, seq: int) -> None:
        ctrl, start = self.ring.ctrl, time.monotonic()
        while ctrl[cell] != seq:
            if ctrl[-1] == 1:
                raise ChannelClosed
            if time.monotonic() - start < SPIN_S:
                os.sched_yield()
                continue
            if not self.alive():
                raise ChannelClosed
            time.sleep(IDLE_POLL_S)

    def close(self) -> None:
        del self.ring
        self.map.close()


def _aligned(n: int, to: int = 64) -> int:
    return -(-n // to) * to

"""A shared-memory ring: one writer (rank 0) hands each step's input to the other ranks of the
same machine, vLLM's answer to the same problem (its ``ShmRingBuffer``).

One shared-memory block holds ``SLOTS`` message slots and an int64 control array: per slot the
sequence number and length of the message in it, per reader the last sequence number it has
read. The writer copies a message into slot ``seq % SLOTS`` and then stores ``seq``; a reader
waits for ``seq`` in that slot, copies the message out and stores its own ack. On x86 stores
become visible in program order, which makes "payload, then sequence number" a publication
(ARM would need a fence here). Nothing is serialised: a message is int64 words
(``step_codec``), copied in and out once.

Measured here against a ZeroMQ PUB socket over ipc (``bench/tp_bench.py``,
``bench/results/tp.md``): see the ``broadcast`` table there for the writer's cost per step and
the delay until a reader has the message.

Readers spin (yielding the core) while a step is likely to follow soon, then sleep in growing
steps, so an idle server costs ~nothing and the first step after a pause waits at most
``IDLE_POLL_S``.
"""

from __future__ import annotations

import os
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

SLOTS = 4  # the writer waits only if a reader is SLOTS - 1 steps behind; ranks stay within one
SPIN_S = 0.005  # busy-yield this long after the last message: decode steps come every few ms
IDLE_POLL_S = 0.001  # then poll at this period (the latency the first step after a pause pays)
WRITE_TIMEOUT_S = 60.0  # a reader that acks nothing for this long is gone


class ChannelClosed(Exception):
    """The writer closed the ring (shutdown); the reader has nothing more to do."""


class ShmRing:
    """The block's layout, shared by writer and readers."""

    def __init__(self, shm: shared_memory.SharedMemory, readers: int, slot_words: int):
        self.shm, self.readers, self.slot_words = shm, readers, slot_words
        n_ctrl = 2 * SLOTS + readers + 1  # (seq, words) per slot, one ack per reader, closed flag
        self.ctrl = np.ndarray(n_ctrl, np.int64, shm.buf)
        self.slots = np.ndarray((SLOTS, slot_words), np.int64, shm.buf, offset=_aligned(8 * n_ctrl))

    @staticmethod
    def nbytes(readers: int, slot_words: int) -> int:
        return _aligned(8 * (2 * SLOTS + readers + 1)) + 8 * SLOTS * slot_words


class RingWriter:
    def __init__(self, readers: int, slot_words: int):
        """``slot_words``: the largest message, in int64 words."""
        shm = shared_memory.SharedMemory(create=True, size=ShmRing.nbytes(readers, slot_words))
        self.ring = ShmRing(shm, readers, slot_words)
        self.ring.ctrl[:] = -1
        self.name = shm.name
        self.seq = 0
        self._linked = True

    def write(self, pieces: list[np.ndarray]) -> None:
        """One message: the pieces' int64 words back to back."""
        ring, seq = self.ring, self.seq
        slot = seq % SLOTS
        acks = ring.ctrl[2 * SLOTS : 2 * SLOTS + ring.readers]
        if seq >= SLOTS and acks.min() < seq - SLOTS:
            self._wait_for_readers(acks, seq - SLOTS)
        out, off = ring.slots[slot], 0
        for p in pieces:
            out[off : off + p.size] = p.ravel()
            off += p.size
        ring.ctrl[2 * slot + 1] = off
        ring.ctrl[2 * slot] = seq  # last: publishes the slot
        self.seq = seq + 1

    def _wait_for_readers(self, acks: np.ndarray, seq: int) -> None:
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while acks.min() < seq:
            if time.monotonic() > deadline:
                raise TimeoutError(f"shm ring: readers {np.flatnonzero(acks < seq).tolist()} read nothing for "
                                   f"{WRITE_TIMEOUT_S:.0f} s")
            os.sched_yield()

    def unlink(self) -> None:
        """Removes the block's name once every reader has attached: the memory lives on while
        mapped, and no crash of any process can leave the block behind in /dev/shm."""
        if self._linked:
            self._linked = False
            self.ring.shm.unlink()

    def close(self) -> None:
        """Tells the readers to stop, and frees the block once they have let go of it."""
        self.ring.ctrl[-1] = 1
        self.unlink()
        shm = self.ring.shm
        del self.ring
        shm.close()


class RingReader:
    def __init__(self, name: str, index: int, readers: int, slot_words: int, alive=lambda: True):
        """``index``: this reader's ack cell; ``alive()`` is asked while idle, and a False ends
        the wait (e.g. the writer's process is gone)."""
        shm = shared_memory.SharedMemory(name=name)
        # Attaching registered the block with this process's resource tracker, which would
        # unlink it when this process exits; it is the writer's to free.
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        self.ring = ShmRing(shm, readers, slot_words)
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
        shm = self.ring.shm
        del self.ring
        shm.close()


def _aligned(n: int, to: int = 64) -> int:
    return -(-n // to) * to

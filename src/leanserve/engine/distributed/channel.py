"""The per-step channel from rank 0 to the other ranks: the shared-memory ring (``shm_ring``) for
ranks on rank 0's machine, a ZeroMQ PUSH socket per rank on another machine (Ray places ranks
there), as vLLM's message queue does. On one machine the ring is the cheaper of the two
(``bench/results/tp.md``: rank 0's cost per batch-64 decode step 38 vs 88 us p50 on this VM)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zmq

from .shm_ring import ChannelClosed, RingReader, RingWriter

__all__ = ["ChannelClosed", "ChannelSpec", "StepChannel"]

POLL_MS = 100  # a remote reader checks ``alive()`` this often while idle


@dataclass(frozen=True)
class ChannelSpec:
    """What one rank needs to read the channel: the ring (its name, readers, slot size and this
    rank's reader index), or the address of its own socket on rank 0."""

    ring: str | None
    readers: int
    slot_words: int
    index: int = 0
    address: str | None = None

    def reader(self, alive) -> RingReader | SocketReader:
        if self.address is not None:
            return SocketReader(self.address, alive)
        return RingReader(self.ring, self.index, self.readers, self.slot_words, alive)


class StepChannel:
    """Rank 0's end. ``local``: per rank 1..N-1, whether it shares rank 0's machine; ``host``:
    rank 0's address, where the sockets of the others listen."""

    def __init__(self, local: list[bool], slot_words: int, host: str):
        readers = sum(local)
        self.writer = RingWriter(readers, slot_words) if readers else None
        self._ctx = zmq.Context() if readers < len(local) else None
        self.sockets, self.specs, index = [], [], 0
        for is_local in local:
            if is_local:
                self.specs.append(ChannelSpec(self.writer.name, readers, slot_words, index))
                index += 1
                continue
            sock = self._ctx.socket(zmq.PUSH)  # queues until its reader connects: nothing is lost
            port = sock.bind_to_random_port(f"tcp://{host}")
            self.sockets.append(sock)
            self.specs.append(ChannelSpec(None, 0, slot_words, address=f"tcp://{host}:{port}"))

    def send(self, pieces: list[np.ndarray]) -> None:
        if self.writer is not None:
            self.writer.write(pieces)
        if self.sockets:
            msg = np.concatenate(pieces)
            for sock in self.sockets:
                sock.send(msg, copy=False)

    def attached(self) -> None:
        """Every reader has attached (start-up is over)."""
        if self.writer is not None:
            self.writer.unlink()

    def close(self) -> None:
        """Tells the readers to stop: the ring's flag, an empty message on each socket."""
        if self.writer is not None:
            self.writer.close()
        for sock in self.sockets:
            sock.send(b"")
            sock.close(linger=1000)
        if self._ctx is not None:
            self._ctx.term()


class SocketReader:
    """A rank on another machine: its messages arrive on a ZeroMQ PULL socket."""

    def __init__(self, address: str, alive):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.connect(address)
        self.alive = alive

    def read(self) -> np.ndarray:
        """The next message (writable, as the ring's). Raises ChannelClosed."""
        while not self.sock.poll(POLL_MS):
            if not self.alive():
                raise ChannelClosed
        msg = self.sock.recv()
        if not msg:
            raise ChannelClosed
        return np.frombuffer(msg, np.int64).copy()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

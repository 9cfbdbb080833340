"""``ZmqConnector``: KV transfer over ZeroMQ, on one thread of its own, for CPU caches anywhere
(NIXL ships CUDA-only wheels; see ../shared/disaggregation-notes.md).

The decode side pulls. Its engine allocates the blocks, then this thread sends a
``PullRequest`` (msgpack: the lease's engine id, request id, epoch and block ids, and the
puller's ``KVLayout``) from a DEALER socket per prefill worker. The prefill worker's ROUTER
socket (``kv_ip:kv_port``) answers with a ``BlocksHeader`` and the blocks' bytes as raw
frames, or with ``Refused`` naming why (a restarted engine, a layout mismatch, a lease that
expired or never was). Nothing is pickled; block bytes are never parsed.

The frames: the lease's blocks, in order, cut into pieces (``pieces``), and for each piece one
frame per row of ``KVCache.spans`` (each layer's keys, then its values): 2 * layers frames of
``len(piece)`` blocks each. A piece is a run of consecutive block ids, sent in place: for every
row, those blocks are one contiguous piece of the cache, which ZeroMQ sends without a copy. Runs
too short for that to pay (pyzmq copies a frame under its 64 kB copy threshold anyway, and every
frame costs the thread a few microseconds) are merged into one piece gathered in one numpy call.

Copies: none for in-place pieces on the prefill side; ZeroMQ reads them after the send call
returns, so the lease ends, and its blocks are freed, only once ZeroMQ is done with every frame
(``_sent``). The decode side writes each frame into its blocks, wherever they are in its cache,
in place, on this thread (one numpy copy per frame, without the GIL). The engine loop only hands
commands over (a deque and an empty wake-up frame) and drains completions: it never waits on,
polls or copies a transfer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque

import msgspec
import numpy as np
import zmq

from ..kv_cache import KVCache
from .config import KVTransferConfig
from .connector import KVConnector
from .leases import Lease
from .loads import Load
from .messages import (BlocksHeader, FromPrefill, KVLayout, PullRequest, Refused, ReleaseLease, RemotePrefill,
                       ToPrefill)

log = logging.getLogger("leanserve.engine")

# DEALER sockets kept open to prefill workers; the least recently used beyond this is closed
# (a deployment has a handful of prefill workers; a bad remote_host must not pile sockets up).
MAX_REMOTES = 64
# While answers are in flight, the transfer thread wakes this often to free the leases of those
# ZeroMQ has finished sending (a tracker has no socket to poll).
SENT_POLL_MS = 1


class ZmqConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, kv: KVCache, wakeup):
        super().__init__(config, layout, wakeup)
        if kv.tensor.device.type != "cpu":
            raise ValueError("--kv-transfer-config: ZmqConnector moves host memory; this KV cache is on "
                             f"{kv.tensor.device}")
        self.spans = kv.spans().numpy()  # [layers * 2, num_blocks, span_bytes], the cache's memory
        self._sending: list[tuple[list[zmq.MessageTracker], Lease]] = []  # answers ZeroMQ may still read
        self._commands: deque[tuple] = deque()
        self._ctx = zmq.Context()
        wake_addr = f"inproc://leanserve-kv-{id(self)}"
        self._wake = self._ctx.socket(zmq.PAIR)  # the loop's end: one empty frame per command
        self._wake.bind(wake_addr)
        wake_in = self._ctx.socket(zmq.PAIR)
        wake_in.connect(wake_addr)
        router = None
        if config.is_producer:
            router = self._ctx.socket(zmq.ROUTER)
            router.linger = 0
            try:
                router.bind(f"tcp://{config.kv_ip}:{config.kv_port}")
            except zmq.ZMQError as e:
                self._ctx.destroy(linger=0)
                raise ValueError(f"--kv-transfer-config: kv_ip:kv_port {config.kv_ip}:{config.kv_port}: {e}") from None
        self._thread = threading.Thread(target=self._run, args=(wake_in, router), daemon=True,
                                        name="leanserve-kv-transfer")
        self._thread.start()

    # ------------------------------------------------------------------ engine loop
    def _pull(self, load: Load) -> None:
        self._command(("pull", load))

    def _release(self, remote: RemotePrefill) -> None:
        self._command(("release", remote))

    def _command(self, command: tuple) -> None:
        self._commands.append(command)
        try:
            self._wake.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a thousand wake-ups are queued already: the thread will drain every command

    def shutdown(self) -> None:
        if self._ctx.closed:
            return
        self._command(("stop",))
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ the transfer thread
    def _run(self, wake_in: zmq.Socket, router: zmq.Socket | None) -> None:
        poller = zmq.Poller()
        poller.register(wake_in, zmq.POLLIN)
        if router is not None:
            poller.register(router, zmq.POLLIN)
        dealers: OrderedDict[tuple[str, int], zmq.Socket] = OrderedDict()
        encoder = msgspec.msgpack.Encoder()
        to_prefill, from_prefill = msgspec.msgpack.Decoder(ToPrefill), msgspec.msgpack.Decoder(FromPrefill)
        while True:
            for sock, _ in poller.poll(SENT_POLL_MS if self._sending else None):
                try:
                    if sock is wake_in:
                        _drain(wake_in)
                        while self._commands:
                            command = self._commands.popleft()
                            if command[0] == "stop":
                                return
                            self._send_command(command, dealers, poller, encoder)
                    elif sock is router:
                        for frames in _messages(router):
                            self._serve(router, frames, to_prefill, encoder)
                    else:
                        for frames in _messages(sock):
                            self._receive(frames, from_prefill)
                except Exception:  # noqa: BLE001 - one bad message must not end the transfer thread
                    log.exception("KV transfer thread: a message failed")
            if self._sending:
                self._sent()

    def _send_command(self, command: tuple, dealers, poller: zmq.Poller, encoder) -> None:
        kind, arg = command
        remote: RemotePrefill = arg.remote if kind == "pull" else arg
        dealer = self._dealer(remote.host, remote.port, dealers, poller)
        if kind == "pull":
            if self.loads.pending(arg.request_id) is None:
                return  # aborted before it was asked for
            msg = PullRequest(remote.engine_id, remote.request_id, remote.epoch, remote.block_ids, self.layout,
                              arg.request_id)
        else:
            msg = ReleaseLease(remote.engine_id, remote.request_id, remote.epoch)
        dealer.send(encoder.encode(msg), zmq.NOBLOCK)

    def _dealer(self, host: str, port: int, dealers: OrderedDict, poller: zmq.Poller) -> zmq.Socket:
        key = (host, port)
        sock = dealers.get(key)
        if sock is None:
            if len(dealers) >= MAX_REMOTES:
                _, old = dealers.popitem(last=False)
                poller.unregister(old)
                old.close(linger=0)
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(f"tcp://{host}:{port}")  # asynchronous: a dead worker shows as a timeout
            poller.register(sock, zmq.POLLIN)
            dealers[key] = sock
        else:
            dealers.move_to_end(key)
        return sock

    # prefill side
    def _serve(self, router: zmq.Socket, frames: list[zmq.Frame], decoder, encoder) -> None:
        identity, msg = frames[0], decoder.decode(frames[1].buffer)
        if isinstance(msg, ReleaseLease):
            if msg.engine_id == self.engine_id and (lease := self.leases.take(msg.request_id, msg.epoch)):
                self._ended_by_transport(lease)
            return
        reason, lease = self._check_pull(msg)
        if reason is not None:
            if lease is not None:
                self._ended_by_transport(lease)  # a puller that cannot use it never will
            refusal = Refused(self.engine_id, msg.request_id, msg.epoch, msg.reply_to, reason)
            router.send_multipart([identity, encoder.encode(refusal)])
            return
        header = BlocksHeader(self.engine_id, msg.request_id, msg.epoch, self.layout, lease.block_ids, msg.reply_to)
        frames, in_place = answer_frames(self.spans, lease.block_ids, router.copy_threshold)
        trackers: list[zmq.MessageTracker] = []
        self._sending.append((trackers, lease))  # even if a send fails: what ZeroMQ was given, it reads
        router.send_multipart([identity, encoder.encode(header)], zmq.SNDMORE)
        for i, (frame, track) in enumerate(zip(frames, in_place)):
            tracker = router.send(frame, zmq.SNDMORE if i < len(frames) - 1 else 0, copy=False, track=track)
            if track:
                trackers.append(tracker)
        self.counters.bytes_sent += sum(f.nbytes for f in frames)

    def _sent(self) -> None:
        """Ends the leases whose answer ZeroMQ has finished reading from the cache: their blocks
        may be freed and reused now."""
        sending = []
        for trackers, lease in self._sending:
            if all(t.done for t in trackers):
                self._ended_by_transport(lease)
            else:
                sending.append((trackers, lease))
        self._sending = sending

    def _check_pull(self, msg: PullRequest) -> tuple[str | None, Lease | None]:
        if msg.engine_id != self.engine_id:
            return (f"engine {msg.engine_id} is not this prefill worker's (engine {self.engine_id}): the worker "
                    "restarted since it made that lease", None)
        lease = self.leases.take(msg.request_id, msg.epoch)
        if lease is None:
            return (f"no KV lease for request {msg.request_id} epoch {msg.epoch}: pulled or released already, "
                    f"expired (kv_lease_timeout_s={self.config.kv_lease_timeout_s:g}) or never made", None)
        if why := self.layout.mismatch(msg.layout, "on the prefill worker", "on the decode worker"):
            return f"KV layouts differ: {why}", lease
        if msg.block_ids != lease.block_ids:
            return f"block ids {msg.block_ids[:8]}... are not those of the lease", lease
        return None, lease

    # decode side
    def _receive(self, frames: list[zmq.Frame], decoder) -> None:
        msg = decoder.decode(frames[0].buffer)
        load = self.loads.claim(msg.reply_to)
        if load is None:
            return  # aborted or timed out meanwhile: the bytes are dropped, the blocks are not ours
        error = "the transfer thread failed"
        try:
            error = self._write(load, msg, frames[1:])
        finally:
            if error is None:
                self.counters.durations.append(_elapsed(load))
            self.loads.finish(load.request_id, error)
            self.wakeup()

    def _write(self, load: Load, msg: BlocksHeader | Refused, frames: list[zmq.Frame]) -> str | None:
        """Puts the answer's bytes into the load's blocks; the error, if it cannot."""
        where = f"the prefill worker at {load.remote.host}:{load.remote.port}"
        if isinstance(msg, Refused):
            return f"{where} refused the transfer: {msg.reason}"
        if why := self.layout.mismatch(msg.layout, "on the decode worker", "on the prefill worker"):
            return f"KV layouts differ: {why}"
        n = len(load.block_ids)
        if len(msg.block_ids) != n:
            return (f"{where} sent {len(msg.block_ids)} blocks; this request's prompt fills {n} (do both workers "
                    "tokenize it alike?)")
        rows, span_bytes = self.spans.shape[0], self.spans.shape[2]
        sizes = [len(f.buffer) for f in frames]
        groups = [sizes[i : i + rows] for i in range(0, len(sizes), rows)]
        if (len(sizes) % rows or sum(sizes) != n * rows * span_bytes
                or any(len(set(g)) != 1 or g[0] % span_bytes for g in groups)):
            return (f"{where} sent {sum(sizes)} bytes in {len(sizes)} frames of {sizes[:4]}... for {n} blocks of "
                    f"{rows} x {span_bytes} bytes")
        # Each group of ``rows`` frames is the next piece of the request's blocks: it lands in
        # the request's next blocks here, wherever they are in this cache.
        first = 0
        for i, g in enumerate(groups):
            count = g[0] // span_bytes
            group = frames[i * rows : (i + 1) * rows]
            self._land(load.block_ids[first : first + count],
                       [np.frombuffer(f.buffer, np.uint8).reshape(count, span_bytes) for f in group])
            first += count
        self.counters.bytes_received += n * rows * span_bytes
        return None

    def _land(self, block_ids: list[int], frames: list[np.ndarray]) -> None:
        """Writes one piece's frames (a row of ``spans`` each) into ``block_ids``: one copy per
        frame, in place, without the GIL."""
        for row, data in zip(self.spans, frames):
            row[block_ids] = data


def pieces(block_ids: list[int], span_bytes: int, min_bytes: int) -> list[tuple[int, int, bool]]:
    """``block_ids`` cut into pieces, ``(start, stop, in_place)`` positions in it, in order: each
    run of consecutive ids of at least ``min_bytes`` per row is a piece sent in place; the runs
    between them are merged into pieces to gather. No ids: one empty piece (an answer has frames)."""
    if not block_ids:
        return [(0, 0, False)]
    ids = np.asarray(block_ids, np.int64)
    starts = [0, *(np.flatnonzero(np.diff(ids) != 1) + 1).tolist()]
    out: list[tuple[int, int, bool]] = []
    for a, b in zip(starts, [*starts[1:], len(ids)]):
        if (b - a) * span_bytes >= min_bytes:
            out.append((a, b, True))
        elif out and not out[-1][2]:
            out[-1] = (out[-1][0], b, False)  # extends the gathered piece before it
        else:
            out.append((a, b, False))
    return out


def answer_frames(spans: np.ndarray, block_ids: list[int], min_bytes: int) -> tuple[list[np.ndarray], list[bool]]:
    """The frames that carry ``block_ids``' bytes, and which of them are the cache's own memory
    (sent in place, to be tracked): per piece (see ``pieces``), one frame per row of ``spans``.
    ``min_bytes``: the socket's copy threshold, under which pyzmq would copy a frame anyway."""
    frames, in_place = [], []
    for a, b, direct in pieces(block_ids, spans.shape[2], min_bytes):
        if direct:
            first = block_ids[a]
            frames += [row[first : first + b - a] for row in spans]
        else:  # one gather for every row, [rows, b - a, span_bytes] in C order (``spans[:, ids]``
            # is not: numpy lays an advanced index's axis out first and returns a transposed view)
            frames += list(np.take(spans, block_ids[a:b], axis=1))
        in_place += [direct] * len(spans)
    return frames, in_place


def _drain(sock: zmq.Socket) -> None:
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def _messages(sock: zmq.Socket):
    """Every message waiting on ``sock``, as frames (zero-copy)."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return


def _elapsed(load: Load) -> float:
    return time.monotonic() - load.started

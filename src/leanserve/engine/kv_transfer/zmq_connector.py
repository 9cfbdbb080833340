"""``ZmqConnector``: KV transfer over ZeroMQ, on one thread of its own, for CPU caches anywhere
(NIXL ships CUDA-only wheels; see ../shared/disaggregation-notes.md).

The decode side pulls. Its engine allocates the blocks, then this thread sends a
``PullRequest`` (msgpack: the lease's engine id, request id, epoch and block ids, and the
puller's ``KVLayout``) from a DEALER socket per prefill worker. The prefill worker's ROUTER
socket (``kv_ip:kv_port``) answers with a ``BlocksHeader`` and one raw frame holding the
blocks' bytes back to back, or with ``Refused`` naming why (a restarted engine, a layout
mismatch, a lease that expired or never was). Nothing is pickled; block bytes are never
parsed.

Copies: the prefill side gathers the lease's blocks into one buffer (one numpy call), after
which its blocks are freed; ZeroMQ sends that buffer without copying it. The decode side
scatters the received frame into its blocks (one numpy call), in place, on this thread. The
engine loop only hands commands over (a deque and an empty wake-up frame) and drains
completions: it never waits on, polls or copies a transfer.
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
from .connector import KVConnector, KVEvents
from .layout import block_array
from .leases import Lease
from .loads import Load
from .messages import (BlocksHeader, FromPrefill, KVLayout, PullRequest, Refused, ReleaseLease, RemotePrefill,
                       ToPrefill)

log = logging.getLogger("leanserve.engine")

# DEALER sockets kept open to prefill workers; the least recently used beyond this is closed
# (a deployment has a handful of prefill workers; a bad remote_host must not pile sockets up).
MAX_REMOTES = 64


class ZmqConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, kv: KVCache, wakeup):
        super().__init__(config, layout, wakeup)
        self.blocks = block_array(kv)
        self._copy_bug = bool(config.kv_connector_extra_config.get("copy_bug"))
        self._unscattered: deque[tuple[Load, np.ndarray]] = deque()  # copy_bug: scattered by ``poll``
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

    def poll(self) -> KVEvents:
        events = super().poll()
        # The copy bug: the transfer thread hands the received bytes over, and the loop copies
        # them into the cache, then marks the load done (it lands next iteration).
        while self._unscattered:
            load, data = self._unscattered.popleft()
            self.blocks[load.block_ids] = data
            self.loads.finish(load.request_id, None)
        return events

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
            for sock, _ in poller.poll():
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
        # The gather, without the GIL. Indexing keeps the cache's stride order within a block: on
        # today's layout that is not one run of bytes, and the blocks are made contiguous in a
        # second copy (a no-op with block-major blocks). Not np.take: on a non-contiguous array it
        # copies the whole cache first (5 s for a 1 GiB cache here).
        data = np.ascontiguousarray(self.blocks[lease.block_ids])
        self._ended_by_transport(lease)  # nothing reads its blocks any more
        header = BlocksHeader(self.engine_id, msg.request_id, msg.epoch, self.layout, lease.block_ids, msg.reply_to)
        router.send_multipart([identity, encoder.encode(header), data], copy=False)
        self.counters.bytes_sent += data.nbytes

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
            if error is not None or not self._copy_bug:  # with the bug, the loop finishes it
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
        block_bytes = self.blocks[0].nbytes
        if len(frames) != 1 or len(frames[0].buffer) != n * block_bytes:
            return f"{where} sent {sum(len(f.buffer) for f in frames)} bytes for {n} blocks of {block_bytes}"
        data = np.frombuffer(frames[0].buffer, self.blocks.dtype).reshape(n, *self.blocks.shape[1:])
        if self._copy_bug:
            self._unscattered.append((load, data))
        else:
            self.blocks[load.block_ids] = data  # the scatter: one copy, in place, without the GIL
        self.counters.bytes_received += data.nbytes
        return None


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

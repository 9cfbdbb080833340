"""Rank 0's handle on the other tensor-parallel ranks of one engine: it starts them (through a
backend: local processes, or Ray actors), builds rank 0's end of the process group, hands them
each step's input, and knows when one has died.

Start-up, in order: the backend places the ranks; rank 0 opens the store and the step channel
(a ring for the ranks on its machine, a socket for each other one); the ranks start, join the
store and say so; rank 0 builds its group (which connects to all of them) and loads its own
share while they load theirs; rank 0 plans the KV cache and publishes the block count; every
rank allocates its slice of the cache and meets at a barrier. A rank that dies on the way fails
the start with its exit status instead of leaving rank 0 waiting on a store or a socket.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import torch

from ...model.loader import read_model_config
from ..batch_state import blocks_needed
from ..config import ResolvedConfig
from ..model_runner import ModelInput
from . import step_codec
from .channel import StepChannel
from .group import DistributedGroup, open_store
from .mp_backend import ProcessBackend
from .worker import RankSpec

log = logging.getLogger("leanserve.engine")

# After a collective fails, how long to wait for the dead rank's exit to be seen, so the error
# names it rather than the socket ("connection closed by peer").
EXIT_NOTICE_S = 2.0
JOIN_POLL_S = 0.05


class Ranks:
    def __init__(self, config: ResolvedConfig):
        engine = config.engine
        self.size = size = engine.tensor_parallel_size
        self.failure: str | None = None  # why a step can no longer run; final
        self._closing = False
        self._lock = threading.Lock()
        self.channel: StepChannel | None = None
        self.backend = _backend(engine.distributed_executor_backend)
        threads = rank_threads(engine.threads, engine.device, size)
        model_cfg = read_model_config(config.model)
        max_len = engine.max_model_len or model_cfg.max_position_embeddings
        words = step_codec.max_words(engine.max_num_seqs, engine.max_prefill_tokens,
                                     blocks_needed(max_len, engine.block_size))
        try:
            local = self.backend.place(size, threads)
            self.store, rendezvous = open_store(self.backend.host, size)
            self.channel = StepChannel(local, words, self.backend.host)
            specs = [RankSpec(config, r, rendezvous, self.backend.rank_host, rank_device(engine.device, r), threads,
                              self.channel.specs[r - 1], self.backend.parent_pid) for r in range(1, size)]
            self.backend.launch(specs, self._on_exit)
            self._wait_for("joined", "starting")
            self.group = DistributedGroup(self.store, 0, size, torch.device(engine.device), self.backend.host)
        except BaseException:
            self.shutdown()
            raise

    def ready(self, num_blocks: int) -> None:
        """Rank 0 has loaded its share and planned the KV cache: the other ranks allocate theirs
        with the same block count; returns once all are ready to run steps."""
        self.store.set("kv_blocks", str(num_blocks))
        try:
            self.group.barrier()
        except RuntimeError as e:
            raise RuntimeError(f"tensor-parallel start-up failed: {self.explain(e)}") from None
        self.channel.attached()

    def publish(self, inp: ModelInput) -> None:
        self.channel.send(step_codec.encode(inp))

    def explain(self, error: BaseException) -> str:
        """The reason a collective failed: a rank's exit when one is seen within EXIT_NOTICE_S.
        Either way the group is broken from now on: ``failure`` is set."""
        deadline = time.monotonic() + EXIT_NOTICE_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            self.failure = self.failure or f"a tensor-parallel collective failed: {error}"
        return self.failure

    def shutdown(self) -> None:
        """Tells the ranks to stop (closing the channel) and waits for them."""
        self._closing = True
        if self.channel is not None:
            self.channel.close()
        self.backend.stop()

    @property
    def pids(self) -> list[int]:
        return self.backend.pids

    def _on_exit(self, rank: int, why: str) -> None:
        if self._closing:
            return
        with self._lock:
            if self.failure is None:
                self.failure = why
        log.error("%s", why)

    def _wait_for(self, key: str, doing: str) -> None:
        """Until every rank has set ``key/<rank>`` in the store, or one has died."""
        keys = [f"{key}/{r}" for r in range(1, self.size)]
        while not self.store.check(keys):
            if self.failure is not None:
                raise RuntimeError(f"tensor-parallel start-up failed while {doing}: {self.failure}")
            time.sleep(JOIN_POLL_S)


def _backend(name: str):
    if name == "ray":
        from .ray_backend import RayBackend

        return RayBackend()
    return ProcessBackend()


def rank_threads(threads: int | None, device: str, size: int) -> int | None:
    """On the CPU the ranks share the cores: each gets (the engine's threads, else all cores) / size,
    since more OpenMP threads than cores turn every barrier into a sleep in the kernel (see
    core.EngineLoop)."""
    if not device.startswith("cpu"):
        return threads
    return max(1, (threads or os.cpu_count() or 1) // size)


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the same CPU, or the r-th GPU after the engine's."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


def with_rank_threads(config: ResolvedConfig) -> ResolvedConfig:
    """``config`` with rank 0's share of the threads."""
    engine = config.engine
    threads = rank_threads(engine.threads, engine.device, engine.tensor_parallel_size)
    return dataclasses.replace(config, engine=dataclasses.replace(engine, threads=threads))

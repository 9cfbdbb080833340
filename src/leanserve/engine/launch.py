"""Starting and stopping a server's engine-core processes.

The launcher (the ``serve`` command's process) starts every engine-core process, for every API
process at once, and is their parent: an engine exits by itself when the launcher is gone
(``process._output_thread``). API processes only reach them, through the ``EngineEndpoints``
that ``start`` returns. With ``--distributed-executor-backend ray`` and ``-dp N > 1`` the engines
are Ray actors instead (``ray_engines``), with the same interface.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile

import msgspec

from .config import ResolvedConfig
from .endpoints import EngineEndpoints
from .process import run_engine_process

log = logging.getLogger("leanserve.engine")

STOP_TIMEOUT_S = 5.0  # after SIGTERM, before SIGKILL


def engines_for(config: ResolvedConfig, eos_token_ids: list[int], size: int = 1, num_clients: int = 1,
                watchdog_timeout: float = 60.0):
    """Local processes, or with the ray backend and several engines, Ray actors. One engine stays
    a local process under ray too: it has no better place than beside its API process (its
    tensor-parallel ranks are still Ray actors), and an API process notices its death by pidfd."""
    if config.engine.distributed_executor_backend == "ray" and size > 1:
        from .ray_engines import RayEngines

        return RayEngines(config, eos_token_ids, size, num_clients, watchdog_timeout)
    return EngineProcesses(config, eos_token_ids, size, num_clients, watchdog_timeout)


class EngineProcesses:
    """``size`` engine-core processes (data parallelism, each with its own model copy and KV
    cache) serving ``num_clients`` API processes. A context manager: leaving it stops them all
    and removes their socket directory."""

    def __init__(self, config: ResolvedConfig, eos_token_ids: list[int], size: int = 1, num_clients: int = 1,
                 watchdog_timeout: float = 60.0):
        if size < 1:
            raise ValueError(f"data_parallel_size: must be >= 1, got {size}")
        self.config = split_threads(config, size)
        self.eos_token_ids = eos_token_ids
        self.size, self.num_clients = size, num_clients
        self.watchdog_timeout = watchdog_timeout
        self.procs: list[multiprocessing.Process] = []
        self._dir: str | None = None

    def start(self) -> EngineEndpoints:
        self._dir = tempfile.mkdtemp(prefix="leanserve-")
        ends = EngineEndpoints.ipc(self._dir, self.size, self.num_clients)
        spawn = multiprocessing.get_context("spawn")
        for k in range(self.size):
            clients = range(self.num_clients)
            p = spawn.Process(
                target=run_engine_process, name=f"leanserve-engine-{k}", daemon=True,
                args=(kv_side_channel(self.config, k, self.size), list(self.eos_token_ids),
                      [ends.requests(k, c) for c in clients], [ends.outputs(k, c) for c in clients], os.getpid(),
                      self.watchdog_timeout),
            )
            p.start()
            self.procs.append(p)
        ends = dataclasses.replace(ends, engine_pids=tuple(p.pid for p in self.procs))
        log.info("engine-core processes: pid %s", ", ".join(str(p) for p in ends.engine_pids))
        return ends

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                log.warning("engine process %d did not stop in %.0f s: killing it", p.pid, STOP_TIMEOUT_S)
                p.kill()
                p.join()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EngineProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def split_threads(config: ResolvedConfig, size: int) -> ResolvedConfig:
    """N engines on one CPU share its cores: without a ``threads`` setting each gets cores / N
    intra-op threads, since more OpenMP threads than cores turn every barrier into a sleep in
    the kernel (a batch-1 forward ran ~2x slower so, see EngineLoop)."""
    if size == 1 or config.engine.threads or not config.model.device.startswith("cpu"):
        return config
    threads = max(1, (os.cpu_count() or 1) // size)
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, threads=threads))


def kv_side_channel(config: ResolvedConfig, k: int, size: int) -> ResolvedConfig:
    """Engine k of several: its own KV side channel, ``kv_port + k`` (vLLM offsets its side-channel
    port by the data-parallel rank), and its own engine id. Each engine is started once, whatever
    the number of API processes, so each port is bound once."""
    kv = config.engine.kv_transfer
    if kv is None or size == 1:
        return config
    kv = msgspec.structs.replace(kv, kv_port=kv.kv_port + k, engine_id=f"{kv.engine_id}-dp{k}")
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, kv_transfer=kv))

"""``--distributed-executor-backend ray`` with ``-dp N > 1``: the N engine cores as Ray actors on
the Ray cluster this machine belongs to (``distributed.ray_backend.join_cluster``), with the
interface of ``launch.EngineProcesses``.

Placement: one placement group with a bundle per engine, each the CPUs of the engine's rank 0
(cores / N by default, ``launch.split_threads``; with ``-tp``, that / TP), packed: this machine
takes as many engines as its Ray resources hold, the rest go to other nodes. Each engine is an
actor in its bundle running ``process.run_engine_process``, the same loop a local engine runs.
With ``-tp T > 1``, an engine's rank 0 is the actor itself and it places its ranks 1..T-1 as
``ray_backend`` does for a single engine: a placement group of its own, rank 0's bundle pinned to
the engine's node (reserving nothing more: the engine's bundle holds its CPUs), the other ranks
packed; so an engine's ranks start on its node and spill over to others only when it is full.
The model path must be readable at the same path on every node that gets an engine or a rank.

The engines connect to their API processes over TCP at this machine's address as Ray reports it
(``EngineEndpoints.tcp``); local engines keep ipc sockets.

Liveness: each engine's ``run`` never returns while it serves, so its ObjectRef resolves only
when the actor dies (RayActorError: the process was killed, or ``ray.kill``) or the engine fails
(its exception). A thread waits on those refs (``ray.wait``: Ray's own signal, which works for an
actor on any node, where a pidfd cannot) and sends ``messages.Exited`` on the dead engine's output
sockets, so every API process fails that engine's requests and takes it out of rotation, as a
pidfd does for a local engine. The actors and their placement groups are owned by this process
(the launcher): Ray ends them when it exits, however it exits.
"""

from __future__ import annotations

import logging
import os
import threading

import msgspec
import zmq

from .config import ResolvedConfig
from .distributed.ranks import rank_threads
from .distributed.ray_backend import PLACEMENT_TIMEOUT_S, join_cluster, node_ip
from .endpoints import EngineEndpoints
from .launch import split_threads
from .messages import Exited
from .process import run_engine_process

log = logging.getLogger("leanserve.engine")


class EngineActor:
    """An engine core in a Ray worker process. Threaded (two calls at once), so ``where``
    answers while ``run`` runs."""

    def where(self) -> tuple[str, int]:
        return node_ip(), os.getpid()

    def run(self, config: ResolvedConfig, eos_token_ids: list[int], in_addrs: list[str], out_addrs: list[str],
            watchdog_timeout: float) -> None:
        run_engine_process(config, eos_token_ids, in_addrs, out_addrs, None, watchdog_timeout)


class RayEngines:
    """``size`` engine cores as Ray actors serving ``num_clients`` API processes. A context manager:
    leaving it ends the actors and their placement group."""

    def __init__(self, config: ResolvedConfig, eos_token_ids: list[int], size: int, num_clients: int = 1,
                 watchdog_timeout: float = 60.0):
        self.config = split_threads(config, size)
        self.eos_token_ids = eos_token_ids
        self.size, self.num_clients = size, num_clients
        self.watchdog_timeout = watchdog_timeout
        self.group = None
        self.actors: list = []
        self.places: list[str] = []  # "pid P on IP", by engine index
        self._stopping = False
        self._ctx = zmq.Context()  # for Exited only

    def start(self) -> EngineEndpoints:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        join_cluster()
        engine = self.config.engine
        cpus = rank_threads(engine.threads, engine.device, engine.tensor_parallel_size) or 1
        self.group = placement_group([{"CPU": cpus}] * self.size, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the Ray cluster could not place {self.size} data-parallel engines of {cpus} CPU "
                               f"each in {PLACEMENT_TIMEOUT_S:.0f} s; `ray status` lists its resources") from None
        ends = EngineEndpoints.tcp(node_ip(), self.size, self.num_clients)
        actor = ray.remote(EngineActor)
        refs = {}
        for k in range(self.size):
            a = actor.options(
                num_cpus=cpus, max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=k),
            ).remote()
            self.actors.append(a)
            clients = range(self.num_clients)
            refs[a.run.remote(self.config, list(self.eos_token_ids), [ends.requests(k, c) for c in clients],
                              [ends.outputs(k, c) for c in clients], self.watchdog_timeout)] = k
        places = ray.get([a.where.remote() for a in self.actors])
        self.places[:] = [f"pid {pid} on {ip}" for ip, pid in places]
        log.info("engine-core processes: pid %s (Ray actors on %s)", ", ".join(str(pid) for _, pid in places),
                 ", ".join(ip for ip, _ in places))
        threading.Thread(target=self._watch, args=(refs, ends), daemon=True, name="leanserve-ray-engines-watch").start()
        return ends

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self._stopping = True
        for a in self.actors:
            ray.kill(a)
        if self.group is not None:
            remove_placement_group(self.group)
        self._ctx.destroy(linger=0)

    @property
    def procs(self) -> list:
        """No local processes for the launcher to watch: ``_watch`` reports a dead engine instead."""
        return []

    def __enter__(self) -> RayEngines:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watch(self, refs: dict, ends: EngineEndpoints) -> None:
        """Tells every API process about each engine that ends, as Ray reports it."""
        import ray

        encoder = msgspec.msgpack.Encoder()
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            if self._stopping:
                return
            for ref in done:
                k = refs[ref]
                try:
                    ray.get(ref)
                    why = "stopped"
                except Exception as e:  # noqa: BLE001 - RayActorError, or the engine's own exception
                    e = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e  # the latter, unwrapped
                    why = f"died: {type(e).__name__}: {str(e).strip().splitlines()[0]}"
                reason = f"the engine's Ray actor ({self.places[k]}) {why}"
                log.error("engine %d: %s; every API process fails its requests, /health answers 503 until the "
                          "server is restarted", k, reason)
                for c in range(self.num_clients):
                    sock = self._ctx.socket(zmq.PUSH)
                    sock.connect(ends.outputs(k, c))
                    sock.send(encoder.encode(Exited(reason)))
                    # Kept until the API process binds, however late (an engine that fails while
                    # loading may beat it); ``stop`` drops what is left.
                    sock.close(linger=-1)

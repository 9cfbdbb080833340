"""``--distributed-executor-backend ray``: the other ranks as Ray actors on the Ray cluster this
machine belongs to (``ray start --head`` here, ``ray start --address=...`` on the others; the
engine joins it with ``ray.init(address="auto")``, or the cluster ``RAY_ADDRESS`` names).

One placement group holds a bundle per rank: rank 0's, pinned to this node, only reserves what
rank 0 uses in the engine's own process (so no actor is given it; nothing at all when the engine
is itself a Ray actor, a data-parallel one, whose own bundle holds those CPUs: see
``engine/ray_engines.py``); the others' are packed onto as few nodes as the cluster allows, each
rank an actor in its bundle. A rank on this node reads the shared-memory ring, one on another
node its own ZeroMQ socket. Ray ends the actors when the engine process (their owner) ends.

CPU ranks only, so far: on CUDA, which GPU Ray gives rank 0's bundle is not tied to the device
the engine process computes on; that needs rank 0's GPU taken from its bundle (not done).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Callable

from ..config import BACKEND_FLAG
from .worker import RankSpec, run_rank

PLACEMENT_TIMEOUT_S = 60.0


class RankActor:
    """A rank in a Ray worker process. Threaded (two calls at once), so ``pid`` answers while
    ``run`` runs; ``run`` loads the model and runs every forward on one thread."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: RankSpec) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {spec.rank} %(levelname)s %(message)s")
        run_rank(dataclasses.replace(spec, host=node_ip()))


def join_cluster() -> None:
    """Connects this process to the Ray cluster (``RAY_ADDRESS``, else this machine's), unless it
    already is (a Ray actor, e.g. a data-parallel engine placing its ranks). No cluster is a
    ValueError: one line from the command line."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address="auto", logging_level=logging.WARNING)
    except ConnectionError as e:
        raise ValueError(f"{BACKEND_FLAG}: no Ray cluster to join ({str(e).splitlines()[0]}); start one with "
                         "`ray start --head`") from None


def node_ip() -> str:
    """This process's node's address as the Ray cluster knows it (``ray start --node-ip-address``):
    ``ray.util.get_node_ip_address`` says so in a driver, but in an actor it gives the machine's
    outward address, which need not be the node's (nor name its ``node:`` resource)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)


class RayBackend:
    def __init__(self):
        import ray

        join_cluster()
        self.host = node_ip()
        self.rank_host = None  # each actor finds its node's
        self.parent_pid = None  # Ray ends the actors when their owner, this process, ends
        self.node_id = ray.get_runtime_context().get_node_id()
        self.group = None
        self.actors: list = []

    def place(self, size: int, threads: int | None) -> list[bool]:
        """Reserves a bundle per rank; returns, for ranks 1..size-1, whether each is on this node."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        bundle = {"CPU": threads or 1}
        pin = {f"node:{self.host}": 0.001}
        in_actor = ray.get_runtime_context().get_actor_id() is not None
        bundles = [pin if in_actor else dict(bundle, **pin)] + [dict(bundle) for _ in range(size - 1)]
        self.group = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the Ray cluster could not place {size} tensor-parallel ranks of {bundle} each "
                               f"(rank 0's on this node) in {PLACEMENT_TIMEOUT_S:.0f} s; `ray status` lists its "
                               "resources") from None
        nodes = placement_group_table(self.group)["bundles_to_node_id"]
        return [nodes[r] == self.node_id for r in range(1, size)]

    def launch(self, specs: list[RankSpec], on_exit: Callable[[int, str], None]) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = ray.remote(RankActor)
        refs = {}
        for spec in specs:
            a = actor.options(
                num_cpus=spec.threads or 1, max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=spec.rank),
            ).remote()
            self.actors.append(a)
            refs[a.run.remote(spec)] = spec.rank
        threading.Thread(target=_watch, args=(refs, on_exit), daemon=True, name="leanserve-ray-ranks-watch").start()

    @property
    def pids(self) -> list[int]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        if self.group is not None:
            remove_placement_group(self.group)


def _watch(refs: dict, on_exit: Callable[[int, str], None]) -> None:
    """``on_exit`` for each rank as its ``run`` ends: an error when its actor died."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        for ref in done:
            try:
                ray.get(ref)
                why = "stopped"
            except Exception as e:  # noqa: BLE001 - RayActorError, or the rank's own exception
                why = f"died ({type(e).__name__}: {str(e).strip().splitlines()[0]})"
            on_exit(refs[ref], f"tensor-parallel rank {refs[ref]} (Ray actor) {why}")

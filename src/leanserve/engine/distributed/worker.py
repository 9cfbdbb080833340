"""A tensor-parallel rank other than 0: its share of the model and of the KV cache, and a loop
that runs the forward of every step rank 0 hands it. It never schedules and never samples.

Started by rank 0 (``ranks.py``) as ``python -m leanserve.engine.distributed`` with its
:class:`RankSpec` pickled on stdin (a process of its own, not a multiprocessing child: the
engine process is a daemon, which multiprocessing forbids to have children), or as a Ray actor
(``ray_backend.py``). A forward that raises ends the process: the other ranks' collectives then
fail at once ("connection closed"), and rank 0 reports this rank's exit.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from dataclasses import dataclass

import torch

from ...model.loader import load_model
from ..config import ResolvedConfig
from ..kv_cache import KVCache
from ..model_runner import ModelRunner
from . import step_codec
from .channel import ChannelSpec, ChannelClosed
from .group import DistributedGroup, Rendezvous, join_store

log = logging.getLogger("leanserve.engine")


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to start, sent once from rank 0."""

    config: ResolvedConfig
    rank: int
    rendezvous: Rendezvous
    host: str | None  # this rank's address for the collectives (None until a Ray actor finds its node's)
    device: str
    threads: int | None  # torch intra-op threads
    channel: ChannelSpec  # where this rank reads each step's input
    parent_pid: int | None  # exit once this process (rank 0's) is gone; None: Ray ends its actors itself


def run_rank(spec: RankSpec) -> None:
    """Joins the group, loads this rank's share, then runs steps until rank 0 stops."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    store = join_store(spec.rendezvous)
    store.set(f"joined/{spec.rank}", "1")  # rank 0 builds its group only once every rank is here
    group = DistributedGroup(store, spec.rank, spec.rendezvous.size, device, spec.host)
    model = load_model(spec.config.model, group, spec.device)
    cfg, engine = model.config, spec.config.engine
    num_blocks = int(store.get("kv_blocks"))
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads // group.size, cfg.head_dim, num_blocks, engine.block_size,
                 spec.config.model.dtype, device)
    runner = ModelRunner(model, kv, device, attention_backend=engine.attention_backend)
    reader = spec.channel.reader(alive=lambda: spec.parent_pid in (None, os.getppid()))
    group.barrier()
    log.info("tensor-parallel rank %d of %d ready (%d KV blocks)", spec.rank, group.size, num_blocks)
    try:
        while True:
            runner.forward(step_codec.decode(reader.read()))
    except ChannelClosed:
        pass  # rank 0 closed the channel (shutdown), or is gone
    finally:
        reader.close()


def main() -> None:
    spec: RankSpec = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {spec.rank} %(levelname)s %(message)s")
    try:
        run_rank(spec)
    except BaseException:
        log.exception("tensor-parallel rank %d failed", spec.rank)
        logging.shutdown()
        os._exit(1)
    os._exit(0)  # no interpreter teardown: nothing is left to flush, and torch's can take seconds

"""A rank of a tensor-parallel group over torch.distributed: gloo on the CPU, NCCL on CUDA,
chosen from the device.

The process group is built directly from a TCPStore (``ProcessGroupGloo(store, rank, size)``),
not through ``init_process_group``: nothing process-wide is set, so a process may hold more
than one engine (tests, data-parallel engines in one process) and the group is an object
passed to the model, like everything else. Rank 0 runs the store; the other ranks find it at
the address in their :class:`~.worker.RankSpec`. The store also carries the little start-up
data ranks exchange (the KV block count, each rank's readiness).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...model.parallel import TensorParallel

# A collective waits for the slowest rank of one layer of one step, milliseconds normally; a
# rank frozen for this long fails the step instead of holding it forever (gloo's default: 30 min).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
# Start-up: the other ranks import torch and load their shares in this time (a 70B checkpoint's
# share takes minutes from a cold disk).
STORE_TIMEOUT = datetime.timedelta(minutes=15)


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0's store listens, and how many ranks meet there."""

    host: str
    port: int
    size: int


def open_store(host: str, size: int) -> tuple[dist.TCPStore, Rendezvous]:
    """Rank 0's store, on a free port of ``host``."""
    store = dist.TCPStore(host, 0, size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    return store, Rendezvous(host, store.port, size)


def join_store(rdv: Rendezvous) -> dist.TCPStore:
    return dist.TCPStore(rdv.host, rdv.port, rdv.size, is_master=False, timeout=STORE_TIMEOUT)


class DistributedGroup(TensorParallel):
    """This process's rank; the model calls :meth:`all_reduce` twice per layer and once per step
    for the embedding, and :meth:`gather_vocab` once per step."""

    def __init__(self, store: dist.TCPStore, rank: int, size: int, device: torch.device, host: str):
        """``host``: this rank's address, which the other ranks connect to (gloo)."""
        self.rank, self.size, self.device = rank, size, device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds the group to the current device
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = COLLECTIVE_TIMEOUT
            self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = COLLECTIVE_TIMEOUT
            self.pg = dist.ProcessGroupGloo(store, rank, size, opts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.pg.allreduce([x]).wait()
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        logits = logits.contiguous()
        parts = [[torch.empty_like(logits) for _ in range(self.size)]] if self.rank == 0 else []
        self.pg.gather(parts, [logits], dist.GatherOptions()).wait()
        return torch.cat(parts[0], dim=1) if self.rank == 0 else None

    def barrier(self) -> None:
        """Returns once every rank has called it (start-up: all ranks loaded and ready)."""
        self.all_reduce(torch.zeros(1, device=self.device))

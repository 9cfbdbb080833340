"""``--distributed-executor-backend mp``: the other ranks as local processes."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
from typing import Callable

from .worker import RankSpec

STOP_TIMEOUT_S = 5.0  # a rank told to stop gets this long before SIGKILL


class ProcessBackend:
    host = "127.0.0.1"  # rank 0's address; every rank is on this machine: collectives over loopback
    rank_host = host  # the others'

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.parent_pid = os.getpid()  # the ranks exit once this process is gone

    def place(self, size: int, threads: int | None) -> list[bool]:
        """Per rank 1..size-1: whether it is on rank 0's machine (always)."""
        return [True] * (size - 1)

    def launch(self, specs: list[RankSpec], on_exit: Callable[[int, str], None]) -> None:
        """Starts one process per spec; ``on_exit(rank, why)`` when one ends."""
        # The import path of this process, as multiprocessing's spawn hands it on.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for spec in specs:
            proc = subprocess.Popen([sys.executable, "-m", "leanserve.engine.distributed"],
                                    stdin=subprocess.PIPE, env=env)
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()
            self.procs.append(proc)
            threading.Thread(target=_watch, args=(spec.rank, proc, on_exit), daemon=True,
                             name=f"leanserve-rank-{spec.rank}-watch").start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        """Waits for the ranks to exit (they were told to), then kills the rest."""
        for p in self.procs:
            try:
                p.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _watch(rank: int, proc: subprocess.Popen, on_exit: Callable[[int, str], None]) -> None:
    code = proc.wait()
    on_exit(rank, f"tensor-parallel rank {rank} (pid {proc.pid}) {describe_exit(code)}")


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"

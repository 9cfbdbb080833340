"""Where API processes and engine-core processes meet: ZeroMQ ipc addresses and engine pids.

For each pair of engine ``k`` and API process ``c`` (the engine's "client") there are two
sockets, both bound by the API process: ``in-k-c``, a PUSH of requests and aborts, and
``out-k-c``, a PULL of the engine's outputs. Engine ``k`` connects its one input PULL to every
``in-k-*`` (ZeroMQ queues fairly across them) and one output PUSH to each ``out-k-*``. Connecting
never blocks and never loses a message: what an engine sends before an API process has bound
waits in ZeroMQ's queue, so the processes may start in any order.

The launcher makes one ``EngineEndpoints`` and sends it as is to every API process.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineEndpoints:
    ipc_dir: str  # a private directory for the sockets, removed by the launcher
    num_engines: int
    num_clients: int  # API processes
    # The engine-core processes' pids, by engine index: an API process watches them (a pidfd)
    # to notice an engine's death at once, though the launcher, not it, is their parent.
    engine_pids: tuple[int, ...] = ()

    def requests(self, engine: int, client: int) -> str:
        return f"ipc://{self.ipc_dir}/in-{engine}-{client}"

    def outputs(self, engine: int, client: int) -> str:
        return f"ipc://{self.ipc_dir}/out-{engine}-{client}"

"""Where API processes and engine-core processes meet: ZeroMQ addresses, and how an API process
learns of an engine's death.

For each pair of engine ``k`` and API process ``c`` (the engine's "client") there are two
sockets, both bound by the API process: ``in-k-c``, a PUSH of requests and aborts, and
``out-k-c``, a PULL of the engine's outputs. Engine ``k`` connects its one input PULL to every
``in-k-*`` (ZeroMQ queues fairly across them) and one output PUSH to each ``out-k-*``. Connecting
never blocks and never loses a message: what an engine sends before an API process has bound
waits in ZeroMQ's queue, so the processes may start in any order.

Engines on this machine (local processes) meet their API processes at ipc paths in a private
directory; engines that may run on other machines (Ray actors) at TCP ports of this machine's
address as the Ray cluster knows it, which every node of the cluster reaches.

The launcher makes one ``EngineEndpoints`` and sends it as is to every API process.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineEndpoints:
    num_engines: int
    num_clients: int  # API processes
    # in-k-c then out-k-c for every pair, engine-major: see ``requests`` and ``outputs``.
    addresses: tuple[str, ...]
    # The engine-core processes' pids, by engine index: an API process watches them (a pidfd)
    # to notice an engine's death at once, though the launcher, not it, is their parent. Empty
    # for Ray actors, which may be on other machines: the launcher sends ``messages.Exited`` on
    # a dead one's output sockets instead (engine/ray_engines.py).
    engine_pids: tuple[int, ...] = ()

    @classmethod
    def ipc(cls, directory: str, num_engines: int, num_clients: int) -> EngineEndpoints:
        """Sockets in ``directory`` (private; the launcher removes it)."""
        return cls(num_engines, num_clients, tuple(f"ipc://{directory}/{kind}-{k}-{c}" for k in range(num_engines)
                                                   for c in range(num_clients) for kind in ("in", "out")))

    @classmethod
    def tcp(cls, host: str, num_engines: int, num_clients: int) -> EngineEndpoints:
        """Free TCP ports of ``host``, an address of this machine."""
        ports = free_ports(host, 2 * num_engines * num_clients)
        where = f"[{host}]" if ":" in host else host  # an IPv6 address, as ZeroMQ spells it
        return cls(num_engines, num_clients, tuple(f"tcp://{where}:{p}" for p in ports))

    def requests(self, engine: int, client: int) -> str:
        return self.addresses[2 * (engine * self.num_clients + client)]

    def outputs(self, engine: int, client: int) -> str:
        return self.addresses[2 * (engine * self.num_clients + client) + 1]


def free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct ports the kernel has free on ``host`` now. Another process could take one
    before its API process binds it (vLLM's get_open_port has the same window): that API process
    then fails to start, naming the address."""
    socks = [socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) for _ in range(n)]
    try:
        for s in socks:  # all held at once, so the n are distinct
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()

"""KV transfer for disaggregated serving: a prefill worker hands a request's KV blocks to a
decode worker.

Prefill side: a request sent with ``do_remote_decode`` keeps its prompt's blocks when it
finishes, under a lease (deadline and epoch, ``leases.py``); the answer names them
(``kv_transfer_params``). Decode side: a request sent with those params allocates its blocks,
waits in ``WAITING_FOR_REMOTE_KVS`` (holding its blocks and a batch slot) while the transfer
thread pulls the bytes (``loads.py``), then joins the running batch with all but its last prompt
token computed: that token runs as an ordinary decode row.

  config.py          ``--kv-transfer-config`` (vLLM's field names)
  messages.py        what the API process, the engine and the workers say to each other
  connector.py       the interface the engine loop calls (vLLM's scheduler/worker split)
  leases.py, loads.py  the two sides' state, shared by the loop and the transfer thread
  layout.py          this engine's KV layout; every block buffer as one array
  zmq_connector.py   ZeroMQ transport on its own thread (the default)
  fake_connector.py  no transport: the scheduler's request states tested without a model
"""

from __future__ import annotations

from typing import Callable

import torch

from ..kv_cache import KVCache
from .config import KVTransferConfig
from .connector import KVConnector
from .layout import engine_layout


def make_connector(config: KVTransferConfig, kv: KVCache, model: torch.nn.Module, block_size: int,
                   wakeup: Callable[[], None]) -> KVConnector:
    from .zmq_connector import ZmqConnector  # the one connector today (config.CONNECTORS)

    return ZmqConnector(config, engine_layout(model, block_size), kv, wakeup)

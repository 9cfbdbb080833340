"""A connector that moves no bytes, as SGLang's ``fake`` transfer backend: loads complete (or
fail, or never land) at once, leases are kept and expire as on a real worker. The scheduler's
request states are tested with it, without a model or a socket."""

from __future__ import annotations

from ...model.kv_layout import KEY_ORDER
from .config import KVTransferConfig
from .connector import KVConnector
from .loads import Load
from .messages import KVLayout, RemotePrefill

OUTCOMES = ("complete", "fail", "hold")


class FakeConnector(KVConnector):
    def __init__(self, config: KVTransferConfig | None = None, outcome: str = "complete"):
        """``outcome`` of every load: "complete" (lands on the next poll), "fail", or "hold"
        (never lands: it times out, or the test claims and finishes it)."""
        assert outcome in OUTCOMES, outcome
        super().__init__(config or KVTransferConfig(engine_id="fake"),
                         KVLayout("fake", "float32", 1, 1, 1, 1, KEY_ORDER), wakeup=lambda: None)
        self.outcome = outcome
        self.released: list[RemotePrefill] = []  # leases this worker told a prefill worker to free

    def _pull(self, load: Load) -> None:
        if self.outcome == "hold":
            return
        self.loads.claim(load.request_id)
        self.loads.finish(load.request_id, None if self.outcome == "complete" else "the fake connector fails loads")

    def _release(self, remote: RemotePrefill) -> None:
        self.released.append(remote)

    def pulled(self, request_id: int, epoch: int) -> bool:
        """What a decode worker's pull does to one of this worker's leases; False if refused."""
        lease = self.leases.take(request_id, epoch)
        if lease is not None:
            self._ended_by_transport(lease)
        return lease is not None

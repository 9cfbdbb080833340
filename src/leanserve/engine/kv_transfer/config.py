"""``--kv-transfer-config``: vLLM's JSON field names, checked once at start-up so a bad value
is one line naming the field."""

from __future__ import annotations

import uuid

import msgspec

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("ZmqConnector",)
LOAD_FAILURE_POLICIES = ("fail", "recompute")


class KVTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kv_connector: str = "ZmqConnector"
    # kv_producer: hands KV to decode workers (a prefill worker); kv_consumer: receives it (a
    # decode worker); kv_both: either, per request. As in vLLM, the router decides who prefills.
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # the side channel's address, given to decode workers as remote_host
    kv_port: int = 5600  # vLLM's side-channel default
    engine_id: str | None = None  # None: a new one per start, so a restarted worker is told apart
    # Decode side: a transfer not landed by then fails its request (or is recomputed, below):
    # TensorRT-LLM's kv_transfer_timeout_ms is 60 s; transfers here take milliseconds.
    kv_transfer_timeout_s: float = 30.0
    # Prefill side: blocks of a finished prefill no decode worker has pulled or released are
    # freed after this (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 120 s).
    kv_lease_timeout_s: float = 120.0
    # vLLM's kv_load_failure_policy: "fail" ends the request with the transfer's error;
    # "recompute" computes the prompt here instead.
    kv_load_failure_policy: str = "fail"
    # vLLM's field for a connector's own options; ZmqConnector has none, so it must be empty.
    kv_connector_extra_config: dict = {}

    @classmethod
    def from_json(cls, text: str) -> "KVTransferConfig":
        try:
            cfg = msgspec.json.decode(text, type=cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"--kv-transfer-config: {e}") from None
        except msgspec.DecodeError as e:
            raise ValueError(f"--kv-transfer-config: not JSON ({e})") from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(field: str, why: str):
            raise ValueError(f"--kv-transfer-config: {field}: {why}")

        if self.kv_connector not in CONNECTORS:
            bad("kv_connector", f"one of {', '.join(CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            bad("kv_role", f"one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if not 0 < self.kv_port < 65536:
            bad("kv_port", f"must be in [1, 65535], got {self.kv_port}")
        for name in ("kv_transfer_timeout_s", "kv_lease_timeout_s"):
            if getattr(self, name) <= 0:
                bad(name, f"must be > 0, got {getattr(self, name)}")
        if self.kv_connector_extra_config:
            bad("kv_connector_extra_config", f"{self.kv_connector} takes no options, got "
                                             f"{sorted(self.kv_connector_extra_config)}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            bad("kv_load_failure_policy", f"one of {', '.join(LOAD_FAILURE_POLICIES)}, "
                                          f"got {self.kv_load_failure_policy!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def with_engine_id(self) -> "KVTransferConfig":
        """This config with its engine id fixed (a fresh one unless given), so the API process
        and the engine process name the same engine."""
        return msgspec.structs.replace(self, engine_id=self.engine_id or uuid.uuid4().hex)

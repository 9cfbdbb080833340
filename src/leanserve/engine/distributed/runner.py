"""Rank 0's model runner under tensor parallelism: each step's input goes to the other ranks
first (its own phase in the iteration stats, ``broadcast_ms``), then rank 0 runs its share of
the forward with them and samples alone."""

from __future__ import annotations

import time

from ..kv_cache import KVCache
from ..model_runner import ExecutorFailed, ModelInput, ModelOutput, ModelRunner
from ..structured import GrammarBitmask
from ...model.transformer import Transformer
from .ranks import Ranks


class TensorParallelRunner(ModelRunner):
    def __init__(self, model: Transformer, kv_cache: KVCache, ranks: Ranks, device="cpu", seed: int | None = None,
                 grammar_bitmask: GrammarBitmask | None = None, attention_backend: str = "auto"):
        super().__init__(model, kv_cache, device, seed, grammar_bitmask=grammar_bitmask,
                         attention_backend=attention_backend)
        self.ranks = ranks
        ranks.ready(kv_cache.pool.num_blocks)

    @property
    def failure(self) -> str | None:
        return self.ranks.failure

    def execute(self, inp: ModelInput) -> ModelOutput:
        if self.ranks.failure is not None:
            raise ExecutorFailed(self.ranks.failure)
        t0 = time.perf_counter()
        self.ranks.publish(inp)
        sent = time.perf_counter()
        out = super().execute(inp)
        out.broadcast_ms = (sent - t0) * 1e3
        return out

    def run_model(self, *args):
        # A failing collective (a rank died, or the group is out of step) breaks the group for
        # good: no later step can run. Sampling, after it, fails only its own step.
        try:
            return super().run_model(*args)
        except Exception as e:
            raise ExecutorFailed(self.ranks.explain(e)) from e

    def shutdown(self) -> None:
        self.ranks.shutdown()

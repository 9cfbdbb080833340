"""Distributed execution beside the model runner: tensor parallelism (``--tensor-parallel-size``).

One engine core (scheduler, block pool, persistent batch) drives N ranks that hold one model
between them (``model/parallel.py``: Megatron's split, collectives over torch.distributed).
Rank 0 runs in the engine's own thread (``runner.TensorParallelRunner``); each step it writes
the model input to a shared-memory ring (``shm_ring``, ``step_codec``), runs its share of the
forward with the others and samples alone. The other ranks (``worker``) are local processes
(``mp_backend``) or Ray actors (``ray_backend``), started and watched by ``ranks.Ranks``; a rank
on another machine reads its steps from a ZeroMQ socket instead of the ring (``channel``).
"""

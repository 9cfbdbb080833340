"""Distributed execution beside the model runner: tensor parallelism.

``group``: a rank of a torch.distributed process group, on which the split model
(``model/parallel.py``) runs its collectives.
"""

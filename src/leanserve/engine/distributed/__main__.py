"""``python -m leanserve.engine.distributed``: a tensor-parallel rank other than 0 (see ``worker``)."""

from .worker import main

main()

"""Grammar compilation off the loop thread, cached by spec.

``compile(spec, n)`` is called by whoever enqueues the request (the engine's input thread) and
returns at once with a Future of ``n`` matchers; one worker thread builds them. The loop admits
the request once the Future is done and never waits on it, so a request whose grammar is
compiling holds back no other. Compiled grammars are kept by spec (LRU): a repeated schema costs
a ~7 us fork per sample instead of a compile.

The worker's first job, queued when the engine is built, is the matchers' view of the
vocabulary (0.3-0.4 s for a 49k-token tokenizer, plus reading the tokenizer): it runs while the
engine comes up, so the first constrained request rarely waits for it.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import msgspec

from . import backend

# Compiled grammars kept (each a few KB to a few MB for big schemas).
CACHE_SIZE = 256


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], object], cache_size: int = CACHE_SIZE):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leanserve-grammar")
        self._tokenizer = self._pool.submit(load_tokenizer)
        self._cache: OrderedDict[bytes, backend.Matcher] = OrderedDict()  # touched by the worker only
        self._cache_size = cache_size
        self._encoder = msgspec.json.Encoder()

    def compile(self, spec, n: int = 1) -> Future:
        """Future of ``n`` independent matchers for ``spec``; fails with ValueError if the spec
        or its grammar is invalid."""
        return self._pool.submit(self._matchers, spec, n)

    def _matchers(self, spec, n: int) -> list:
        key = self._encoder.encode(spec)
        template = self._cache.get(key)
        if template is None:
            template = backend.compile_matcher(self._tokenizer.result(), backend.grammar_text(spec))
            self._cache[key] = template
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return [backend.fork(template) for _ in range(n)]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

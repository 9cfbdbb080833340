"""Structured outputs: decoding constrained to a JSON schema, regex, choice list or grammar.

The engine's side of it, in four small pieces (the grammar library, llguidance, only behind
``backend``):
  * ``backend.grammar_error(spec)``: validation, run by the API process (a 400 before anything
    reaches the engine) and the offline API;
  * ``GrammarCompiler``: compiles a request's grammar on its own thread, cached by spec; the loop
    admits the request once it is ready and never waits for it;
  * ``GrammarBitmask``: per step, one call fills the bitmasks of all constrained rows (after the
    forward is launched, so on an asynchronous device it overlaps the forward), one op applies
    them to the logits;
  * ``backend.accept`` / ``backend.is_terminated``: after sampling, the scheduler advances each
    constrained request's matcher (``Request.grammar``) and ends a request whose grammar is
    complete.
"""

from .backend import grammar_error
from .bitmask import GrammarBitmask
from .compiler import GrammarCompiler

__all__ = ["GrammarBitmask", "GrammarCompiler", "grammar_error"]

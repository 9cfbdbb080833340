"""Chat templates: the checkpoint's Jinja template, rendered in a sandbox the way transformers'
``apply_chat_template`` renders it (same environment options, filters and globals)."""

from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers overrides jinja's tojson: no HTML escaping, unicode kept as is.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def read_chat_template(arg: str) -> str:
    """vLLM's ``--chat-template``: a file's path, or the Jinja source itself."""
    if os.path.isfile(arg):
        with open(arg) as f:
            return f.read()
    if any(c in arg for c in "{}\n"):
        return arg
    raise ValueError(f"--chat-template: {arg!r} is neither a file nor a Jinja template")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat template: line {e.lineno}: {e.message}") from None
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._tokens, **kwargs
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"messages: the chat template rejected them: {e}") from None

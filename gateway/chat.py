"""Chat templates, rendered the way transformers' apply_chat_template renders them, in a sandbox.

The Jinja environment copies HF's options and helpers (trim_blocks, lstrip_blocks, loopcontrols, a tojson
that keeps non-ASCII and does not HTML-escape, raise_exception, strftime_now) so a checkpoint's template
renders byte-identically; the immutable sandbox keeps templates away from Python internals and from
mutating request data.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_env()
# Rendering runs a third-party template over client data: any failure is the request's fault.
_RENDER_ERRORS = (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError)


class ChatTemplate:
    def __init__(self, source: str, origin: str):
        try:
            self._template = _ENV.from_string(source)
        except TemplateError as e:
            raise ValueError(f"{origin}: invalid chat template: {e}") from e
        self.source, self.origin = source, origin

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **context: Any) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] must be a dict with a string 'role'")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except _RENDER_ERRORS as e:
            raise ValueError(f"chat template ({self.origin}) failed: {e}") from e


# Kimi K2-style template written by `ddtree make-tiny` (reference/k26.md §1.3). Tools, when given, are
# declared first as `<|im_system|>tool_declare<|im_middle|>{compact JSON}<|im_end|>`. Turns are
# `<|im_{role}|>{name or role}<|im_middle|>{content}<|im_end|>` (tool results use <|im_system|>tool);
# assistant turns carry a <think> block that keeps its reasoning only after the last user turn or with
# preserve_thinking; the generation prompt ends with <think> (thinking) or <think></think> (thinking=false)
# when `thinking` is given, and with <|im_middle|> when it is not.
KIMI_STYLE_CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part is mapping and part.get('type', 'text') == 'text' -%}{{- part.get('text', '') -}}{%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
  {{- '<|im_system|>tool_declare<|im_middle|>' ~ (tools | tojson(separators=(',', ':'))) ~ '<|im_end|>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
  {%- set role = message['role'] -%}
  {%- if role == 'system' or role == 'tool' -%}
    {{- '<|im_system|>' -}}
  {%- elif role == 'user' -%}
    {{- '<|im_user|>' -}}
  {%- elif role == 'assistant' -%}
    {{- '<|im_assistant|>' -}}
  {%- else -%}
    {{- raise_exception('unknown role: ' ~ role) -}}
  {%- endif -%}
  {{- message.get('name') or role -}}{{- '<|im_middle|>' -}}
  {%- if role == 'assistant' -%}
    {%- set keep = preserve_thinking or loop.index0 > ns.last_user -%}
    {{- '<think>' ~ ((message.get('reasoning_content') or '') if keep else '') ~ '</think>' -}}
  {%- elif role == 'tool' -%}
    {{- '## Return of ' ~ (message.get('tool_call_id') or '') ~ '\\n' -}}
  {%- endif -%}
  {{- render_content(message.get('content')) -}}
  {%- if role == 'assistant' and message.get('tool_calls') -%}
    {{- '<|tool_calls_section_begin|>' -}}
    {%- for call in message['tool_calls'] -%}
      {%- set fn = call.get('function') or call -%}
      {%- set args = fn.get('arguments') or {} -%}
      {{- '<|tool_call_begin|>' ~ (call.get('id') or 'functions.' ~ fn.get('name', '') ~ ':' ~ loop.index0) -}}
      {{- '<|tool_call_argument_begin|>' ~ (args if args is string else args | tojson) ~ '<|tool_call_end|>' -}}
    {%- endfor -%}
    {{- '<|tool_calls_section_end|>' -}}
  {%- endif -%}
  {{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_assistant|>assistant<|im_middle|>' -}}
  {%- if thinking is defined -%}
    {{- '<think>' if thinking else '<think></think>' -}}
  {%- endif -%}
{%- endif -%}
"""

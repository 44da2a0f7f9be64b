"""Structured output: the public ResponseFormat -> an llguidance grammar for the verifier (verifier_service/grammar.py
applies it), checked here so that a bad schema, regex or grammar is INVALID_ARGUMENT naming its field before any
work is queued."""

from __future__ import annotations

import json

import llguidance

from ddtree.v1 import generation_pb2 as pb
from service_kit.errors import InvalidArgument

MAX_GRAMMAR_CHARS = 1 << 20
# JSON's whitespace between tokens, at most 64 characters a gap: room for pretty-printing (a newline and 16 levels
# of 4-space indent), no room for the endless whitespace a JSON grammar otherwise lets a model emit. A schema's own
# "x-guidance" options (llguidance's, e.g. {"whitespace_flexible": false} for compact JSON) override it.
JSON_DEFAULTS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,64}"}


def grammar(fmt: pb.ResponseFormat) -> str:
    """The llguidance grammar (JSON text) of `fmt`; "" when unset (free text)."""
    kind = fmt.WhichOneof("format")
    if kind is None or (kind == "json_object" and not fmt.json_object):
        return ""
    field = f"response_format.{kind}"
    source = getattr(fmt, kind)
    if isinstance(source, str) and not 0 < len(source) <= MAX_GRAMMAR_CHARS:
        raise InvalidArgument(field, f"must be 1..{MAX_GRAMMAR_CHARS} characters")
    if kind == "json_object":
        text = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    elif kind == "json_schema":
        schema = _schema(source, field)
        own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
        spaced = "whitespace_flexible" in own or "whitespace_pattern" in own  # the schema chose its whitespace
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=None if spaced else JSON_DEFAULTS)
    elif kind == "regex":
        text = llguidance.LLMatcher.grammar_from_regex(source)
    else:
        text = llguidance.LLMatcher.grammar_from_lark(source)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error and not error.startswith("WARNING"):
        raise InvalidArgument(field, error.strip())
    return text


def _schema(text: str, field: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(field, f"not valid JSON: {e}") from e
    if not isinstance(schema, dict):
        raise InvalidArgument(field, "must be a JSON object (a JSON Schema)")
    return schema


def check_combination(req: pb.GenerateRequest, forced_call: bool) -> None:
    """Structured output with a forced tool call, a minimum length or ignore_eos is refused: the call is not the
    grammar's text, and a complete answer allows only EOS."""
    if forced_call:
        raise InvalidArgument("response_format", "cannot be combined with a forced tool call (chat.tool_choice)")
    if req.stopping.min_new_tokens:
        raise InvalidArgument("stopping.min_new_tokens", "cannot be combined with response_format")
    if req.stopping.ignore_eos:
        raise InvalidArgument("stopping.ignore_eos", "cannot be combined with response_format")

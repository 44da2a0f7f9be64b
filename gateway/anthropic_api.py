"""Anthropic Messages JSON bodies (POST /v1/messages, /v1/messages/count_tokens) → the public `GenerateRequest`
(responses: gateway/anthropic_response.py). Tools for Claude-style clients (Claude Code, the Anthropic SDKs) talk to
K2.6 the way they talk to Anthropic's API.

Mapped: `system` (a string or text blocks) → a system turn; `messages` of `user` / `assistant` turns, whose content is
a string or blocks: `text`, assistant `thinking` (→ reasoning_content) and `tool_use` (→ tool calls, `input` as JSON
arguments), user `tool_result` (→ a tool turn per result, before the turn's text); `tools` ({name, description,
input_schema}) and `tool_choice` (auto, any → required, tool → that name, none); `thinking` ({"type": "enabled"} or
"disabled": Kimi's thinking switch; `budget_tokens` is accepted and not enforced, K2.6 has no budget);
`max_tokens` (required), `stop_sequences`, `temperature` (unset: greedy, as on every surface here, where Anthropic's
default is 1), `top_p`, `top_k`; DDTree's `spec_mode` and `tree_budget`. Images and documents are refused by name.
"""

from __future__ import annotations

import json

from ddtree.v1 import generation_pb2 as pb
from gateway.openai_api import int32, speculation, text_parts, typed
from service_kit.errors import InvalidArgument

TOOL_CHOICES = {"auto": "", "any": "required", "none": "none"}  # "tool" → its name


def messages_request(body: dict, *, count_only: bool = False) -> pb.GenerateRequest:
    """A Messages body → GenerateRequest (chat input). count_only (count_tokens): no max_tokens needed."""
    req = pb.GenerateRequest()
    _system(body, req)
    messages = typed(body, "messages", list, "a list of messages")
    if not messages:
        raise InvalidArgument("messages", "must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise InvalidArgument(f"messages[{i}].role", 'must be "user" or "assistant"')
        (_user if m["role"] == "user" else _assistant)(m.get("content"), i, req)
    _tools(body, req)
    thinking = typed(body, "thinking", dict, "an object", {})
    if thinking.get("type") in ("enabled", "disabled"):
        req.chat.thinking = thinking["type"] == "enabled"
    elif thinking:
        raise InvalidArgument("thinking.type", 'must be "enabled" or "disabled"')
    if count_only:
        return req
    max_tokens = int32(body, "max_tokens")
    if max_tokens is None:
        raise InvalidArgument("max_tokens", "required")
    req.stopping.max_new_tokens = max_tokens
    stops = typed(body, "stop_sequences", list, "a list of strings", [])
    if not all(isinstance(s, str) for s in stops):
        raise InvalidArgument("stop_sequences", "must be a list of strings")
    req.stopping.stop.extend(stops)
    for name in ("temperature", "top_p"):
        value = typed(body, name, (int, float), "a number")
        if value is not None:
            setattr(req.sampling, name, value)
    top_k = int32(body, "top_k")
    if top_k is not None:
        req.sampling.top_k = top_k
    speculation(body, req)
    return req


def _system(body: dict, req: pb.GenerateRequest) -> None:
    system = body.get("system")
    if system:
        req.chat.messages.add(role="system", content=text_parts(system, "system"))


def _blocks(content, i: int) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidArgument(f"messages[{i}].content", "must be a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise InvalidArgument(f"messages[{i}].content[{j}]", "must be a content block with a type")
    return content


def _user(content, i: int, req: pb.GenerateRequest) -> None:
    """Tool results become tool turns (in order, first), the text one user turn."""
    texts, blocks = [], _blocks(content, i)
    for j, block in enumerate(blocks):
        field = f"messages[{i}].content[{j}]"
        if block["type"] == "text":
            texts.append(typed(block, "text", str, "a string", "", parent=field + "."))
        elif block["type"] == "tool_result":
            call_id = typed(block, "tool_use_id", str, "a string", parent=field + ".")
            if not call_id:
                raise InvalidArgument(field + ".tool_use_id", "required")
            result = text_parts(block.get("content") or "", field + ".content")
            req.chat.messages.add(role="tool", tool_call_id=call_id,
                                  content=f"Error: {result}" if block.get("is_error") else result)
        else:
            raise InvalidArgument(field, f"{block['type']!r} blocks are not supported (text, tool_result)")
    if texts or not any(b["type"] == "tool_result" for b in blocks):
        req.chat.messages.add(role="user", content="\n".join(texts))


def _assistant(content, i: int, req: pb.GenerateRequest) -> None:
    message = req.chat.messages.add(role="assistant")
    texts, thoughts = [], []
    for j, block in enumerate(_blocks(content, i)):
        field = f"messages[{i}].content[{j}]"
        if block["type"] == "text":
            texts.append(typed(block, "text", str, "a string", "", parent=field + "."))
        elif block["type"] == "thinking":
            thoughts.append(typed(block, "thinking", str, "a string", "", parent=field + "."))
        elif block["type"] == "redacted_thinking":
            continue  # another model's encrypted thinking: nothing to render
        elif block["type"] == "tool_use":
            name = typed(block, "name", str, "a string", parent=field + ".")
            if not name:
                raise InvalidArgument(field + ".name", "required")
            args = typed(block, "input", dict, "an object", {}, parent=field + ".")
            message.tool_calls.add(id=str(block.get("id") or ""), name=name, arguments=json.dumps(args))
        else:
            raise InvalidArgument(field, f"{block['type']!r} blocks are not supported (text, thinking, tool_use)")
    message.content, message.reasoning_content = "".join(texts), "".join(thoughts)


def _tools(body: dict, req: pb.GenerateRequest) -> None:
    """Anthropic tool definitions → OpenAI-style ones for the chat template; tool_choice → ChatMessages'."""
    tools = []
    for j, t in enumerate(typed(body, "tools", list, "a list of tools", [])):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise InvalidArgument(f"tools[{j}]", "must be an object with a name (and input_schema)")
        schema = typed(t, "input_schema", dict, "an object", {"type": "object"}, parent=f"tools[{j}].")
        tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                       "parameters": schema}})
    choice = typed(body, "tool_choice", dict, "an object", {"type": "auto"})
    kind = choice.get("type")
    if kind == "tool" and isinstance(choice.get("name"), str):
        req.chat.tool_choice = choice["name"]
    elif kind in TOOL_CHOICES:
        req.chat.tool_choice = TOOL_CHOICES[kind]
    else:
        raise InvalidArgument("tool_choice", '{"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}')
    if tools and req.chat.tool_choice != "none":
        req.chat.tools_json = json.dumps(tools)


def anthropic_param(field: str) -> str:
    """A validation error's proto field path → the Messages parameter the client sent."""
    renames = (("stopping.max_new_tokens", "max_tokens"), ("stopping.stop", "stop_sequences"), ("sampling.", ""),
               ("speculation.mode", "spec_mode"), ("speculation.", ""), ("chat.tool_choice", "tool_choice"),
               ("chat.tools_json", "tools"), ("chat.messages", "messages"), ("chat", "messages"), ("input", "messages"))
    for old, new in renames:
        if field.startswith(old):
            return new + field[len(old):]
    return field

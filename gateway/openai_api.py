"""OpenAI-style JSON bodies → the public `GenerateRequest` (responses: gateway/openai_response.py).

The HTTP surface (gateway/http_api.py) runs what this builds through the same validation and pipeline as
gRPC `Generate`. Errors name the OpenAI parameter (`temperature`, `messages[2].role`), not the proto path.
Extensions beyond OpenAI, spelled as vLLM / SGLang spell them: `top_k`, `min_p`, `stop_token_ids`,
`ignore_eos`, `include_stop_str_in_output`, `min_tokens`, `chat_template_kwargs.thinking` / `.preserve_thinking`;
DDTree's own: `spec_mode` ("ar" | "chain" | "ddtree"), `tree_budget`, `max_duration_ms` (finish_reason "length" when
it runs out). OpenAI's `metadata` (string tags) becomes GenerateRequest.labels: written into the request's log lines.
Tools: `tools` go to the chat template, the model's calls come back as `tool_calls` (finish_reason
"tool_calls", gateway/tool_calls.py); `tool_choice` "auto", "none", "required" or a named function (the answer
then starts with that call: the verifier forces its opening tokens, the arguments are the model's). `presence_penalty`,
`frequency_penalty`, `logit_bias` (OpenAI's) and `repetition_penalty` (vLLM's) change the target's distribution on
the verifier, exactly as plain decoding would. `n` > 1 runs n generations (choice i seeded with seed + i).
Structured output: `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
…}}) or vLLM's `structured_outputs` (one of `json`, `regex`, `choice`, `grammar` (Lark), `json_object`): the answer
matches it (GenerateRequest.response_format; applied after the thinking block).
Parameters that are not implemented (best_of, suffix) are refused by name rather than ignored.
`logprobs` (completions: n alternatives) and `top_logprobs` (chat) come from the verifier, up to 20 alternatives.
Completions' `echo` returns the prompt before the completion, and with `logprobs` each prompt token's
(`GenerateRequest.prompt_logprobs`); `echo` with `max_tokens` 0 returns the prompt alone (one token is generated
to end the request, not returned).
"""

from __future__ import annotations

import json
from typing import Any

from ddtree.v1 import generation_pb2 as pb
from service_kit.errors import InvalidArgument

SPEC_MODES = {"ar": pb.SPEC_MODE_AR, "chain": pb.SPEC_MODE_CHAIN, "ddtree": pb.SPEC_MODE_DDTREE}
# Refused unless at their no-op value (or empty; response_format {"type": "text"} is plain text, the default):
# each would change what is sampled, or how many answers come back.
UNSUPPORTED = {"best_of": 1, "echo": False, "suffix": None, "functions": None}
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's structured_outputs keys
MAX_CHOICES = 16  # `n`: independent generations of one request
TOOL_CHOICES = ("auto", "none", "required")
CHAT_TEMPLATE_KWARGS = ("thinking", "preserve_thinking")  # booleans, into ChatMessages' fields of these names
INT32 = 2**31


def typed(body: dict, name: str, kind: type | tuple, what: str, default: Any = None, parent: str = "") -> Any:
    """body[name] checked against `kind` (bool is not accepted as a number); `parent` prefixes the error's field."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise InvalidArgument(parent + name, f"must be {what}, got {type(value).__name__}")
    return value


def int32(body: dict, name: str, default: int | None = None) -> int | None:
    value = typed(body, name, int, "an integer", default)
    if value is not None and not -INT32 <= value < INT32:
        raise InvalidArgument(name, f"{value} is out of range")
    return value


def _check_unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != neutral and value not in ([], {}, "", {"type": "text"}):
            raise InvalidArgument(name, f"not supported (only {neutral!r})")


def _sampling_and_stopping(body: dict, req: pb.GenerateRequest) -> None:
    """The parameters chat and completions share, into `req`."""
    _check_unsupported(body)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = typed(body, name, (int, float), "a number")
        if value is not None:
            setattr(req.sampling, name, value)
    _logit_bias(body, req)
    top_k = int32(body, "top_k")
    if top_k is not None and top_k != -1:  # vLLM's spelling of "no top-k"
        req.sampling.top_k = top_k
    seed = int32(body, "seed")
    if seed is not None:
        if seed < 0:
            raise InvalidArgument("seed", f"must be >= 0, got {seed}")
        req.sampling.seed = seed
    max_tokens = int32(body, "max_completion_tokens", int32(body, "max_tokens"))
    if max_tokens is not None:
        req.stopping.max_new_tokens = max_tokens
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgument("stop", "must be a string or a list of strings")
    req.stopping.stop.extend(stops)
    ids = typed(body, "stop_token_ids", list, "a list of token ids", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and -INT32 <= t < INT32 for t in ids):
        raise InvalidArgument("stop_token_ids", "must be a list of token ids")
    req.stopping.stop_token_ids.extend(ids)
    req.stopping.ignore_eos = typed(body, "ignore_eos", bool, "a boolean", False)
    req.stopping.include_stop_str_in_output = typed(body, "include_stop_str_in_output", bool, "a boolean", False)
    metadata = typed(body, "metadata", dict, "an object of strings", {})  # OpenAI's: into GenerateRequest.labels
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InvalidArgument("metadata", "keys and values must be strings")
    req.labels.update(metadata)
    max_duration_ms = int32(body, "max_duration_ms")  # DDTree's (TGIS's time_limit_millis): finish_reason "length"
    if max_duration_ms is not None:
        req.stopping.max_duration_ms = max_duration_ms
    min_tokens = int32(body, "min_tokens")  # vLLM's
    if min_tokens:
        req.stopping.min_new_tokens = min_tokens
    speculation(body, req)
    _structured(body, req)


def _structured(body: dict, req: pb.GenerateRequest) -> None:
    """OpenAI's `response_format` or vLLM's `structured_outputs` -> GenerateRequest.response_format."""
    fmt = typed(body, "response_format", dict, "an object", {})
    vllm = typed(body, "structured_outputs", dict, "an object", {})
    if fmt and vllm:
        raise InvalidArgument("structured_outputs", "give response_format or structured_outputs, not both")
    kind = fmt.get("type", "text") if fmt else None
    if kind == "json_object":
        req.response_format.json_object = True
    elif kind == "json_schema":
        spec = typed(fmt, "json_schema", dict, "an object", {}, parent="response_format.")
        schema = typed(spec, "schema", dict, "a JSON Schema object", parent="response_format.json_schema.")
        req.response_format.json_schema = json.dumps(schema if schema is not None else {"type": "object"})
    elif kind not in (None, "text"):
        raise InvalidArgument("response_format.type", f'must be "text", "json_object" or "json_schema", got {kind!r}')
    given = [k for k in STRUCTURED_OUTPUTS if vllm.get(k) not in (None, False)]
    if len(given) > 1 or any(k not in STRUCTURED_OUTPUTS for k in vllm):
        raise InvalidArgument("structured_outputs", f"give exactly one of {', '.join(STRUCTURED_OUTPUTS)}")
    if given:
        _structured_output(given[0], vllm[given[0]], req.response_format)


def _structured_output(key: str, value: Any, fmt: pb.ResponseFormat) -> None:
    field = f"structured_outputs.{key}"
    if key == "json":
        if not isinstance(value, (dict, str)):
            raise InvalidArgument(field, "must be a JSON Schema (an object, or its JSON text)")
        fmt.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif key == "json_object":
        fmt.json_object = typed({key: value}, key, bool, "a boolean", parent="structured_outputs.")
    elif key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidArgument(field, "must be a non-empty list of non-empty strings")
        fmt.lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)  # Lark string literals
    elif not isinstance(value, str):
        raise InvalidArgument(field, "must be a string")
    else:
        setattr(fmt, {"regex": "regex", "grammar": "lark"}[key], value)


def _logit_bias(body: dict, req: pb.GenerateRequest) -> None:
    """OpenAI's {"token id": bias} (keys are strings in JSON; ints accepted too)."""
    for key, value in typed(body, "logit_bias", dict, "an object of token id: bias", {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidArgument("logit_bias", f"key {key!r} is not a token id") from None
        if not -INT32 <= token < INT32:
            raise InvalidArgument("logit_bias", f"token id {token} is out of range")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgument(f"logit_bias[{token}]", f"must be a number, got {type(value).__name__}")
        req.sampling.logit_bias[token] = value


def speculation(body: dict, req: pb.GenerateRequest) -> None:
    mode = typed(body, "spec_mode", str, "a string")
    if mode is not None:
        if mode not in SPEC_MODES:
            raise InvalidArgument("spec_mode", f"must be one of {', '.join(SPEC_MODES)}, got {mode!r}")
        req.speculation.mode = SPEC_MODES[mode]
    budget = int32(body, "tree_budget")
    if budget is not None:
        req.speculation.tree_budget = budget


def completion_request(body: dict) -> pb.GenerateRequest:
    """POST /v1/completions: `prompt` is a string or a list of token ids (or a one-element list of either)."""
    req = pb.GenerateRequest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(-INT32 <= t < INT32 for t in prompt):
            raise InvalidArgument("prompt", "token id out of range")
        req.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidArgument("prompt", "one prompt per request (batches are not supported)")
    else:
        raise InvalidArgument("prompt", "must be a string or a non-empty list of token ids")
    logprobs = int32(body, "logprobs")  # n: the sampled token's logprob and the n most likely at its position
    req.return_logprobs = logprobs is not None
    req.top_logprobs = logprobs or 0
    echo, prompt_only = echo_flags(body)
    req.prompt_logprobs = echo and req.return_logprobs
    _sampling_and_stopping({k: v for k, v in body.items() if k != "echo"}, req)
    if prompt_only:  # the prompt's logprobs alone (lm-eval's loglikelihood): one token generated, not returned
        req.stopping.max_new_tokens = 1
    return req


def echo_flags(body: dict) -> tuple[bool, bool]:
    """Completions' (`echo`, whether only the prompt comes back: `echo` with `max_tokens` 0)."""
    echo = typed(body, "echo", bool, "a boolean", False)
    return echo, echo and body.get("max_tokens") == 0 and body.get("max_completion_tokens") is None


def text_parts(content, field: str) -> str:
    """A string, or a list of {"type": "text", "text": ...} parts joined by newlines (None: empty)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidArgument(field, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidArgument(f"{field}[{j}]", "only {\"type\": \"text\", \"text\": ...} parts")
        texts.append(part["text"])
    return "\n".join(texts)


def _content(message: dict, i: int) -> str:
    return text_parts(message.get("content"), f"messages[{i}].content")


def _tool_calls(message: dict, i: int) -> list[pb.ToolCall]:
    """messages[i]'s OpenAI `tool_calls` ([{id, type, function: {name, arguments}}])."""
    calls = []
    for j, c in enumerate(typed(message, "tool_calls", list, "a list", [], parent=f"messages[{i}].")):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidArgument(f"messages[{i}].tool_calls[{j}]", "must be an object with a function name")
        args = fn.get("arguments", "")
        calls.append(pb.ToolCall(id=str(c.get("id") or ""), name=fn["name"],
                                 arguments=args if isinstance(args, str) else json.dumps(args)))
    return calls


def _tools(body: dict, req: pb.GenerateRequest) -> None:
    """`tools` for the chat template (unless `tool_choice` is "none"); `tool_choice` "required" or
    {"type": "function", "function": {"name": ...}} makes the answer start with a call (ChatMessages.tool_choice)."""
    tools = typed(body, "tools", list, "a list of tool definitions", [])
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(t.get("function"), dict):
            raise InvalidArgument(f"tools[{j}]", "must be {\"type\": \"function\", \"function\": {...}}")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str) and choice["function"]["name"] not in TOOL_CHOICES:
        choice = choice["function"]["name"]
    elif choice is not None and choice not in TOOL_CHOICES:
        raise InvalidArgument("tool_choice", 'must be "auto", "none", "required" or {"type": "function", '
                                             '"function": {"name": ...}}')
    if tools and choice != "none":
        req.chat.tools_json = json.dumps(tools)
    req.chat.tool_choice = choice if choice not in (None, "auto") else ""


def chat_request(body: dict) -> pb.GenerateRequest:
    """POST /v1/chat/completions: `messages` through the model's chat template, in the gateway."""
    req = pb.GenerateRequest()
    messages = typed(body, "messages", list, "a list of messages")
    if not messages:
        raise InvalidArgument("messages", "must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidArgument(f"messages[{i}]", "must be an object with a string role")
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for the system turn
        message = req.chat.messages.add(role=role, content=_content(m, i))
        for name in ("tool_call_id", "name", "reasoning_content"):
            setattr(message, name, typed(m, name, str, "a string", "", parent=f"messages[{i}]."))
        message.tool_calls.extend(_tool_calls(m, i))
    _tools(body, req)
    kwargs = typed(body, "chat_template_kwargs", dict, "an object", {})
    for key, value in kwargs.items():
        if key not in CHAT_TEMPLATE_KWARGS:
            raise InvalidArgument(f"chat_template_kwargs.{key}", f"unknown (known: {', '.join(CHAT_TEMPLATE_KWARGS)})")
        value = typed(kwargs, key, bool, "a boolean", parent="chat_template_kwargs.")
        if value is not None:
            setattr(req.chat, key, value)
    req.return_logprobs = typed(body, "logprobs", bool, "a boolean", False)
    req.top_logprobs = int32(body, "top_logprobs") or 0
    _sampling_and_stopping(body, req)
    return req


def choice_count(body: dict) -> int:
    """`n`: how many independent choices, each its own generation (seeded requests: choice i uses seed + i)."""
    n = int32(body, "n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidArgument("n", f"must be in [1, {MAX_CHOICES}], got {n}")
    return n


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`)."""
    options = typed(body, "stream_options", dict, "an object", {})
    include_usage = typed(options, "include_usage", bool, "a boolean", False, parent="stream_options.")
    return typed(body, "stream", bool, "a boolean", False), include_usage


def openai_param(field: str, body: dict, chat: bool) -> str:
    """A validation error's proto field path → the OpenAI parameter the client sent."""
    max_tokens = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    renames = (("sampling.", ""), ("stopping.max_new_tokens", max_tokens), ("stopping.min_new_tokens", "min_tokens"),
               ("stopping.", ""),
               ("speculation.mode", "spec_mode"), ("speculation.", ""), ("chat.messages", "messages"),
               ("chat.tool_choice", "tool_choice"), ("chat.tools_json", "tools"),
               ("chat", "messages"), ("token_ids.ids", "prompt"), ("input", "messages" if chat else "prompt"),
               ("request_id", "x-request-id"), ("top_logprobs", "top_logprobs" if chat else "logprobs"),
               ("labels", "metadata"))
    if field.startswith("response_format") and "structured_outputs" in body:
        return "structured_outputs"
    for old, new in renames:
        if field.startswith(old):
            return new + field[len(old):]
    return field

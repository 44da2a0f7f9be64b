"""Public GenerateRequest → validated internal VerifierGenerateRequest. Every rejection names its field."""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass

from ddtree.internal.v1 import verifier_pb2 as vpb
from ddtree.v1 import generation_pb2 as pb
from gateway import structured
from gateway.reasoning import ThinkTokens
from gateway.tool_calls import ToolCallTokens, openai_tool_call
from gateway.tokenizer import KimiTokenizer
from service_kit.errors import InvalidArgument
from service_kit.sampling import check_sampling

MAX_STOP_CHARS = 256
MAX_REQUEST_ID = 256  # characters of a request id (GenerateRequest.request_id, CancelRequest.request_ids)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (the verifier checks the same)


@dataclass(frozen=True)
class Limits:
    """What the verifier accepts (from its GetInfo) plus the gateway's own knobs."""

    vocab_size: int
    max_context: int
    max_new_tokens: int
    default_max_new_tokens: int
    max_tree_budget: int
    max_stop_strings: int


@dataclass(frozen=True)
class Job:
    request: vpb.VerifierGenerateRequest
    stops: tuple[str, ...]
    include_stop: bool = False  # StoppingCriteria.include_stop_str_in_output
    labels: tuple[tuple[str, str], ...] = ()  # GenerateRequest.labels, sorted: for the request's log lines
    think: ThinkTokens | None = None  # chat input: split the thinking block off the answer
    tools: ToolCallTokens | None = None  # chat input: parse tool calls out of the answer


def prompt_ids(req: pb.GenerateRequest, tok: KimiTokenizer) -> list[int]:
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("input", "one of text, token_ids or chat is required")
    if kind == "text":
        return tok.encode(req.text)
    if kind == "token_ids":
        return list(req.token_ids.ids)
    if not req.chat.messages:
        raise InvalidArgument("chat.messages", "must not be empty")
    for i, m in enumerate(req.chat.messages):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise InvalidArgument(f"chat.messages[{i}].role", f"unknown role {m.role!r}")
    kwargs = {name: getattr(req.chat, name) for name in ("thinking", "preserve_thinking") if req.chat.HasField(name)}
    if req.chat.tools_json and req.chat.tool_choice != "none":
        kwargs["tools"] = _tools(req.chat.tools_json)
    messages = [_message(m) for m in req.chat.messages]
    try:
        return tok.encode_chat(messages, **kwargs)
    except ValueError as e:
        raise InvalidArgument("chat", str(e)) from e


def _tools(text: str) -> list:
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument("chat.tools_json", f"not valid JSON: {e}") from e
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidArgument("chat.tools_json", "must be a JSON list of tool definitions (objects)")
    return tools


def forced_tool_call(chat: pb.ChatMessages, tok: KimiTokenizer, prompt: list[int]) -> tuple[list[int], int | None]:
    """chat.tool_choice -> the ids the answer must start with ("required": a tool call's opening markers; a name:
    that function's call up to its arguments) and the id they follow (</think> when the prompt opens a thinking
    block; None: from the first token). ([], None) when the model decides."""
    choice = chat.tool_choice
    if choice in ("", "auto", "none"):
        return [], None
    tools = _tools(chat.tools_json) if chat.tools_json else []
    marks = tok.tool_call_tokens
    if not tools or marks is None:
        raise InvalidArgument("chat.tool_choice", "needs tools (chat.tools_json) and a model with tool-call tokens")
    forced = [marks.section_begin, marks.call_begin]
    if choice != "required":
        names = [t.get("function", {}).get("name") for t in tools]
        if choice not in names:
            raise InvalidArgument("chat.tool_choice", f"{choice!r} is none of the tools' names {names}")
        forced += tok.encode(f"functions.{choice}:0") + [marks.argument_begin]
    return forced, answer_after(tok, prompt)


def answer_after(tok: KimiTokenizer, prompt: list[int]) -> int | None:
    """The id the answer follows: </think> when the prompt opens a thinking block, else None (its first token)."""
    think = tok.think_tokens
    return think.end if think is not None and prompt and prompt[-1] == think.start else None


def _message(m: pb.ChatMessage) -> dict:
    """A turn as the chat template reads it: OpenAI's message shape, optional fields only when set."""
    message = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [openai_tool_call(c) for c in m.tool_calls]
    for name in ("tool_call_id", "name", "reasoning_content"):
        if getattr(m, name):
            message[name] = getattr(m, name)
    return message


MAX_LABELS, MAX_LABEL_KEY, MAX_LABEL_VALUE = 16, 64, 512


def check_labels(labels) -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument("labels", f"at most {MAX_LABELS}, got {len(labels)}")
    for key, value in sorted(labels.items()):
        if not 0 < len(key) <= MAX_LABEL_KEY:
            raise InvalidArgument("labels", f"key {key[:MAX_LABEL_KEY]!r}: must be 1..{MAX_LABEL_KEY} characters")
        if len(value) > MAX_LABEL_VALUE:
            raise InvalidArgument(f"labels[{key}]", f"at most {MAX_LABEL_VALUE} characters")


def check_stopping(st: pb.StoppingCriteria, limits: Limits) -> int:
    max_new = st.max_new_tokens if st.HasField("max_new_tokens") else limits.default_max_new_tokens
    if not 1 <= max_new <= limits.max_new_tokens:
        raise InvalidArgument("stopping.max_new_tokens", f"must be in [1, {limits.max_new_tokens}], got {max_new}")
    if not 0 <= st.min_new_tokens <= max_new:
        raise InvalidArgument("stopping.min_new_tokens", f"must be in [0, {max_new}], got {st.min_new_tokens}")
    if len(st.stop) > limits.max_stop_strings:
        raise InvalidArgument("stopping.stop", f"at most {limits.max_stop_strings} stop strings")
    for i, s in enumerate(st.stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stopping.stop[{i}]", f"must be 1..{MAX_STOP_CHARS} characters")
    for i, t in enumerate(st.stop_token_ids):
        if not 0 <= t < limits.vocab_size:
            raise InvalidArgument(f"stopping.stop_token_ids[{i}]", f"{t} is outside [0, {limits.vocab_size})")
    if st.HasField("max_duration_ms") and st.max_duration_ms < 1:
        raise InvalidArgument("stopping.max_duration_ms", f"must be >= 1, got {st.max_duration_ms}")
    return max_new


def check_speculation(sp: pb.SpeculationParams, limits: Limits) -> None:
    if sp.mode not in pb.SpecMode.values():
        raise InvalidArgument("speculation.mode", f"unknown mode {sp.mode}")
    if sp.HasField("tree_budget") and not 1 <= sp.tree_budget <= limits.max_tree_budget:
        raise InvalidArgument("speculation.tree_budget",
                              f"must be in [1, {limits.max_tree_budget}], got {sp.tree_budget}")


def to_job(req: pb.GenerateRequest, tok: KimiTokenizer, limits: Limits) -> Job:
    """Validates every field; tokenizes; builds the verifier request."""
    if len(req.request_id) > MAX_REQUEST_ID:
        raise InvalidArgument("request_id", f"longer than {MAX_REQUEST_ID} characters")
    check_sampling(req.sampling, limits.vocab_size)
    max_new = check_stopping(req.stopping, limits)
    check_labels(req.labels)
    check_speculation(req.speculation, limits)
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    if req.top_logprobs and not req.return_logprobs:
        raise InvalidArgument("top_logprobs", "needs return_logprobs")
    ids = prompt_ids(req, tok)
    chat = req.WhichOneof("input") == "chat"
    if not ids:
        raise InvalidArgument("input", "the prompt is empty")
    check_token_ids(ids, limits.vocab_size, "token_ids.ids")
    if len(ids) >= limits.max_context:
        raise InvalidArgument("input", f"prompt of {len(ids)} tokens does not fit the context limit "
                                       f"{limits.max_context} (one token must remain for generation)")
    forced, after = forced_tool_call(req.chat, tok, ids) if chat else ([], None)
    grammar = structured.grammar(req.response_format)
    if grammar:
        structured.check_combination(req, bool(forced))
    return Job(
        request=vpb.VerifierGenerateRequest(forced_ids=forced, forced_after_id=after, grammar=grammar,
            grammar_after_id=answer_after(tok, ids) if grammar else None,
            request_id=req.request_id or uuid.uuid4().hex, prompt_ids=ids, sampling=req.sampling,
            max_new_tokens=max_new, stop_token_ids=list(req.stopping.stop_token_ids),
            min_new_tokens=req.stopping.min_new_tokens, max_duration_ms=req.stopping.max_duration_ms,
            ignore_eos=req.stopping.ignore_eos, speculation=req.speculation,
            return_logprobs=req.return_logprobs, top_logprobs=req.top_logprobs, prompt_logprobs=req.prompt_logprobs),
        stops=tuple(req.stopping.stop), include_stop=req.stopping.include_stop_str_in_output,
        labels=tuple(sorted(req.labels.items())),
        think=tok.think_tokens if chat else None, tools=tok.tool_call_tokens if chat else None)


def choice_jobs(job: Job, n: int) -> list[Job]:
    """n independent generations of one request (OpenAI's `n`): request ids `<id>-<i>`, and a seeded request's
    choice i seeded with seed + i, so that the choices differ and each is reproducible."""
    if n == 1:
        return [job]
    jobs = []
    for i in range(n):
        request = vpb.VerifierGenerateRequest()
        request.CopyFrom(job.request)
        request.request_id = f"{job.request.request_id}-{i}"
        if request.sampling.HasField("seed"):
            request.sampling.seed = (request.sampling.seed + i) % 2**64
        jobs.append(dataclasses.replace(job, request=request))
    return jobs


def check_token_ids(ids, vocab_size: int, field: str) -> None:
    """INVALID_ARGUMENT naming `field[i]` for the first id outside [0, vocab_size)."""
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"{field}[{bad}]", f"{ids[bad]} is outside [0, {vocab_size})")


MAX_CANCEL_IDS = 1024


def check_cancel(req: pb.CancelRequest) -> list[str]:
    """A public CancelRequest's ids; INVALID_ARGUMENT naming `request_ids` (or the empty one)."""
    ids = list(req.request_ids)
    if not 1 <= len(ids) <= MAX_CANCEL_IDS:
        raise InvalidArgument("request_ids", f"1 to {MAX_CANCEL_IDS} ids, got {len(ids)}")
    bad = next((i for i, rid in enumerate(ids) if not 0 < len(rid) <= MAX_REQUEST_ID), None)
    if bad is not None:
        raise InvalidArgument(f"request_ids[{bad}]", f"must be 1 to {MAX_REQUEST_ID} characters")
    return ids

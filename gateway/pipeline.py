"""The gateway's work for one request: admission, the verifier stream, detokenization, stop strings.

The verifier speaks token ids; everything textual happens here. A stop string ends the stream
here (the verifier call is cancelled, which cancels its session within one step).
"""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.internal.v1 import verifier_pb2 as vpb
from ddtree.internal.v1 import verifier_pb2_grpc as vpb_grpc
from ddtree.v1 import generation_pb2 as pb
from gateway import metrics
from gateway.config import GatewayConfig
from gateway.detokenizer import IncrementalDetokenizer
from gateway.reasoning import ReasoningSplitter
from gateway.tool_calls import ToolCallParser
from gateway.stops import StopMatcher
from gateway.tokenizer import KimiTokenizer
from gateway.validation import Job, Limits
from service_kit import trace_context
from service_kit.errors import ResourceExhausted, ServiceError, Unavailable
from service_kit.logs import get_logger
from service_kit.server import channel_options

VERIFIER_SERVICE = "ddtree.internal.v1.Verifier"
log = get_logger("gateway")


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: KimiTokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.channel = grpc.aio.insecure_channel(config.verifier,
                                                 options=channel_options(config.internal_max_message_mb))
        self.verifier = vpb_grpc.VerifierStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.info: vpb.VerifierInfo | None = None
        self.limits: Limits | None = None
        self.running = 0

    async def connect(self, timeout_s: float | None = None) -> None:
        """Waits until the verifier reports SERVING, then caches its limits."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not await self.verifier_serving():
            if deadline is not None and time.monotonic() > deadline:
                raise Unavailable(f"verifier {self.config.verifier} not serving after {timeout_s}s")
            await asyncio.sleep(0.5)
        self.info = await self.verifier.GetInfo(vpb.GetVerifierInfoRequest(), timeout=10)
        self.limits = Limits(
            vocab_size=self.info.vocab_size, max_context=self.info.max_context_length,
            max_new_tokens=self.info.max_new_tokens_limit,
            default_max_new_tokens=min(self.config.default_max_new_tokens, self.info.max_new_tokens_limit),
            max_tree_budget=self.info.max_tree_budget, max_stop_strings=self.config.max_stop_strings)

    def require_limits(self) -> Limits:
        if self.limits is None:
            raise Unavailable("gateway is not connected to a verifier yet")
        return self.limits

    async def verifier_info(self, timeout_s: float = 2.0) -> vpb.VerifierInfo:
        """The verifier's info now (its load); UNAVAILABLE when it does not answer."""
        try:
            return await self.verifier.GetInfo(vpb.GetVerifierInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _downstream_error(e) from e

    async def refresh_info(self) -> None:
        """Re-reads the verifier's info (drafter replicas come and go); keeps the last one if it is down."""
        try:
            self.info = await self.verifier.GetInfo(vpb.GetVerifierInfoRequest(), timeout=2)
        except grpc.RpcError:
            pass

    async def verifier_serving(self) -> bool:
        try:
            r = await self.health.Check(health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE), timeout=2)
            return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def admit(self) -> None:
        if self.running >= self.config.max_concurrent_requests:
            metrics.REJECTED.labels("queue_full").inc()
            raise ResourceExhausted(f"{self.running} requests in flight (limit "
                                    f"{self.config.max_concurrent_requests}); retry later")

    async def generate(self, job: Job, timeout_s: float):
        """Yields public GenerateResponse messages for one admitted job."""
        self.admit()
        self.running += 1
        metrics.RUNNING.inc()
        t0 = time.monotonic()
        call = self.verifier.Generate(job.request, timeout=timeout_s, metadata=trace_context.outgoing())
        reason, first, final = "error", None, None
        try:
            async for resp in self._relay(job, call, t0):
                if resp.HasField("final"):
                    reason, final = pb.FinishReason.Name(resp.final.finish_reason), resp.final
                elif first is None and resp.chunk.token_ids:
                    first = time.monotonic()
                yield resp
        except grpc.aio.AioRpcError as e:
            reason = e.code().name
            raise _downstream_error(e) from e
        except asyncio.CancelledError:
            reason = "CANCELLED"
            raise
        finally:
            call.cancel()
            self.running -= 1
            metrics.RUNNING.dec()
            metrics.REQUESTS.labels(reason).inc()
            metrics.E2E.observe(time.monotonic() - t0)
            _record_finished(job, reason, final, t0, first)

    async def generate_result(self, job: Job, timeout_s: float) -> pb.GenerateResult:
        """GenerateUnary: the messages of `generate`, the chunks' fields concatenated in order."""
        result, text, reasoning = pb.GenerateResult(), [], []
        async for resp in self.generate(job, timeout_s):
            if resp.HasField("final"):
                result.final.CopyFrom(resp.final)
                continue
            c = resp.chunk
            text.append(c.text)
            reasoning.append(c.reasoning_text)
            for name in ("token_ids", "tool_calls", "logprobs", "top_logprobs", "prompt_logprobs",
                         "prompt_top_logprobs"):
                getattr(result, name).extend(getattr(c, name))
        result.text, result.reasoning_text = "".join(text), "".join(reasoning)
        return result

    async def cancel(self, request_ids: list[str], timeout_s: float = 5.0) -> list[str]:
        """The public Cancel: each id's verifier session, in order; returns the ids that were generating."""
        found = []
        for rid in request_ids:
            r = await self.verifier.Cancel(vpb.CancelRequest(request_id=rid), timeout=timeout_s,
                                           metadata=trace_context.outgoing())
            if r.found:
                found.append(rid)
        return found

    async def _relay(self, job: Job, call, t0: float):
        out = OutputText(self.tokenizer, job)
        last = first = None
        async for msg in call:
            if msg.HasField("final"):
                reasoning, tail = out.flush()
                if tail or reasoning:
                    yield pb.GenerateResponse(chunk=pb.Chunk(text=tail, reasoning_text=reasoning))
                final = _final(msg.final, len(job.request.prompt_ids), out.reasoning_tokens)
                yield pb.GenerateResponse(final=_timed(final, msg.final.timing, t0, first))
                return
            c = msg.chunk
            now = time.monotonic()
            _observe_latency(last, t0, now, len(c.token_ids))
            last = now
            if first is None and c.token_ids:
                first = now
            metrics.GENERATION_TOKENS.inc(len(c.token_ids))
            reasoning, text, calls, matched = out.feed(c.token_ids)
            if matched is not None and job.include_stop:
                text += matched
            yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=c.token_ids, text=text, logprobs=c.logprobs,
                                                     num_verify_steps=c.num_verify_steps, reasoning_text=reasoning,
                                                     tool_calls=calls, top_logprobs=c.top_logprobs,
                                                     prompt_logprobs=c.prompt_logprobs,
                                                     prompt_top_logprobs=c.prompt_top_logprobs))
            if matched is not None:
                closing = await self._stop_generation(job, call)
                final = pb.Final(finish_reason=pb.FINISH_REASON_STOP, matched_stop=matched,
                                 spec_stats=closing.spec_stats if closing else None,
                                 usage=pb.Usage(prompt_tokens=len(job.request.prompt_ids),
                                                completion_tokens=out.num_tokens, reasoning_tokens=out.reasoning_tokens))
                yield pb.GenerateResponse(final=_timed(final, closing.timing if closing else None, t0, first))
                return
        raise Unavailable("verifier stream ended without a final message")

    async def _stop_generation(self, job: Job, call, timeout_s: float = 2.0) -> vpb.VerifierFinal | None:
        """A stop string matched: cancel the session (within one step) and take the verifier's closing message (its
        speculative stats and timing); without it in time, just drop the stream."""
        try:
            await self.verifier.Cancel(vpb.CancelRequest(request_id=job.request.request_id), timeout=timeout_s,
                                       metadata=trace_context.outgoing())
            async with asyncio.timeout(timeout_s):
                async for msg in call:
                    if msg.HasField("final"):
                        return msg.final
        except (grpc.aio.AioRpcError, TimeoutError):
            pass
        finally:
            call.cancel()
        return None


class OutputText:
    """One request's output ids → (reasoning text, answer text, tool calls): for chat input the thinking block
    and the tool calls parsed out by id, a detokenizer for each text, stop strings on the answer."""

    def __init__(self, tokenizer: KimiTokenizer, job: Job):
        self.thought, self.answer = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer)
        self.splitter = ReasoningSplitter(job.think, job.request.prompt_ids) if job.think else None
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        self.calls = ToolCallParser(job.tools, decode) if job.tools else None
        self.stops = StopMatcher(list(job.stops))
        self.num_tokens = 0

    @property
    def reasoning_tokens(self) -> int:
        return self.splitter.reasoning_tokens if self.splitter else 0

    def feed(self, ids) -> tuple[str, str, list[pb.ToolCall], str | None]:
        """(new reasoning text, new answer text, tool calls completed, the stop string matched or None)."""
        self.num_tokens += len(ids)
        thought, answer = self.splitter.split(ids) if self.splitter else ([], ids)
        answer, calls = self.calls.feed(answer) if self.calls else (answer, [])
        text, matched = self.stops.feed(self.answer.feed(answer))
        return self.thought.feed(thought), text, calls, matched

    def flush(self) -> tuple[str, str]:
        """End of stream: what the detokenizers and the stop matcher still hold."""
        tail, _ = self.stops.feed(self.answer.flush())
        return self.thought.flush(), tail + self.stops.flush()


def _observe_latency(last: float | None, t0: float, now: float, n: int) -> None:
    if n == 0:
        return
    if last is None:
        metrics.TTFT.observe(now - t0)
        return
    for _ in range(n):
        metrics.ITL.observe((now - last) / n)


def _final(f: vpb.VerifierFinal, prompt_tokens: int, reasoning_tokens: int) -> pb.Final:
    metrics.PROMPT_TOKENS.inc(prompt_tokens)
    if f.spec_stats.verify_steps:
        metrics.ACCEPTANCE.observe(f.spec_stats.mean_acceptance_length)
    final = pb.Final(finish_reason=f.finish_reason, spec_stats=f.spec_stats,
                     usage=pb.Usage(prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens,
                                    reasoning_tokens=reasoning_tokens, cached_prompt_tokens=f.cached_prompt_tokens))
    if f.HasField("matched_stop_token_id"):
        final.matched_stop_token_id = f.matched_stop_token_id
    return final


def _timed(final: pb.Final, verifier: pb.Timing | None, t0: float, first: float | None) -> pb.Final:
    """`final` with its Timing: the verifier's phases and the gateway's time to first token and end to end."""
    if verifier is not None:
        final.timing.CopyFrom(verifier)
    final.timing.e2e_s = time.monotonic() - t0
    if first is not None:
        final.timing.ttft_s = first - t0
    return final


def _downstream_error(e: grpc.aio.AioRpcError) -> ServiceError:
    """Pass the verifier's status through; transport failures become UNAVAILABLE."""
    code = e.code() if e.code() != grpc.StatusCode.UNKNOWN else grpc.StatusCode.UNAVAILABLE
    return ServiceError(f"verifier: {e.details()}", code)


def _record_finished(job: Job, outcome: str, final: pb.Final | None, t0: float, first: float | None) -> None:
    """The request's one summary line (its trace_id and span_id come from the log context): outcome is the finish
    reason, or the status code that ended it (CANCELLED, DEADLINE_EXCEEDED, ...). Seconds; no prompt or output text.
    Also its per-request histograms."""
    now = time.monotonic()
    if final is not None:
        n = final.usage.completion_tokens
        metrics.REQUEST_PROMPT_TOKENS.observe(final.usage.prompt_tokens)
        metrics.REQUEST_GENERATION_TOKENS.observe(n)
        if n >= 2 and first is not None:
            metrics.TPOT.observe((now - first) / (n - 1))
    fields = dict(request_id=job.request.request_id, outcome=outcome, prompt_tokens=len(job.request.prompt_ids),
                  ttft_s=None if first is None else round(first - t0, 4), e2e_s=round(now - t0, 4))
    if job.labels:
        fields["labels"] = dict(job.labels)
    if final is not None:
        s = final.spec_stats
        fields.update(completion_tokens=final.usage.completion_tokens, mode=pb.SpecMode.Name(s.mode),
                      tree_budget=s.tree_budget, verify_steps=s.verify_steps,
                      mean_acceptance_length=round(s.mean_acceptance_length, 3))
    log.info("request_finished", **fields)

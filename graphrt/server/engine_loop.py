"""EngineLoop: one thread that owns the engine and steps it continuously, and the asyncio side
that HTTP handlers talk to.

The engine is not thread-safe, so everything that touches it (tokenizing and validating a
submission, adding and aborting requests, stepping, reading outputs) runs on the engine thread.
Handlers post commands to it and await the answer; after every step the thread hands each
request's new tokens and text to that request's asyncio queue. Requests from any number of
clients therefore join the one running batch (continuous batching across clients).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphrt.sampling_params import InvalidRequestError, SamplingParams
from graphrt.server.metrics import ServerMetrics

log = logging.getLogger("graphrt.server")


class QueueFullError(RuntimeError):
    """More requests wait than the server admits (HTTP 429)."""


class EngineStoppedError(RuntimeError):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass(frozen=True)
class Delta:
    """What one step added to one request."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None  # the engine's: stop, length, grammar, abort, error
    prompt_logprobs: list | None = None  # on a request's first delta, when it asked for them
    top_logprobs: tuple = ()  # per token, {token: logprob} of it and the likeliest (logprobs=k)


@dataclass
class RequestStream:
    """One engine request of a submission."""

    index: int  # its place in the submission (the OpenAI choice index)
    request_id: str
    prompt_token_ids: list[int]


@dataclass
class Submission:
    """The requests of one HTTP request (prompts x n choices); their deltas arrive, tagged with
    the request's index, on one queue in the order the engine produced them."""

    streams: list[RequestStream]
    queue: asyncio.Queue

    async def events(self):
        """(index, Delta) pairs until every request has finished."""
        left = len(self.streams)
        while left:
            index, delta = await self.queue.get()
            yield index, delta
            if delta.finish_reason is not None:
                left -= 1


@dataclass
class _Active:
    stream: RequestStream
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    sent_tokens: int = 0
    last_token_time: float | None = None


@dataclass
class _Pending:
    """Requests counted in EngineLoop._pending until the engine thread has taken them."""

    count: int
    released: bool = False


class EngineLoop:
    def __init__(self, engine, max_queued: int = 128, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.max_queued = max_queued
        self.metrics = metrics
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._active: dict[str, _Active] = {}
        self._pending = 0  # submitted, not yet added to the engine (guarded by _lock)
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="graphrt-engine", daemon=True)
        self.stats: dict[str, Any] = {}  # the engine's counters after the last step (idle: every half second)
        self._snapshot()

    # --- the asyncio side ----------------------------------------------------------------------

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def num_waiting(self) -> int:
        return self._pending + self.stats.get("requests_waiting", 0)

    async def submit(
        self, prompts: list[Any], params: list[dict[str, Any]], chat: bool = False, lora=None
    ) -> Submission:
        """Tokenize, validate and queue one request per (prompt, params) pair, all or none (with
        the LoRA adapter ``lora`` selects, if any).
        ``params[i]["max_tokens"]`` None means "up to max_model_len". Raises
        InvalidRequestError, QueueFullError or EngineStoppedError."""
        with self._lock:
            if self._stopping:
                raise EngineStoppedError("the server is shutting down")
            if self.num_waiting + len(prompts) > self.max_queued:
                raise QueueFullError(
                    f"{self.num_waiting} requests are waiting and the server queues at most {self.max_queued}"
                )
            self._pending += len(prompts)
        loop = asyncio.get_running_loop()
        arrival = time.perf_counter()
        ticket = _Pending(len(prompts))

        def add() -> Submission:
            try:
                return self._add(prompts, params, chat, loop, arrival, lora)
            finally:
                self._hand_over(ticket)

        try:
            return await self._call(add)
        finally:  # never reached the engine thread, or the handler was cancelled first
            with self._lock:
                self._release(ticket)

    def abort(self, submission: Submission) -> None:
        """Abort a submission's requests (its client went away): their blocks are freed before
        the next step."""
        ids = [s.request_id for s in submission.streams]
        self._post(lambda: [self.engine.abort(rid) for rid in ids if rid in self._active])

    async def stop(self, timeout: float = 5.0) -> None:
        """Abort what still runs and end the thread."""
        with self._lock:
            self._stopping = True
        self._post(self._abort_all)
        self._post(lambda: None)  # wake the thread
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # handed to the awaiting handler
                loop.call_soon_threadsafe(self._settle, future, None, e)
            else:
                loop.call_soon_threadsafe(self._settle, future, result, None)

        self._post(run)
        return await future

    def _post(self, fn: Callable[[], None]) -> None:
        if not self._thread.is_alive() and self._thread.ident is not None:
            raise EngineStoppedError("the engine thread has stopped")
        self._commands.put(fn)

    # --- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished()
            if idle and self._stopping and self._commands.empty():
                return
            self._run_commands(wait=idle)
            if self.engine.has_unfinished():
                self._step()

    def _run_commands(self, wait: bool) -> None:
        """Run the posted commands (waiting up to half a second for one when ``wait``)."""
        try:
            fn = self._commands.get(timeout=0.5) if wait else self._commands.get_nowait()
        except queue.Empty:
            if wait:  # idle: what moves without steps (the KV pages faulted in) stays current
                self._snapshot()
            return
        while fn is not None:
            try:
                fn()
            except Exception as e:  # a command's own failure never stops the loop
                log.error("engine command failed: %s", e)
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                fn = None
        self._publish()  # aborted requests end their streams now
        self._snapshot()

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as e:  # an engine fault: the step's requests fail, the rest go on
            log.error("engine step failed: %s", e)
            if self.metrics is not None:
                self.metrics.step_errors.inc()
            self._fail_unfinished_if_broken(e)
        self._publish()
        self._snapshot()

    def _add(self, prompts, params, chat, loop, arrival, lora=None) -> Submission:
        engine = self.engine
        prepared = []
        for i, (prompt, values) in enumerate(zip(prompts, params)):
            try:
                ids = engine.tokenize(prompt, chat)
                values = dict(values)
                if values.get("max_tokens") is None:
                    values["max_tokens"] = max(1, engine.max_model_len - len(ids))
                sp = SamplingParams.from_dict(values)
                engine.validate_params(sp)
            except InvalidRequestError as e:
                prefix = f"prompt {i}: " if len(prompts) > 1 and not chat else ""
                raise InvalidRequestError(f"{prefix}{e}") from None
            prepared.append((ids, sp))
        submission = Submission([], asyncio.Queue())
        for index, (ids, sp) in enumerate(prepared):
            stream = RequestStream(index, engine.add_request(ids, sp, lora_request=lora), ids)
            self._active[stream.request_id] = _Active(stream, submission.queue, loop, arrival)
            submission.streams.append(stream)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(ids))
        return submission

    def _hand_over(self, ticket: _Pending) -> None:
        """Move a submission's requests from pending to the scheduler's waiting count in one
        step, so that the queue limit never counts them twice (or not at all)."""
        with self._lock:
            self._release(ticket)
            self.stats = {**self.stats, "requests_waiting": len(self.engine.scheduler.waiting)}

    def _release(self, ticket: _Pending) -> None:  # under self._lock
        if not ticket.released:
            self._pending -= ticket.count
            ticket.released = True

    def _publish(self) -> None:
        """Hand each active request what it gained since it was last published: one wake-up of
        each event loop per step, however many requests it serves."""
        engine = self.engine
        now = time.perf_counter()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for rid in list(self._active):
            active = self._active[rid]
            out = engine.output(rid)
            new = len(out.token_ids) - active.sent_tokens
            text = engine.detokenizer(rid).stream_delta(out.finished)
            if not (new or text or out.finished):
                continue
            logprobs = tuple(out.logprobs[active.sent_tokens :]) if out.logprobs else ()
            first = active.sent_tokens == 0  # the request's first published tokens
            delta = Delta(
                text,
                tuple(out.token_ids[active.sent_tokens :]),
                logprobs,
                out.finish_reason,
                out.prompt_logprobs if first else None,
                tuple(out.top_logprobs[active.sent_tokens :]) if out.top_logprobs else (),
            )
            active.sent_tokens = len(out.token_ids)
            if self.metrics is not None and new:
                self.metrics.observe_tokens(active.arrival, active.last_token_time, now, new)
            if new:
                active.last_token_time = now
            batches.setdefault(active.loop, []).append((active.queue, (active.stream.index, delta)))
            if out.finished:
                if self.metrics is not None:
                    self.metrics.finished(out.finish_reason)
                engine.release(rid)
                del self._active[rid]
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _fail_unfinished_if_broken(self, error: Exception) -> None:
        """EngineStepError already ended the step's requests; any other exception leaves the
        engine's state unknown, so every request in it is ended with 'error'."""
        from graphrt.engine import EngineStepError

        if isinstance(error, EngineStepError):
            return
        for rid in list(self._active):
            output = self.engine.output(rid)
            if not output.finished:
                self.engine.abort(rid)
                output.finish_reason = "error"

    def _abort_all(self) -> None:
        for rid in list(self._active):
            self.engine.abort(rid)

    def _snapshot(self) -> None:
        scheduler = self.engine.scheduler
        self.stats = {
            **self.engine.stats(),
            "requests_running": len(scheduler.running),
            "requests_waiting": len(scheduler.waiting),
        }

    def _settle(self, future: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if future.done():  # the handler was cancelled (its client left) before the answer came
            if isinstance(result, Submission):
                self.abort(result)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _deliver(items: list) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)

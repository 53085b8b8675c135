"""AsyncEngine: the step loop in a background thread, requests streamed to asyncio callers.

The engine thread owns EngineCore (torch and the scheduler are not thread-safe); callers talk
to it through a command queue, and each step's EngineCoreOutputs come back to each request's
asyncio.Queue through `loop.call_soon_threadsafe`. The engine thread handles token ids only:
`generate_tokens` streams them as they are (what a Serve replica sends its router), and
`generate` detokenizes them in the caller's thread, with the same OutputProcessor as `LLM`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, InvalidStateError
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.core.admission import QueueFull
from engine.core.kv_events import KVEventBatch, KVSnapshot
from engine.engine_core import EngineCore
from engine.inputs import InputProcessor, PromptInput, encode_prompt
from engine.models.catalog import TINY_MODEL
from engine.output_processor import OutputProcessor
from engine.outputs import EngineCoreOutput, RequestOutput, merge_outputs
from engine.request import RequestStatus, SamplingParams, finish_reason_of
from engine.stats import EngineStats

logger = logging.getLogger(__name__)
T = TypeVar("T")


_MAX_KV_BATCHES = 4096


class EngineDeadError(RuntimeError):
    """The engine loop failed; the request cannot finish."""


@dataclass
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    request_kwargs: dict[str, Any]
    sink: _Sink


@dataclass
class _End:
    """End a request with `status`. With a sink, only if the request is still that caller's
    (a caller whose add was refused as a duplicate must not end the original)."""

    request_id: str
    status: RequestStatus
    sink: _Sink | None = None


@dataclass
class _OnLoop:
    """Run `fn` in the loop thread, between steps (it owns the engine), into `result`."""

    fn: Callable[[], Any]
    result: Future[Any]


@dataclass
class _Call:
    """One caller's request: its id and where its outputs go."""

    request_id: str
    sink: _Sink


@dataclass
class _Sink:
    """Where one request's outputs go: an asyncio.Queue living in the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineCoreOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: EngineCoreOutput | BaseException) -> bool:
        """False when the caller's event loop is gone: nobody is listening any more."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True


def _snapshot(result: RequestOutput) -> RequestOutput:
    """A copy the caller may keep: the output processor updates one CompletionOutput per
    request in place, output after output."""
    completion = result.outputs[0]
    copy = dataclasses.replace(
        completion,
        token_ids=list(completion.token_ids),
        new_token_ids=list(completion.new_token_ids),
        logprobs=list(completion.logprobs) if completion.logprobs is not None else None,
    )
    return dataclasses.replace(result, outputs=[copy])


class AsyncEngine:
    def __init__(self, model: str = TINY_MODEL, **engine_args: Any) -> None:
        self.inputs = InputProcessor.from_args(model, **engine_args)
        self.tokenizer = self.inputs.tokenizer
        self.core = EngineCore.from_inputs(self.inputs)
        self._sinks: dict[str, _Sink] = {}
        self._commands: queue.Queue[_Add | _End | _OnLoop | None] = queue.Queue()
        # Numbered prefix-cache event batches, taken after each step (kv_events_config).
        self._kv_batches: queue.SimpleQueue[KVEventBatch] = queue.SimpleQueue()
        # As of the last step, shipped with its outputs; replaced whole, read from any thread.
        self._stats = self.core.stats
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        # Called on the engine thread once the loop has failed and told every caller.
        self.on_death: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        if self.core.connector is not None:
            # Other engines may borrow cached prefix blocks (side channel LendPrefix).
            self.core.connector.enable_prefix_lending(self.core.pin_prefix, self.run_on_loop)

    # ------------------------------------------------------------------ caller side

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        coalesce: bool = False,
        **request_kwargs: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield a RequestOutput (with text) per engine output; the last has finished=True.

        Stop strings are matched here, on the text, and end the request at the token that
        completed one (FINISHED_STOPPED in the engine, as offline). Otherwise as
        `generate_tokens`.
        """
        params = sampling_params or SamplingParams()
        text, token_ids = self.inputs.encode(prompt)
        request_id = request_id or self._new_request_id()
        processor = OutputProcessor(self.tokenizer)
        processor.add_request(request_id, text, token_ids, params)
        # The engine matches tokens only: it gets the request without its stop strings.
        call = self._start(
            request_id, token_ids, dataclasses.replace(params, stop=()), request_kwargs
        )
        async with aclosing(self._outputs(call, coalesce)) as outputs:
            async for output in outputs:
                results, stopped = processor.process([output])
                if stopped:
                    self._commands.put(_End(request_id, RequestStatus.FINISHED_STOPPED, call.sink))
                for result in results:
                    yield _snapshot(result)
                if stopped or any(result.finished for result in results):
                    return

    async def generate_tokens(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        coalesce: bool = False,
        **request_kwargs: Any,
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """Yield an EngineCoreOutput (token ids, no text) per step that produced tokens; the
        last has a finish_reason.

        With `coalesce`, the outputs of steps that ran while the caller was busy come as one
        (their new tokens together): a caller that forwards each output over a network pays
        its per-message cost once per batch when it falls behind, and catches up.

        Bad input raises ValueError before anything is queued (stop strings too: they need
        text, see `generate`). A caller that stops iterating (a client gone) aborts the
        request, so its KV blocks come back.
        """
        params = sampling_params or SamplingParams()
        if params.stop:
            raise ValueError("stop strings need text: use generate(), not generate_tokens()")
        _, token_ids = encode_prompt(None, prompt_token_ids, self.inputs.max_model_len)
        call = self._start(request_id or self._new_request_id(), token_ids, params, request_kwargs)
        async with aclosing(self._outputs(call, coalesce)) as outputs:
            async for output in outputs:
                yield output

    def _start(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        request_kwargs: dict[str, Any],
    ) -> _Call:
        """Queue a validated request for the engine thread."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop has stopped: {self._dead}")
        call = _Call(request_id, _Sink(asyncio.get_running_loop()))
        self._commands.put(_Add(request_id, token_ids, params, request_kwargs, call.sink))
        if self._dead is not None:  # died meanwhile: the loop may never read that command
            raise EngineDeadError(f"engine loop has stopped: {self._dead}")
        return call

    async def _outputs(self, call: _Call, coalesce: bool) -> AsyncGenerator[EngineCoreOutput, None]:
        """The call's outputs until the one that finishes it; a caller that leaves before
        aborts the request (if it is still this call's)."""
        queue_ = call.sink.queue
        held: EngineCoreOutput | BaseException | None = None
        finished = False
        try:
            while not finished:
                item = held if held is not None else await queue_.get()
                held = None
                if isinstance(item, BaseException):
                    raise item
                while coalesce and not item.finished and not queue_.empty():
                    later = queue_.get_nowait()
                    if isinstance(later, BaseException):
                        held = later  # after what came before it
                        break
                    item = merge_outputs(item, later)
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(_End(call.request_id, RequestStatus.FINISHED_ABORTED, call.sink))

    def _new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def abort(self, request_id: str) -> None:
        """End a request, whoever is streaming it (a finished one whose blocks wait for a
        remote reader: its lease ends)."""
        self._commands.put(_End(request_id, RequestStatus.FINISHED_ABORTED))

    def take_kv_event_batches(self) -> list[KVEventBatch]:
        """The prefix cache's event batches since the last call, in order (any thread)."""
        batches = []
        while True:
            try:
                batches.append(self._kv_batches.get_nowait())
            except queue.Empty:
                return batches

    def kv_snapshot(self) -> Future[KVSnapshot]:
        """A snapshot of the prefix cache, taken between steps (any thread). Batches taken
        before it are covered by it."""
        if self.core.kv_events is None:
            raise ValueError("this engine publishes no KV events (kv_events_config)")
        return self.run_on_loop(self.core.kv_events.snapshot)

    def step_trace(self, keep_steps: int = 0) -> Future[list[dict[str, Any]]]:
        """The scheduler's per-step records kept so far, oldest first (engine/core/
        step_trace.py), read between steps (any thread). `keep_steps` > 0 first starts
        keeping that many from now on, -1 stops tracing; ValueError while tracing is off."""
        scheduler = self.core.scheduler

        def records() -> list[dict[str, Any]]:
            if keep_steps:
                scheduler.trace_steps(max(0, keep_steps))
            if scheduler.step_trace is None:
                if keep_steps < 0:
                    return []
                raise ValueError("this engine keeps no step trace (step_trace_size is 0)")
            return scheduler.step_trace.records()

        return self.run_on_loop(records)

    def run_on_loop(self, fn: Callable[[], T]) -> Future[T]:
        """Call `fn` in the engine's loop thread between steps, from any thread (the engine
        is not thread-safe); the loop wakes for it even when idle."""
        command = _OnLoop(fn, Future())
        if self._dead is None:
            self._commands.put(command)
        if self._dead is not None:  # the loop is gone (or went while we queued): nobody runs it
            _fail(command, EngineDeadError("the engine loop has stopped"))
        return command.result

    @property
    def stats(self) -> EngineStats:
        """The engine's statistics as of its last step (engine/stats.py); any thread."""
        return self._stats

    @property
    def dead(self) -> BaseException | None:
        """Why the engine loop stopped, if it has failed."""
        return self._dead

    def shutdown(self) -> None:
        """Stop the loop (every waiting caller hears it), then release the engine's resources
        (side channel, transport)."""
        self._commands.put(None)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():  # a step still running owns the engine: leave it be
            self.core.close()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                block = not self.core.has_requests()
                # Idle with pins held: wake when the next one expires, to release it.
                wake = self.core.seconds_to_pin_expiry() if block else None
                if not self._drain_commands(block, wake):
                    self._dead = EngineDeadError("the engine was shut down")
                    self._fail_everyone(self._dead)
                    return
                if self.core.has_requests():
                    self._step()
                elif wake is not None:
                    self.core.expire_pins()
                    self._refresh_stats()  # what Health and the metrics read
        except BaseException as exc:
            logger.exception("engine loop failed")
            self._dead = exc
            self._fail_everyone(EngineDeadError(f"engine loop failed: {exc}"))
            if self.on_death is not None:
                self.on_death(exc)

    def _refresh_stats(self) -> None:
        self._stats = self.core.refresh_stats()

    def _fail_everyone(self, error: EngineDeadError) -> None:
        """Every caller still waiting gets `error`: those streaming, and those whose request
        is still queued as a command (nobody will ever read that queue again)."""
        for sink in self._sinks.values():
            sink.put(error)
        self._sinks.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.sink.put(error)
            elif isinstance(command, _OnLoop):
                _fail(command, error)

    def _drain_commands(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued commands; with `block`, wait for the first (at most `timeout`
        seconds, if given). False means shut down."""
        try:
            command = self._commands.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            if isinstance(command, _End):
                self._end(command)
            elif isinstance(command, _OnLoop):
                # Its caller, once answered, may read the stats: they include what it did.
                _run_into(command, self._refresh_stats)
            else:
                self._add(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, add: _Add) -> None:
        try:
            if add.request_id in self._sinks:
                raise ValueError(f"duplicate request id {add.request_id!r}")
            request = self.inputs.make_request(
                add.request_id, add.token_ids, add.params, **add.request_kwargs
            )
            self.core.add_request(request)
        except (ValueError, QueueFull) as exc:  # the caller's to handle: bad input, full
            add.sink.put(exc)
            return
        finally:
            # Requests refused to make room (even if this one then failed validation).
            for displaced in self.core.take_displaced():
                sink = self._sinks.pop(displaced, None)
                if sink is not None:
                    sink.put(QueueFull("refused for a request of higher priority; retry later"))
        self._sinks[add.request_id] = add.sink

    def _end(self, end: _End) -> None:
        sink = self._sinks.get(end.request_id)
        if end.sink is not None and sink is not end.sink:
            return  # finished already, or another caller's request under the same id
        self.core.abort_requests([end.request_id], end.status)
        if sink is not None:  # a caller still listening hears how its request ended
            del self._sinks[end.request_id]
            sink.put(EngineCoreOutput(end.request_id, [], finish_reason_of(end.status)))

    def _take_kv_events(self) -> None:
        stream = self.core.kv_events
        batch = stream.take_batch() if stream is not None else None
        if batch is None:
            return
        if self._kv_batches.qsize() >= _MAX_KV_BATCHES:
            # Nobody is taking them: drop what waits (a reader sees the gap, asks for a
            # snapshot) rather than grow without bound.
            self.take_kv_event_batches()
        self._kv_batches.put(batch)

    def _step(self) -> None:
        step = self.core.step()
        self._stats = step.stats
        self._take_kv_events()
        for output in step.outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if not sink.put(output):  # one caller gone; the engine serves on
                self._end(_End(output.request_id, RequestStatus.FINISHED_ABORTED, sink))
            elif output.finished:
                del self._sinks[output.request_id]


def _run_into(command: _OnLoop, then: Callable[[], None]) -> None:
    """A failing call fails its caller, not the loop; a call its caller cancelled (it gave
    up waiting) does not run. `then` runs before the caller hears the result."""
    if not command.result.set_running_or_notify_cancel():
        return
    try:
        result = command.fn()
    except Exception as exc:
        then()
        command.result.set_exception(exc)
        return
    then()
    command.result.set_result(result)


def _fail(command: _OnLoop, error: Exception) -> None:
    """Fail a call nobody will run (the dying loop and its caller may both try: once is it)."""
    with contextlib.suppress(RuntimeError, InvalidStateError):
        if command.result.set_running_or_notify_cancel():
            command.result.set_exception(error)

"""Async front of the engine for the serving replica: one step thread and per-request streams.

The model step runs in one dedicated, long-lived thread, and that thread also builds the
engine (loads the weights): every parallel torch op of the replica then runs from one thread, so
there is one OpenMP thread team. A second team (the event loop's, left over from loading the
model there) makes libgomp count more threads than cores and stop spinning between parallel
regions; each of the thousands of regions per step then waits on a futex wake. Each step's
outputs reach the event loop as one `StepOutputs` in one loop callback: a `StepSink` (the
serving replica) takes the whole batch at once; `stream`/`generate` consumers get theirs through
per-request queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any, Protocol

import torch

from molora_runtime.config import EngineConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.engine.route_stats.gate_telemetry import LayerTelemetry
from molora_runtime.engine.types import (
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    RequestAdapters,
    StepOutputs,
)
from molora_runtime.errors import EngineStoppedError, InvalidRequestError
from molora_runtime.lora.source import AdapterSource

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # the step thread re-checks for work (and shutdown) at least this often
# Consecutive failed steps (each already failing every in-flight request) before the engine is
# declared broken and the replica unhealthy.
MAX_STEP_FAILURES = 3


class StepSink(Protocol):
    """Takes every step's outputs in one call on the event loop (requests it does not know
    are not its own: it skips them)."""

    def on_step(self, step: StepOutputs) -> None: ...

    def on_failure(self, exc: BaseException) -> None: ...


class AsyncEngine:
    """`async for out in engine.generate(req)`; closing the iterator aborts the request."""

    engine: LLMEngine

    def __init__(self, config: EngineConfig, source: AdapterSource) -> None:
        self._streams: dict[str, asyncio.Queue[GenerationOutput | BaseException]] = {}
        self._sinks: list[StepSink] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._work = threading.Event()
        self._stopping = False
        self._failure: BaseException | None = None
        self._threads = torch.get_num_threads()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, args=(config, source), name="molora-step", daemon=True
        )
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            self._thread = None
            raise self._build_error

    # ----- passthroughs ---------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def pop_gate_stats(self) -> dict[str, list[list[int]]]:
        return self.engine.pop_gate_stats()

    def pop_gate_telemetry(self) -> dict[str, list[LayerTelemetry]]:
        return self.engine.pop_gate_telemetry()

    def pop_load_latencies(self) -> list[float]:
        return self.engine.pop_load_latencies()

    def request_adapters(self) -> RequestAdapters:
        return self.engine.request_adapters()

    def pop_queue_times(self) -> list[float]:
        return self.engine.pop_queue_times()

    def validate_request(self, req: GenerationRequest) -> None:
        self.engine.validate_request(req)

    # ----- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind to the running event loop (outputs are handed to it); the step thread runs
        from construction on."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    async def shutdown(self) -> None:
        self._stopping = True
        for rid in list(self._streams):
            self.engine.abort(rid)
        self._work.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
        for queue in self._streams.values():
            queue.put_nowait(EngineStoppedError("the engine shut down"))
        for sink in self._sinks:
            sink.on_failure(EngineStoppedError("the engine shut down"))

    @property
    def healthy(self) -> bool:
        return self._failure is None and (self._thread is None or self._thread.is_alive())

    def _build(self, config: EngineConfig, source: AdapterSource) -> bool:
        """Load the engine in the step thread (see the module docstring for why)."""
        torch.set_num_threads(self._threads)
        try:
            self.engine = LLMEngine(config, source)
        except BaseException as exc:
            self._build_error = exc
            return False
        finally:
            self._built.set()
        return True

    def _run(self, config: EngineConfig, source: AdapterSource) -> None:
        """The step loop (its own thread): step while there is work, sleep when there is none."""
        if not self._build(config, source):
            return
        failures = 0
        try:
            while not self._stopping or self.engine.has_work():
                self._work.clear()
                if not self.engine.has_work():
                    self._work.wait(IDLE_WAIT_S)
                    continue
                try:
                    outputs = self.engine.step()
                    failures = 0
                except Exception:
                    # The engine isolates each sequence's failures itself; reaching here is a
                    # bug outside any one request. End the in-flight requests with a generic
                    # message (never one request's error text) and keep serving the next ones.
                    failures += 1
                    log.exception("engine step failed (%d in a row)", failures)
                    if failures >= MAX_STEP_FAILURES:
                        raise
                    outputs = self.engine.fail_running(
                        "internal engine error; the request was stopped"
                    )
                if outputs:
                    self._post(self._publish, outputs)
        except Exception as exc:  # the engine is broken: fail every stream, stay unhealthy
            log.exception("engine step loop died")
            self._failure = exc
            self._post(self._fail_all, exc)

    def _post(self, fn: Any, arg: Any) -> None:
        if self._loop is None:  # no stream was ever opened, so nobody waits for outputs
            return
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self._loop.call_soon_threadsafe(fn, arg)

    def _publish(self, step: StepOutputs) -> None:
        for sink in self._sinks:
            sink.on_step(step)
        if self._streams:
            for out in step.outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    def _fail_all(self, _: BaseException) -> None:
        for queue in self._streams.values():
            queue.put_nowait(EngineStoppedError("the engine failed; retry on another replica"))
        for sink in self._sinks:
            sink.on_failure(EngineStoppedError("the engine failed; retry on another replica"))

    # ----- whole-step consumers -------------------------------------------------------------
    def add_sink(self, sink: StepSink) -> None:
        """Hand every step's outputs to `sink` (on the event loop, one call per step)."""
        self._sinks.append(sink)

    async def submit(self, reqs: list[GenerationRequest]) -> None:
        """Validate (tokenize, off the event loop) and queue requests whose outputs a sink
        takes; all or none are queued, together, so n > 1 choices share one prefill."""
        if self._stopping or self._failure is not None:
            raise EngineStoppedError("the engine is not accepting requests")
        if self._loop is None:
            await self.start()
        prompts = await asyncio.to_thread(lambda: [self.engine.validate_request(r) for r in reqs])
        added: list[str] = []
        try:
            for req, prompt_ids in zip(reqs, prompts, strict=True):
                self.engine.add_request(req, prompt_ids)
                added.append(req.request_id)
        except BaseException:
            for request_id in added:
                self.engine.abort(request_id)
            raise
        finally:
            self._work.set()

    # ----- requests -------------------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """One output per engine step that produced something for this request."""
        async for outs in self.stream(req):
            for out in outs:
                yield out

    async def stream(self, req: GenerationRequest) -> AsyncIterator[list[GenerationOutput]]:
        """Like `generate`, but each item is every output that arrived since the last one, so
        a consumer that falls behind (a slow network hop) catches up in one item."""
        if self._stopping or self._failure is not None:
            raise EngineStoppedError("the engine is not accepting requests")
        if self._loop is None:
            await self.start()
        if req.request_id in self._streams:
            raise InvalidRequestError(f"request id {req.request_id!r} is already running")
        queue: asyncio.Queue[GenerationOutput | BaseException] = asyncio.Queue()
        self._streams[req.request_id] = queue
        finished = False
        try:
            prompt_ids = await asyncio.to_thread(self.engine.validate_request, req)
            grammar = None
            if req.response_format is not None:  # fair per-tenant queue, no thread held here
                grammar = await self.engine.grammars.compile_async(req.response_format, req.tenant)
            self.engine.add_request(req, prompt_ids, grammar)
            self._work.set()
            while not finished:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                outs: list[GenerationOutput] = []
                for item in batch:
                    if isinstance(item, BaseException):
                        if outs:
                            yield outs
                        raise item
                    outs.append(item)
                    if item.finished:
                        finished = True
                        break
                yield outs
        finally:
            self._streams.pop(req.request_id, None)
            if not finished:
                self.engine.abort(req.request_id)
                self._work.set()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._work.set()

"""Async front of the engine for the serving replica: one step thread and per-request streams.

The model step runs in one dedicated, long-lived thread, and that thread also builds the
engine (loads the weights): every parallel torch op of the replica then runs from one thread, so
there is one OpenMP thread team. A second team (the event loop's, left over from loading the
model there) makes libgomp count more threads than cores and stop spinning between parallel
regions; each of the thousands of regions per step then waits on a futex wake. The event loop
only moves finished outputs into per-request queues: one loop callback per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import torch

from molora_runtime.config import EngineConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.engine.gate_telemetry import LayerTelemetry
from molora_runtime.engine.types import (
    EngineStats,
    GenerationOutput,
    GenerationRequest,
)
from molora_runtime.errors import EngineStoppedError, InvalidRequestError
from molora_runtime.lora.source import AdapterSource

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # the step thread re-checks for work (and shutdown) at least this often
# Consecutive failed steps (each already failing every in-flight request) before the engine is
# declared broken and the replica unhealthy.
MAX_STEP_FAILURES = 3


class AsyncEngine:
    """`async for out in engine.generate(req)`; closing the iterator aborts the request."""

    engine: LLMEngine

    def __init__(self, config: EngineConfig, source: AdapterSource) -> None:
        self._streams: dict[str, asyncio.Queue[GenerationOutput | BaseException]] = {}
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

    def _publish(self, outputs: list[GenerationOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_all(self, _: BaseException) -> None:
        for queue in self._streams.values():
            queue.put_nowait(EngineStoppedError("the engine failed; retry on another replica"))

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
            self.engine.add_request(req, prompt_ids)
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

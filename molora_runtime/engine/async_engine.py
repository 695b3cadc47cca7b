"""Async front of the engine for the serving replica: a background step loop and per-request
streams. The model step runs in a worker thread so the event loop keeps serving I/O."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from molora_runtime.config import EngineConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.engine.types import EngineStats, GenerationOutput, GenerationRequest
from molora_runtime.errors import EngineStoppedError, InvalidRequestError
from molora_runtime.lora.source import AdapterSource

log = logging.getLogger(__name__)

# Consecutive failed steps (each already failing every in-flight request) before the engine is
# declared broken and the replica unhealthy.
MAX_STEP_FAILURES = 3


class AsyncEngine:
    """`async for out in engine.generate(req)`; closing the iterator aborts the request."""

    def __init__(self, config: EngineConfig, source: AdapterSource) -> None:
        self.engine = LLMEngine(config, source)
        self._streams: dict[str, asyncio.Queue[GenerationOutput | BaseException]] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failure: BaseException | None = None

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

    def pop_load_latencies(self) -> list[float]:
        return self.engine.pop_load_latencies()

    def validate_request(self, req: GenerationRequest) -> None:
        self.engine.validate_request(req)

    # ----- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="molora-step")

    async def shutdown(self) -> None:
        self._stopping = True
        for rid in list(self._streams):
            self.engine.abort(rid)
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout=30)
            self._task = None
        for queue in self._streams.values():
            queue.put_nowait(EngineStoppedError("the engine shut down"))

    @property
    def healthy(self) -> bool:
        return self._failure is None and (self._task is None or not self._task.done())

    async def _loop(self) -> None:
        assert self._wakeup is not None
        failures = 0
        try:
            while not self._stopping or self.engine.has_work():
                if not self.engine.has_work():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                try:
                    outputs = await asyncio.to_thread(self.engine.step)
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
                self._publish(outputs)
                await asyncio.sleep(0)
        except Exception as exc:  # the engine is broken: fail every stream, stay unhealthy
            log.exception("engine step loop died")
            self._failure = exc
            for queue in self._streams.values():
                queue.put_nowait(EngineStoppedError("the engine failed; retry on another replica"))

    def _publish(self, outputs: list[GenerationOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    # ----- requests -------------------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        if self._stopping or self._failure is not None:
            raise EngineStoppedError("the engine is not accepting requests")
        if self._task is None:
            await self.start()
        if req.request_id in self._streams:
            raise InvalidRequestError(f"request id {req.request_id!r} is already running")
        queue: asyncio.Queue[GenerationOutput | BaseException] = asyncio.Queue()
        self._streams[req.request_id] = queue
        finished = False
        try:
            prompt_ids = await asyncio.to_thread(self.engine.validate_request, req)
            self.engine.add_request(req, prompt_ids)
            assert self._wakeup is not None
            self._wakeup.set()
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(req.request_id, None)
            if not finished:
                self.engine.abort(req.request_id)
                if self._wakeup is not None:
                    self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

"""Fair compile work: a few threads serve per-tenant queues round-robin, one job per tenant at once.

Grammar compilation can take seconds, so it runs neither on an event loop nor on the step
thread. A tenant that submits many costly schemas only ever occupies one worker and waits
behind itself; another tenant's job is started at the next free worker after at most one job
of each other tenant. Identical keys in flight share one job. A waiter stops waiting when its
job has run longer than the budget (the job finishes in the background, its tenant's slot
held until then).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from molora_runtime.errors import EngineOverloadedError

_POLL_S = 0.05  # how often a waiter whose job has not started looks again


class OverBudget(Exception):
    """The job ran longer than the waiter's budget."""


class Job:
    """One unit of compile work and its result."""

    def __init__(self, tenant: str, key: str, fn: Callable[[], Any]) -> None:
        self.tenant, self.key, self.fn = tenant, key, fn
        self.future: Future[Any] = Future()
        self.started: float | None = None
        self.waiters = 0

    def left(self, budget_s: float) -> float | None:
        """Seconds of budget left (None while queued)."""
        started = self.started
        return None if started is None else started + budget_s - time.monotonic()


class FairQueue:
    """Per-tenant FIFO queues served round-robin by `workers` daemon threads."""

    def __init__(self, workers: int, per_tenant: int, name: str = "grammar") -> None:
        self.workers, self.per_tenant, self.name = workers, per_tenant, name
        self._cv = threading.Condition()
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()  # turn order
        self._running: set[str] = set()
        self._inflight: dict[str, Job] = {}
        self._threads: list[threading.Thread] = []
        self.started_order: deque[tuple[str, str]] = deque(maxlen=256)  # (tenant, key)

    def submit(self, tenant: str, key: str, fn: Callable[[], Any]) -> Job:
        """Queue `fn` for `tenant` (or join the job already in flight for `key`)."""
        with self._cv:
            job = self._inflight.get(key)
            if job is None:
                queue = self._queues.get(tenant)
                if queue is not None and len(queue) >= self.per_tenant:
                    raise EngineOverloadedError(
                        f"{self.per_tenant} response formats of this tenant are already waiting "
                        "to compile; retry later"
                    )
                job = Job(tenant, key, fn)
                self._queues.setdefault(tenant, deque()).append(job)
                self._inflight[key] = job
                self._start_threads()
                self._cv.notify()
            job.waiters += 1
            return job

    def leave(self, job: Job) -> None:
        """A waiter gave up: a job nobody waits for and that has not started is dropped."""
        with self._cv:
            job.waiters -= 1
            if job.waiters > 0 or job.started is not None:
                return
            queue = self._queues.get(job.tenant)
            if queue is not None and job in queue:
                queue.remove(job)
                if not queue:
                    del self._queues[job.tenant]
                self._inflight.pop(job.key, None)
                job.future.cancel()

    def wait(self, job: Job, budget_s: float) -> Any:
        """Block until `job` is done; OverBudget once it has run `budget_s`."""
        try:
            while True:
                left = job.left(budget_s)
                try:
                    return job.future.result(timeout=_POLL_S if left is None else max(left, 0))
                except FutureTimeout:
                    left = job.left(budget_s)
                    if left is not None and left <= 0:
                        raise OverBudget from None
        finally:
            self.leave(job)

    async def wait_async(self, job: Job, budget_s: float) -> Any:
        """`wait` for an event loop: no thread is held while waiting, and a cancelled waiter
        cancels only its own copy of the result."""
        mine: Future[Any] = Future()
        job.future.add_done_callback(lambda done: _copy(done, mine))
        waiting = asyncio.wrap_future(mine)
        try:
            while True:
                left = job.left(budget_s)
                done, _ = await asyncio.wait(
                    {waiting}, timeout=_POLL_S if left is None else max(left, 0)
                )
                if done:
                    return waiting.result()
                left = job.left(budget_s)
                if left is not None and left <= 0:
                    raise OverBudget
        finally:
            self.leave(job)

    # -- workers --------------------------------------------------------------------------------

    def _start_threads(self) -> None:
        while len(self._threads) < self.workers:
            thread = threading.Thread(
                target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _next(self) -> Job | None:
        """The head job of the first tenant in turn order with nothing running; that tenant
        moves to the back of the order."""
        for tenant in list(self._queues):
            if tenant in self._running:
                continue
            queue = self._queues.pop(tenant)
            job = queue.popleft()
            if queue:
                self._queues[tenant] = queue
            return job
        return None

    def _work(self) -> None:
        while True:
            with self._cv:
                while (job := self._next()) is None:
                    self._cv.wait()
                self._running.add(job.tenant)
                job.started = time.monotonic()
                self.started_order.append((job.tenant, job.key))
            try:
                job.future.set_result(job.fn())
            except BaseException as exc:  # the waiter re-raises it
                job.future.set_exception(exc)
            finally:
                with self._cv:
                    self._running.discard(job.tenant)
                    self._inflight.pop(job.key, None)
                    self._cv.notify_all()


def _copy(done: Future[Any], into: Future[Any]) -> None:
    """Pass a job's outcome to one waiter's future (unless that waiter has gone)."""
    try:
        if done.cancelled():
            into.cancel()
        elif (exc := done.exception()) is not None:
            into.set_exception(exc)
        else:
            into.set_result(done.result())
    except InvalidStateError:  # the waiter's future was cancelled meanwhile
        pass

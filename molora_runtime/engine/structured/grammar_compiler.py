"""Compiles response formats into grammars for one tokenizer, bounded in size, time and queue
share (a costly schema is refused from then on), and caches them by format."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from molora_runtime.config import GrammarConfig
from molora_runtime.engine.structured.grammar_queue import FairQueue, OverBudget
from molora_runtime.engine.structured.grammar_state import GrammarState
from molora_runtime.engine.structured.response_format import ResponseFormat
from molora_runtime.engine.structured.tool_grammar import structural_tag
from molora_runtime.errors import InvalidRequestError

MAX_CACHED_GRAMMARS = 64
MAX_REFUSED = 256
ANONYMOUS = ""  # the queue of requests without a tenant
# A schema's size bounds the memory and time xgrammar may spend on it.
MAX_SCHEMA_CHARS = 64 * 1024


class GrammarCompiler:
    """Compiles (and caches) response formats for one tokenizer and vocabulary."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: list[int],
        config: GrammarConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.config = config or GrammarConfig()
        self.queue = FairQueue(self.config.workers, self.config.queue_per_tenant)
        self._compiler: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._refused: OrderedDict[str, None] = OrderedDict()  # over the time budget once
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr  # the optional `serve` extra

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def check(self, fmt: ResponseFormat) -> str:
        """Cheap checks before any compile work; returns the cache key."""
        if self.tokenizer is None:
            raise InvalidRequestError("response_format needs a model with a tokenizer")
        if fmt.type == "json_schema" and fmt.json_schema is None:
            raise InvalidRequestError("response_format json_schema needs a schema")
        if fmt.type == "tool_calls" and fmt.tool_calls is None:
            raise InvalidRequestError("a tool_calls format needs its functions")
        key = fmt.key()
        if len(key) > MAX_SCHEMA_CHARS:
            raise InvalidRequestError(
                f"response_format schema of {len(key)} characters, over the {MAX_SCHEMA_CHARS} "
                "this server compiles"
            )
        with self._lock:
            if key in self._refused:
                raise self._over_budget()
        return key

    def _over_budget(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"response_format schema takes longer than {self.config.compile_budget_s:g} s to "
            "compile; simplify it (fewer enum values, smaller nesting)"
        )

    def _cached(self, key: str) -> Any:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _build(self, fmt: ResponseFormat, key: str) -> Any:
        """Runs on a queue worker."""
        compiler = self._get_compiler()
        try:
            compiled = self._compile(compiler, fmt)
        except Exception as exc:  # xgrammar's RuntimeError names what it cannot use
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
            reason = reason.split(": ", 1)[-1] if "json_schema_converter" in reason else reason
            what = "tool parameters" if fmt.type == "tool_calls" else "response_format"
            raise InvalidRequestError(f"invalid {what} schema: {reason}") from None
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler: Any, fmt: ResponseFormat) -> Any:
        if fmt.type == "tool_calls":
            assert fmt.tool_calls is not None  # refused by `check`
            return compiler.compile_structural_tag(structural_tag(fmt.tool_calls))
        schema = fmt.json_schema if fmt.type == "json_schema" else {"type": "object"}
        # json_object means an object (OpenAI), not any JSON value.
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def _refuse(self, key: str) -> InvalidRequestError:
        with self._lock:
            self._refused[key] = None
            if len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)
        return self._over_budget()

    def compile(self, fmt: ResponseFormat, tenant: str | None = None) -> Any:
        """The compiled grammar of `fmt` (blocking; for callers on their own thread); an
        invalid or too costly schema is an InvalidRequestError."""
        key = self.check(fmt)
        if (hit := self._cached(key)) is not None:
            return hit
        job = self.queue.submit(tenant or ANONYMOUS, key, lambda: self._build(fmt, key))
        try:
            return self.queue.wait(job, self.config.compile_budget_s)
        except OverBudget:
            raise self._refuse(key) from None

    async def compile_async(self, fmt: ResponseFormat, tenant: str | None = None) -> Any:
        """`compile` for an event loop: the wait holds no thread."""
        key = self.check(fmt)
        if (hit := self._cached(key)) is not None:
            return hit
        job = self.queue.submit(tenant or ANONYMOUS, key, lambda: self._build(fmt, key))
        try:
            return await self.queue.wait_async(job, self.config.compile_budget_s)
        except OverBudget:
            raise self._refuse(key) from None

    def new_state(self, compiled: Any) -> GrammarState:
        return GrammarState(compiled, self.vocab_size)

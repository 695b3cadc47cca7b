"""Structured output: a JSON grammar (xgrammar) as a per-sequence token mask before sampling.

The same path forces tool calls (`tool_choice` "required" or a named function): their grammar is
a structural tag built in `tool_grammar`.

Each sequence with a `response_format` owns a `GrammarState` (an xgrammar matcher over the
compiled grammar, which is shared and cached by schema): before each sampling step it yields the
boolean mask of the tokens the grammar allows next (EOS only once the JSON is complete), and every
accepted token advances it; the sequence finishes with "stop" when the grammar terminates. The
mask is applied in `logits_processing` like any other, so it works with every route kind, n > 1,
penalties and logprobs. xgrammar is imported lazily: only requests that ask need it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from molora_runtime.engine.tool_grammar import ToolCallFormat, structural_tag
from molora_runtime.errors import InvalidRequestError

MAX_CACHED_GRAMMARS = 64
# The compile budget: a schema's size bounds the time xgrammar spends compiling it.
MAX_SCHEMA_CHARS = 64 * 1024


class ResponseFormat(BaseModel):
    """What the engine needs: JSON (any object), JSON matching `json_schema`, or tool calls."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object", "json_schema", "tool_calls"]
    json_schema: dict[str, Any] | None = Field(None, description="the JSON Schema (json_schema)")
    tool_calls: ToolCallFormat | None = Field(None, description="the functions (tool_calls)")

    def key(self) -> str:
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """Bool [vocab] of the tokens the grammar accepts next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bits = (self._bitmask[0, :, None] >> self._shifts) & 1
        return bits.bool().flatten()[: self.vocab_size]

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise InvalidRequestError(f"token {token} does not fit the response format")

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles (and caches) response formats for one tokenizer and vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self._compiler: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, fmt: ResponseFormat) -> Any:
        """The compiled grammar of `fmt`; an invalid schema is an InvalidRequestError."""
        if self.tokenizer is None:
            raise InvalidRequestError("response_format needs a model with a tokenizer")
        key = fmt.key()
        if len(key) > MAX_SCHEMA_CHARS:
            raise InvalidRequestError(
                f"response_format schema of {len(key)} characters, over the {MAX_SCHEMA_CHARS} "
                "this server compiles"
            )
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            compiler = self._get_compiler()
        # Compiled outside the lock: a cached grammar never waits behind another's compile.
        try:
            compiled = self._compile(compiler, fmt)
        except InvalidRequestError:
            raise
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
            if fmt.tool_calls is None:
                raise InvalidRequestError("a tool_calls format needs its functions")
            return compiler.compile_structural_tag(structural_tag(fmt.tool_calls))
        schema = fmt.json_schema if fmt.type == "json_schema" else {"type": "object"}
        if schema is None:
            raise InvalidRequestError("response_format json_schema needs a schema")
        # json_object means an object (OpenAI), not any JSON value.
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def new_state(self, fmt: ResponseFormat) -> GrammarState:
        return GrammarState(self.compile(fmt), self.vocab_size)

"""Tool calls read out of generated text, whole or as it streams, in OpenAI's shape.

One parser per template family; the Hermes family (which Qwen3 shares) writes each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Text outside the calls is content. A
stream's first delta of a call carries its index, id, type, name and an empty arguments string;
later deltas carry the arguments as they are generated (held back only while they may still be the
block's closing `}` or tag). A block that is not a valid call stays in the content, as generated.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from deployments.api.response_models import FunctionCallOut, ToolCallOut
from deployments.api.response_shape import ResponseShape

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# A call's opening up to its arguments: what a stream must see before it names the function.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"\s*,\s*"arguments"\s*:\s*')
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.S)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one block's body, or None when it is not a valid call.

    The arguments are the generated text itself where the block has the usual key order, so a
    streamed call and a whole one carry the same string."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    head = _HEAD.match(body)
    if head is not None:
        raw = body[head.end() : body.rstrip().rfind("}")].strip()
        try:
            if json.loads(raw) == arguments:
                return obj["name"], raw
        except ValueError:
            pass
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) of a whole generated text; calls past `max_calls` are dropped."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    end = 0
    for block in _BLOCK.finditer(text):
        call = read_call(block.group(1))
        if call is None:
            continue
        before = text[end : block.start()]
        content.append(before.lstrip() if end else before)  # no newlines between calls
        end = block.end()
        if max_calls is None or len(calls) < max_calls:
            calls.append(_call(len(calls), new_call_id(), *call))
    content.append(text[end:].lstrip() if end else text[end:])
    return "".join(content).strip() if calls else text, calls


def _call(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that may begin `marker` (held until it is known)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _OpenCall:
    text: str = ""  # the block's body so far
    id: str | None = None  # set once the name is out
    args_from: int = 0  # where the arguments start in `text`
    sent: str = ""  # the arguments already sent


@dataclass
class ToolCallStream:
    """One choice's stream: feed text increments, get content and tool-call deltas back."""

    max_calls: int | None = None
    calls: int = 0  # calls started (their deltas sent)
    _pending: str = ""
    _open: _OpenCall | None = None
    _done: bool = False  # max_calls reached: the rest is dropped
    _trim: bool = False  # a call just closed: whitespace after it is dropped
    _out: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str, last: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool-call deltas) for `text`; `last` flushes what was held back."""
        self._pending += text
        content: list[str] = []
        self._out = []
        while self._pending and not self._done:
            if self._open is None:
                at = self._pending.find(CALL_OPEN)
                if at < 0:
                    keep = 0 if last else _held_prefix(self._pending, CALL_OPEN)
                    self._text(content, self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                self._text(content, self._pending[:at])
                self._pending = self._pending[at + len(CALL_OPEN) :]
                self._open = _OpenCall()
                continue
            call = self._open
            at = self._pending.find(CALL_CLOSE)
            if at < 0:
                keep = 0 if last else _held_prefix(self._pending, CALL_CLOSE)
                call.text += self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                if last:
                    self._text(content, self._close(call, closed=False))
                else:
                    self._progress(call)
                break
            call.text += self._pending[:at]
            self._pending = self._pending[at + len(CALL_CLOSE) :]
            self._text(content, self._close(call))
        if self._done:
            self._pending = ""
        return "".join(content), self._out

    def _text(self, content: list[str], piece: str) -> None:
        if self._trim:  # the newlines between and after calls are no content
            piece = piece.lstrip()
            self._trim = not piece
        content.append(piece)

    def _progress(self, call: _OpenCall) -> None:
        """Send the name once it is known, then the arguments that cannot be the block's end."""
        if call.id is None:
            head = _HEAD.match(call.text)
            if head is None or head.end() == len(call.text):  # more whitespace may follow
                return
            if call.text[head.end()] != "{":  # arguments that are no object: no call
                return
            call.id, call.args_from = new_call_id(), head.end()
            self._out.append(_call(self.calls, call.id, head.group(1), ""))
            self.calls += 1
        args = call.text[call.args_from :]
        safe = args[: max(args.rfind("}"), 0)].rstrip()
        self._send(call, safe)

    def _send(self, call: _OpenCall, arguments: str) -> None:
        if len(arguments) > len(call.sent) and arguments.startswith(call.sent):
            more = arguments[len(call.sent) :]
            self._out.append({"index": self.calls - 1, "function": {"arguments": more}})
            call.sent = arguments

    def _close(self, call: _OpenCall, closed: bool = True) -> str:
        """End a block: finish its call, or give it back as content when it is none."""
        self._open = None
        parsed = read_call(call.text)
        if call.id is None:
            if parsed is None:
                return CALL_OPEN + call.text + (CALL_CLOSE if closed else "")
            self._out.append(_call(self.calls, new_call_id(), *parsed))
            self.calls += 1
        else:
            args = call.text[call.args_from :]
            self._send(call, parsed[1] if parsed else args[: args.rfind("}")].rstrip())
        if self.max_calls is not None and self.calls >= self.max_calls:
            self._done = True
        self._trim = True
        return ""


class ToolCallShaping:
    """The Shaper's hook for a chat request with tools: per choice, content and tool calls out of
    the generated text, and finish_reason "tool_calls" when the model chose to call (a named
    function keeps "stop", as OpenAI answers a forced call)."""

    def __init__(self, mode: str, parallel: bool) -> None:
        self.named = mode == "named"
        self.max_calls = 1 if self.named or not parallel else None
        self.streams: dict[int, ToolCallStream] = {}

    @classmethod
    def for_shape(cls, shape: ResponseShape) -> ToolCallShaping | None:
        """The hook for a response, or None when no call can come (no tools, tool_choice none)."""
        if shape.tool_mode == "none":
            return None
        return cls(shape.tool_mode, shape.parallel_tool_calls)

    def _finish(self, finish: str | None, called: bool) -> str | None:
        return "tool_calls" if called and finish == "stop" and not self.named else finish

    def message(
        self, text: str, finish: str | None
    ) -> tuple[str | None, list[ToolCallOut] | None, str | None]:
        """(content, tool_calls, finish_reason) of a whole choice."""
        content, calls = parse_tool_calls(text, self.max_calls)
        if not calls:
            return text, None, finish
        out = [ToolCallOut(id=c["id"], function=FunctionCallOut(**c["function"])) for c in calls]
        return content or None, out, self._finish(finish, True)

    def delta(
        self, index: int, text: str, finish: str | None
    ) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
        """(content, tool-call deltas as `ToolCallDelta` dumps, finish_reason) of one streamed
        increment of choice `index`."""
        stream = self.streams.setdefault(index, ToolCallStream(self.max_calls))
        content, deltas = stream.feed(text, last=finish is not None)
        calls = deltas or None
        if calls and not content:
            content = None
        return content, calls, self._finish(finish, stream.calls > 0)

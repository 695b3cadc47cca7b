"""Chat templates: the shipped ones, a template chosen per model, and whether it has a tool format.

vLLM's `--chat-template` lets a user replace a model's template; `EngineConfig.chat_template` does
the same with a shipped name, a file path or the template text. The embedded default model's own
ChatML template shows no tools, so it is served with the shipped Hermes-style one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from molora_runtime.config import DEFAULT_MODEL

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
SHIPPED_TEMPLATES: dict[str, str] = {"hermes": "hermes.jinja"}
# Models whose own template has no tool format and the shipped template used instead.
DEFAULT_TEMPLATES: dict[str, str] = {DEFAULT_MODEL: "hermes"}
MAX_TEMPLATE_CHARS = 256 * 1024
_PROBE_TOOL = "molora_tool_format_probe"


class ChatTemplateError(ValueError):
    """A chat template setting that names nothing readable."""


def read_chat_template(choice: str) -> str:
    """The template text of `choice`: a shipped name, a file, or the Jinja text itself."""
    if choice in SHIPPED_TEMPLATES:
        return (TEMPLATE_DIR / SHIPPED_TEMPLATES[choice]).read_text()
    if "{{" in choice or "{%" in choice:
        text = choice
    else:
        path = Path(choice).expanduser()
        if not path.is_file():
            raise ChatTemplateError(
                f"chat_template {choice[:200]!r} is neither a shipped template "
                f"({sorted(SHIPPED_TEMPLATES)}), a file, nor Jinja text"
            )
        text = path.read_text()
    if len(text) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"chat_template is over {MAX_TEMPLATE_CHARS} characters")
    return text


def use_chat_template(tokenizer: Any, choice: str | None, model: str) -> None:
    """Replace the tokenizer's template by `choice` (or the model's shipped default)."""
    choice = choice or DEFAULT_TEMPLATES.get(model)
    if tokenizer is None or choice is None:
        return
    tokenizer.chat_template = read_chat_template(choice)


def renders_tools(tokenizer: Any) -> bool:
    """Whether the template shows a request's tools to the model (a probe tool is rendered)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return False
    probe = {
        "type": "function",
        "function": {"name": _PROBE_TOOL, "description": "", "parameters": {"type": "object"}},
    }
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "?"}],
            tools=[probe],
            add_generation_prompt=True,
            tokenize=False,
        )
    except Exception:  # a template that cannot take tools has no tool format
        return False
    return _PROBE_TOOL in str(text)

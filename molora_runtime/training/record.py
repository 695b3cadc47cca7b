"""The README.md model card written next to a trained adapter or composition.

Stores accept a README.md beside the weights, so the exact command line, seed and full training
config travel with the published artifact and anyone can reproduce it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

CARD = "README.md"


def write_card(folder: Path, title: str, cfg: BaseModel, command: str | None = None) -> Path:
    lines = [f"# {title}", "", "Produced by MoLoRA Serve's training commands.", ""]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    lines += [
        "Training config (seed included):",
        "",
        "```json",
        cfg.model_dump_json(indent=2),
        "```",
        "",
    ]
    path = Path(folder) / CARD
    path.write_text("\n".join(lines))
    return path

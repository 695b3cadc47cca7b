"""Small facts the vLLM-compatible endpoints report: the server version (`GET /version`) and
the model's context length (`max_model_len` in model cards), asked of a replica once."""

from __future__ import annotations

import asyncio
import importlib.metadata
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

from deployments.config import REPO_ROOT

PACKAGE = "molora-serve"


@cache
def server_version() -> str:
    """The installed package's version, else the checkout's pyproject.toml's."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(REPO_ROOT) / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


class ModelFacts:
    """`max_model_len` as the engine derived it (the config's value capped by the model's
    positions); until a replica has answered, the configured value."""

    def __init__(self, model: Any, configured: int) -> None:
        self._model = model
        self._configured = configured
        self._known: int | None = None

    async def max_model_len(self) -> int:
        if self._known is None:
            try:
                info = await asyncio.wait_for(self._model.model_info.remote(), 5)
                self._known = int(info["max_model_len"])
            except Exception:  # no replica yet: the configured bound, asked again next time
                return self._configured
        return self._known

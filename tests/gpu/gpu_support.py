"""Helpers that let GPU checks run under pytest *or* as plain Python (`run_checks`).

The GPU machine may have only torch and triton installed, so GPU test modules must not need
pytest, fixtures or Hypothesis: each check is a no-argument `test_*` function decorated with
`@gpu`, which calls `require_cuda()` first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch

try:
    import pytest
except ImportError:  # the bare GPU box
    pytest = None

F = TypeVar("F", bound=Callable[..., object])


class SkipCheck(Exception):
    """Raised to skip a check when pytest is absent."""


def skip(reason: str) -> None:
    if pytest is not None:
        pytest.skip(reason)
    raise SkipCheck(reason)


def gpu(fn: F) -> F:
    """Mark a check as needing a GPU (pytest marker `gpu`; an attribute without pytest)."""
    fn.gpu = True  # type: ignore[attr-defined]
    return pytest.mark.gpu(fn) if pytest is not None else fn


def require_cuda() -> None:
    """Skip unless a CUDA device is present and Triton kernels will be compiled, not interpreted."""
    if not torch.cuda.is_available():
        skip("needs a CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        skip("TRITON_INTERPRET=1 in this process; run scripts/gpu_check.sh")


def assert_close_scaled(
    got: torch.Tensor,
    want: torch.Tensor,
    what: str,
    tolerances: dict[torch.dtype, tuple[float, float]],
) -> None:
    """Same dtype and shape, and equal within the dtype's (rtol, atol), atol relative to
    1 + max |want|."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    rtol, atol = tolerances[got.dtype]
    scale = 1.0 + float(want.float().abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * scale, msg=what)

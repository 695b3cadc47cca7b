"""Random routed-LoRA problems (strided hot-set views, slot patterns) and tolerances."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (rtol, atol relative to the output's max magnitude): halves differ from the fp32 definition
# by the final rounding (and accumulation order) only.
TOLERANCES = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (3e-3, 2e-3),
    torch.bfloat16: (2e-2, 1e-2),
}
PATTERNS = ("random", "empty", "repeat", "negative", "one_slot")
# The fused-group tests' shared draws: the seed, token count, rank and input width.
GROUP_SHAPES = dict(
    seed=st.integers(0, 2**31 - 1),
    T=st.integers(1, 12),
    r=st.integers(1, 8),
    d_in=st.integers(1, 40),
)


@dataclass(frozen=True)
class Case:
    x: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    slot_ids: torch.Tensor
    weights: torch.Tensor


def make_case(
    seed: int,
    T: int,
    k: int,
    S: int,
    r: int,
    d_in: int,
    d_out: int,
    dtype: torch.dtype = torch.float32,
    pattern: str = "random",
    layer: int = 1,
) -> Case:
    """One problem; A/B are `buf[:, layer]` views of [S, L, ...] buffers, as the engine passes.

    Slot 0 holds non-zero data on purpose: ids <= 0 must be skipped, not multiplied by zeros.
    """
    g = torch.Generator().manual_seed(seed)
    a_buf = torch.randn(S, 3, r, d_in, generator=g) / d_in**0.5
    b_buf = torch.randn(S, 3, d_out, r, generator=g) / max(r, 1) ** 0.5
    x = torch.randn(T, d_in, generator=g)
    if pattern == "random":
        ids = torch.randint(-1, S, (T, k), generator=g)
    elif pattern == "empty":
        ids = torch.randint(-3, 1, (T, k), generator=g)
    elif pattern == "repeat":
        ids = torch.full((T, k), S - 1)
    elif pattern == "negative":
        ids = torch.where(torch.rand(T, k, generator=g) < 0.5, -1, torch.randint(1, S, (T, k)))
    else:
        ids = torch.randint(1, S, (1, 1), generator=g).expand(T, k).clone()
    weights = torch.rand(T, k, generator=g) * 2 - 0.5
    return Case(x.to(dtype), a_buf[:, layer].to(dtype), b_buf[:, layer].to(dtype), ids, weights)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """`got` equals the fp32 definition `want` up to the dtype's rounding."""
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol, atol = TOLERANCES[got.dtype]
    scale = float(want.float().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * (1.0 + scale))


@st.composite
def case_params(draw: st.DrawFn, max_t: int = 12, max_d: int = 72, max_r: int = 24) -> dict:
    """Shapes, ranks, slot patterns, k and dtype for one problem."""
    return {
        "seed": draw(st.integers(0, 2**31 - 1)),
        "T": draw(st.integers(1, max_t)),
        "k": draw(st.integers(1, 3)),
        "S": draw(st.integers(2, 5)),
        "r": draw(st.integers(1, max_r)),
        "d_in": draw(st.integers(1, max_d)),
        "d_out": draw(st.integers(1, max_d)),
        "dtype": DTYPES[draw(st.sampled_from(sorted(DTYPES)))],
        "pattern": draw(st.sampled_from(PATTERNS)),
    }

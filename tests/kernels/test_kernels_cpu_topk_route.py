"""The CPU top-k route kernel (`kernels.cpu_topk_route.topk_route`) equals its twin
(`topk_route_reference`): same experts and slot tables exactly, weights to fp32 rounding, the same
rank blocks and inactive masks; and it refuses inputs that would make it write out of bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_topk_route as ctr
from kernels.cpu_topk_route import topk_route, topk_route_reference

pytestmark = pytest.mark.skipif(not ctr.available(), reason="the kernel does not build here")


D = 40  # not a multiple of the kernel's 16 partial sums: the tail runs too


def _case(seed: int, T: int, n: int, count: int) -> tuple[torch.Tensor, ...]:
    """x, gate weight and bias, the experts' hot-set slots (5..) and their stacked columns."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    weight, bias = torch.randn(n, D, generator=gen), torch.randn(n, generator=gen)
    local = torch.randperm(count, generator=gen)[:n]
    return x, weight, bias, local + 5, local


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**16), T=st.integers(1, 40), n=st.integers(1, 6), extra=st.integers(0, 3),
    k=st.integers(1, 6), temp=st.sampled_from([1.0, 0.5, 3.0]),
    ranks=st.sampled_from([(), (16,), (48, 16, 32), (4, 8)]), pad=st.integers(0, 2),
)  # fmt: skip
def test_kernel_matches_twin(
    seed: int, T: int, n: int, extra: int, k: int, temp: float, ranks: tuple, pad: int
) -> None:
    k = min(k, n)
    count = n + extra
    x, weight, bias, slots, local = _case(seed, T, n, count)
    args = (x, weight, bias, k, temp, slots, local, count, list(ranks), k + pad)
    got, want = topk_route(*args), topk_route_reference(*args)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-6)
    # the kernel sums logits in its own order: rows whose k-th and next logit nearly tie may
    # pick either expert, so routing is compared on the clearly separated rows
    ordered = want.logits.sort(dim=-1, descending=True).values
    clear = (ordered[:, k - 1] - ordered[:, k] > 1e-4) if k < n else torch.ones(T, dtype=torch.bool)
    for name in ("experts", "slot_ids", "inactive"):
        assert torch.equal(getattr(got, name)[clear], getattr(want, name)[clear]), name
    for name in ("weights", "slot_weights", "rows"):  # softmax of logits that differ by rounding
        got_t, want_t = getattr(got, name)[clear], getattr(want, name)[clear]
        torch.testing.assert_close(got_t, want_t, atol=1e-5, rtol=0)
    assert got.rows.shape == (T, count * sum(ranks))


def test_top1_weight_is_exactly_one_and_padding_is_zero() -> None:
    x, weight, bias, slots, local = _case(1, 9, 4, 4)
    got = topk_route(x, weight, bias, 1, 0.7, slots, local, 4, [8], 3)
    assert torch.equal(got.slot_weights[:, 0], torch.ones(9))
    assert torch.equal(got.slot_weights[:, 1:], torch.zeros(9, 2))
    assert torch.equal(got.slot_ids[:, 1:], torch.zeros(9, 2, dtype=torch.long))
    assert torch.equal(got.experts[:, 0], got.logits.argmax(-1))


def test_a_tie_goes_to_the_lower_expert() -> None:
    bias = torch.tensor([1.0, 2.0, 2.0, 0.5])
    x, weight = torch.zeros(1, D), torch.randn(4, D)
    got = topk_route(
        x, weight, bias, 2, 1.0, torch.tensor([4, 5, 6, 7]), torch.arange(4), 4, [2], 2
    )
    assert got.experts.tolist() == [[1, 2]]
    assert got.rows.tolist() == [[0, 0, 0.5, 0.5, 0.5, 0.5, 0, 0]]


@pytest.mark.parametrize(
    ("k", "width", "local", "match"),
    [
        (0, 2, [0, 1, 2], "top_k"),
        (4, 4, [0, 1, 2], "top_k"),  # more than the experts
        (2, 1, [0, 1, 2], "top_k"),  # more than the table's width
        (2, 2, [0, 1, 3], "outside the stacked range"),
        (2, 2, [0, -1, 2], "outside the stacked range"),
    ],
)
def test_refuses_what_would_write_out_of_bounds(
    k: int, width: int, local: list[int], match: str
) -> None:
    x, weight, bias, slots, _ = _case(0, 5, 3, 3)
    with pytest.raises(ValueError, match=match):
        topk_route(x, weight, bias, k, 1.0, slots, torch.tensor(local), 3, [4], width)


def test_refuses_other_dtypes_and_shapes() -> None:
    x, weight, bias, slots, local = _case(0, 5, 3, 3)
    with pytest.raises(ValueError, match="fp32"):
        topk_route(x.double(), weight, bias, 1, 1.0, slots, local, 3, [], 2)
    with pytest.raises(ValueError, match="x must be fp32"):
        topk_route(x[:, :-1], weight, bias, 1, 1.0, slots, local, 3, [], 2)
    with pytest.raises(ValueError, match="do not agree"):
        topk_route(x, weight, bias[:2], 1, 1.0, slots, local, 3, [], 2)
    with pytest.raises(ValueError, match="expert_slots"):
        topk_route(x, weight, bias, 1, 1.0, torch.arange(4), local, 3, [], 2)

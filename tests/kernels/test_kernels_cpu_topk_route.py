"""The CPU top-k route kernel (`kernels.cpu_topk_route.topk_route`) equals its twin
(`topk_route_reference`): same experts and slot tables exactly, weights to fp32 rounding; and it
refuses inputs that would make it write out of bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from kernels import cpu_topk_route as ctr
from kernels.cpu_topk_route import (
    TopKRouter,
    route_stats_reference,
    topk_route,
    topk_route_reference,
)

pytestmark = pytest.mark.skipif(not ctr.available(), reason="the kernel does not build here")


D = 40  # not a multiple of the kernel's 16 partial sums: the tail runs too


def _case(seed: int, T: int, n: int, count: int) -> tuple[torch.Tensor, ...]:
    """x, gate weight and bias, and the experts' hot-set slots (5..5 + count)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    weight, bias = torch.randn(n, D, generator=gen), torch.randn(n, generator=gen)
    return x, weight, bias, torch.randperm(count, generator=gen)[:n] + 5


# a route's drawn settings: seed, experts, top-k, temperature and the table's padding past k
ROUTE = {
    "seed": st.integers(0, 2**16), "n": st.integers(1, 6), "k": st.integers(1, 6),
    "temp": st.sampled_from([1.0, 0.5, 3.0]), "pad": st.integers(0, 2),
}  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(**ROUTE, T=st.integers(1, 40), extra=st.integers(0, 3))
def test_kernel_matches_twin(
    seed: int, T: int, n: int, extra: int, k: int, temp: float, pad: int
) -> None:
    k = min(k, n)
    x, weight, bias, slots = _case(seed, T, n, n + extra)
    args = (x, weight, bias, k, temp, slots, k + pad)
    got, want = topk_route(*args), topk_route_reference(*args)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-6)
    # the kernel sums logits in its own order: rows whose k-th and next logit nearly tie may
    # pick either expert, so routing is compared on the clearly separated rows
    ordered = want.logits.sort(dim=-1, descending=True).values
    clear = (ordered[:, k - 1] - ordered[:, k] > 1e-4) if k < n else torch.ones(T, dtype=torch.bool)
    for name in ("experts", "slot_ids"):
        assert torch.equal(getattr(got, name)[clear], getattr(want, name)[clear]), name
    for name in ("weights", "slot_weights"):  # softmax of logits that differ by rounding
        got_t, want_t = getattr(got, name)[clear], getattr(want, name)[clear]
        torch.testing.assert_close(got_t, want_t, atol=1e-5, rtol=0)


def test_top1_weight_is_exactly_one_and_padding_is_zero() -> None:
    x, weight, bias, slots = _case(1, 9, 4, 4)
    got = topk_route(x, weight, bias, 1, 0.7, slots, 3)
    assert torch.equal(got.slot_weights[:, 0], torch.ones(9))
    assert torch.equal(got.slot_weights[:, 1:], torch.zeros(9, 2))
    assert torch.equal(got.slot_ids[:, 1:], torch.zeros(9, 2, dtype=torch.long))
    assert torch.equal(got.experts[:, 0], got.logits.argmax(-1))


def test_a_tie_goes_to_the_lower_expert() -> None:
    bias = torch.tensor([1.0, 2.0, 2.0, 0.5])
    x, weight = torch.zeros(1, D), torch.randn(4, D)
    got = topk_route(x, weight, bias, 2, 1.0, torch.tensor([4, 5, 6, 7]), 2)
    assert got.experts.tolist() == [[1, 2]]
    assert got.slot_ids.tolist() == [[5, 6]]
    assert got.slot_weights.tolist() == [[0.5, 0.5]]


@pytest.mark.parametrize(
    ("k", "width"),
    [(0, 2), (4, 4), (2, 1)],  # none, more than the experts, more than the table's width
)
def test_refuses_what_would_write_out_of_bounds(k: int, width: int) -> None:
    x, weight, bias, slots = _case(0, 5, 3, 3)
    with pytest.raises(ValueError, match="top_k"):
        topk_route(x, weight, bias, k, 1.0, slots, width)


def test_refuses_other_dtypes_and_shapes() -> None:
    x, weight, bias, slots = _case(0, 5, 3, 3)
    with pytest.raises(ValueError, match="fp32"):
        topk_route(x.double(), weight, bias, 1, 1.0, slots, 2)
    with pytest.raises(ValueError, match="x must be fp32"):
        topk_route(x[:, :-1], weight, bias, 1, 1.0, slots, 2)
    with pytest.raises(ValueError, match="do not agree"):
        topk_route(x, weight, bias[:2], 1, 1.0, slots, 2)
    with pytest.raises(ValueError, match="expert_slots"):
        topk_route(x, weight, bias, 1, 1.0, torch.arange(4), 2)


EDGES = (torch.tensor([0.05, 0.2, 0.5, 0.9, 1.0]) + 1e-6, torch.tensor([0.4, 0.6, 0.8, 1.0]) + 1e-6)


def _router(seed: int, L: int, n: int, k: int, temp: float, width: int) -> TopKRouter:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, D, generator=gen) for _ in range(L)]
    biases = [torch.randn(n, generator=gen) for _ in range(L)]
    slots = torch.randperm(n + 2, generator=gen)[:n] + 1
    return TopKRouter(weights, biases, k, temp, slots, width, EDGES)


@settings(max_examples=40, deadline=None)
@given(**ROUTE, L=st.integers(1, 4), T=st.integers(1, 24), mixed=st.booleans())
def test_tables_and_statistics_match_the_twins(
    seed: int, L: int, T: int, n: int, k: int, temp: float, pad: int, mixed: bool
) -> None:
    """Routing every layer into one step's tables gives each layer's own route (static tokens
    keeping their rows), and the statistics the kernel folds on the way equal
    `route_stats_reference` on those routes over the learned tokens."""
    k, width = min(k, n), min(k, n) + pad
    router = _router(seed, L, n, k, temp, width)
    gen = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(L, T, D, generator=gen)
    learned = torch.ones(T, dtype=torch.bool)
    static = None
    if mixed:
        learned = torch.rand(T, generator=gen) < 0.5
        static = (learned, torch.randint(0, 9, (T, width), generator=gen), torch.rand(T, width))
    tables = router.tables(T, static)
    for layer in range(L):
        router.route_into(layer, xs[layer], tables)
        alone = router(layer, xs[layer])
        for name in ("logits", "experts"):
            assert torch.equal(getattr(tables, name)[layer], getattr(alone, name)), name
        for name, col in (("slot_ids", 1), ("slot_weights", 2)):
            want = getattr(alone, name)
            if static is not None:
                want = torch.where(learned[:, None], want, static[col])
            assert torch.equal(getattr(tables, name)[layer], want), name
    routed = (F.one_hot(tables.experts, n) * (tables.slot_weights[..., :k] > 0)[..., None]).sum(2)
    top1 = tables.slot_weights[..., 0]  # the mask leaves the static rows out
    want = route_stats_reference(tables.logits / temp, top1, routed, learned, *EDGES)
    assert tables.stats is not None and tables.stats.shape == want.shape
    torch.testing.assert_close(tables.stats, want, atol=1e-4, rtol=1e-5)
    assert torch.equal(
        tables.stats[:, 0], torch.full((L,), float(learned.sum()), dtype=torch.float64)
    )


def test_route_into_refuses_what_would_write_out_of_bounds() -> None:
    router = _router(0, 2, 3, 2, 1.0, 2)
    x = torch.randn(5, D)
    tables = router.tables(5)
    for layer in (-1, 2):
        with pytest.raises(ValueError, match="route_into"):
            router.route_into(layer, x, tables)
    other = TopKRouter(router.weights, router.biases, 2, 1.0, router.expert_slots, 2)
    for bad_tables in (router.tables(4), other.tables(5)):  # other tokens; no statistics
        with pytest.raises(ValueError, match="route_into"):
            router.route_into(0, x, bad_tables)
    with pytest.raises(ValueError, match="route_into"):
        router.route_into(0, x.t().contiguous().t(), tables)  # not contiguous
    learned, ids = torch.ones(5, dtype=torch.bool), torch.zeros(5, 2, dtype=torch.long)
    for static in ((learned[:4], ids, ids.float()), (learned, ids[:, :1], ids[:, :1].float())):
        with pytest.raises(ValueError, match="static rows"):
            router.tables(5, static)

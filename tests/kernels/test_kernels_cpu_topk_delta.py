"""The grouped top-k LoRA delta kernel (`kernels.cpu_topk_delta.GroupedDelta`) equals its twin
(`topk_delta_reference`, on the segmented reference) over random shapes: fused groups and single
projections, zero-padded ranks, pool buffers without a zero slot, k = 1 and 2 with padding
columns, T = 1, fp32 and bf16 inputs, slots and outputs, AVX-512 and AVX2 tiles; a token's row
does not depend on its batch; out-of-range ids are refused before anything is written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_topk_delta as ctd
from kernels.cpu_topk_delta import GroupedDelta, topk_delta_reference

pytestmark = pytest.mark.skipif(not ctd.available(), reason="the kernel does not build here")

F32, BF16 = torch.float32, torch.bfloat16


def _slots(
    gen: torch.Generator, S: int, rank: int, d: int, widths: list[int], dtype: torch.dtype,
    real_rank: int,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, int]], int]:  # fmt: skip
    """A `[S, n·rank, d]` block and the members' `Bt [S, rank, w]` views into one flat buffer
    (as the hot-set lays out a fused group), ranks past `real_rank` zero; and the output width."""
    n = len(widths)
    A = torch.randn(S, n, rank, d, generator=gen) * 0.3
    A[:, :, real_rank:] = 0
    flat = torch.randn(S * rank * sum(widths), generator=gen) * 0.3
    members, offset, col = [], 0, 0
    for w in widths:
        bt = flat[offset : offset + S * rank * w].view(S, rank, w)
        bt[:, real_rank:] = 0
        members.append((bt, col))
        offset, col = offset + S * rank * w, col + w + 3  # a gap: columns no member owns
    flat_t = flat.to(dtype)
    cast, offset = [], 0
    for (_bt, c), w in zip(members, widths, strict=True):
        cast.append((flat_t[offset : offset + S * rank * w].view(S, rank, w), c))
        offset += S * rank * w
    return A.reshape(S, n * rank, d).to(dtype), cast, col


def _table(
    gen: torch.Generator, T: int, k: int, pad: int, S: int, slot_base: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k distinct slot ids (some dropped to 0, some weights 0), `pad` zero columns."""
    ids = torch.stack([torch.randperm(S, generator=gen)[:k] for _ in range(T)]) + slot_base
    if slot_base == 0:
        ids = ids.clamp(min=1)  # id 0 of a zero-based buffer is the no-adapter slot
    weights = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    drop = torch.rand(T, k, generator=gen) < 0.1
    ids = torch.where(drop, torch.zeros((), dtype=torch.long), ids)
    weights = torch.where(torch.rand(T, k, generator=gen) < 0.05, 0.0, weights)
    return (
        torch.nn.functional.pad(ids, (0, pad)),
        torch.nn.functional.pad(weights, (0, pad)),
    )


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**16), T=st.integers(1, 40), k=st.sampled_from([1, 2]),
    pad=st.integers(0, 2), S=st.integers(2, 6), rank=st.sampled_from([1, 4, 8, 16]),
    d=st.sampled_from([7, 24, 40, 64]), widths=st.sampled_from([[64], [48, 16, 16], [70, 9]]),
    slot_base=st.sampled_from([0, 1]), dtypes=st.sampled_from([(F32, F32, F32),
    (BF16, BF16, BF16), (F32, BF16, F32), (BF16, F32, BF16)]), wide=st.booleans(),
    padded=st.booleans(),
)  # fmt: skip
def test_kernel_matches_twin(
    seed: int, T: int, k: int, pad: int, S: int, rank: int, d: int, widths: list[int],
    slot_base: int, dtypes: tuple, wide: bool, padded: bool,
) -> None:  # fmt: skip
    k = min(k, S - (slot_base == 0))
    gen = torch.Generator().manual_seed(seed)
    x_dtype, slot_dtype, y_dtype = dtypes
    real_rank = max(rank // 2, 1) if padded else rank
    A, members, D = _slots(gen, S, rank, d, widths, slot_dtype, real_rank)
    ids, weights = _table(gen, T, k, pad, S, slot_base)
    x = torch.randn(T, d, generator=gen).to(x_dtype)
    y0 = torch.randn(T, D, generator=gen).to(y_dtype)
    with torch.inference_mode():
        got = GroupedDelta(A, members, slot_base)(y0.clone(), x, ids, weights, allow_avx512=wide)
        want = topk_delta_reference(y0.clone(), x, A, members, ids, weights, slot_base)
    if y_dtype == F32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    else:  # both round an fp32 sum once: at most one bf16 step apart
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2**-7)
    untouched = torch.ones(D, dtype=torch.bool)
    for bt, col in members:
        untouched[col : col + bt.shape[2]] = False
    assert torch.equal(got[:, untouched], y0[:, untouched])  # columns of no member
    idle = ((ids > 0) & (weights != 0)).sum(1) == 0
    assert torch.equal(got[idle], y0[idle])  # a token without a slot keeps its row


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("wide", [True, False])
def test_one_token_and_its_batch_agree_bit_for_bit(dtype: torch.dtype, wide: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    A, members, D = _slots(gen, 5, 16, 576, [576, 192, 192], dtype, 16)
    ids, weights = _table(gen, 32, 2, 0, 5, 0)
    x = torch.randn(32, 576, generator=gen).to(dtype)
    y0 = torch.randn(32, D, generator=gen).to(dtype)
    delta = GroupedDelta(A, members)
    with torch.inference_mode():
        batch = delta(y0.clone(), x, ids, weights, allow_avx512=wide)
        for t in (0, 17, 31):
            alone = delta(
                y0[t : t + 1].clone(), x[t : t + 1], ids[t : t + 1], weights[t : t + 1],
                allow_avx512=wide,
            )  # fmt: skip
            assert torch.equal(alone, batch[t : t + 1])


@pytest.mark.parametrize("slot_base", [0, 1])
def test_out_of_range_ids_are_refused_and_nothing_is_written(slot_base: int) -> None:
    gen = torch.Generator().manual_seed(5)
    A, members, D = _slots(gen, 3, 4, 16, [8], F32, 4)
    delta = GroupedDelta(A, members, slot_base)
    x, y = torch.randn(2, 16, generator=gen), torch.randn(2, D, generator=gen)
    before = y.clone()
    ids = torch.tensor([[1], [3 + slot_base]])
    with torch.inference_mode(), pytest.raises(ValueError, match="outside"):
        delta(y, x, ids, torch.ones(2, 1))
    assert torch.equal(y, before)
    with pytest.raises(ValueError, match="outside"):
        topk_delta_reference(y, x, A, members, ids, torch.ones(2, 1), slot_base)
    with pytest.raises(ValueError, match="Bt must be"):
        GroupedDelta(A, [(members[0][0][:2], 0)])


def test_autograd_runs_the_twin_into_the_gate_weights() -> None:
    gen = torch.Generator().manual_seed(9)
    A, members, D = _slots(gen, 4, 4, 16, [8, 8], F32, 4)
    ids = torch.tensor([[1, 2], [3, 1]])
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6]], requires_grad=True)
    x = torch.randn(2, 16, generator=gen)
    out = GroupedDelta(A, members)(torch.zeros(2, D), x, ids, weights)
    out.sum().backward()
    assert weights.grad is not None and weights.grad.abs().sum() > 0


def test_other_dtypes_run_the_twin() -> None:
    gen = torch.Generator().manual_seed(2)
    A, members, D = _slots(gen, 3, 4, 16, [8], torch.float16, 4)
    delta = GroupedDelta(A, members)
    assert not delta.kernel
    x, y = torch.randn(2, 16, generator=gen).half(), torch.zeros(2, D, dtype=torch.float16)
    ids, weights = torch.tensor([[1], [2]]), torch.ones(2, 1)
    want = topk_delta_reference(y.clone(), x, A, members, ids, weights)
    assert torch.equal(delta(y, x, ids, weights), want) and want.abs().sum() > 0

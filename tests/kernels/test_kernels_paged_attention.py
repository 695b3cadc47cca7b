"""Paged decode attention: the twin equals dense attention over the un-paged K/V; the runtime's
CPU path (`paged_decode_tables`) and the Triton kernel (interpreted, few small cases: every program runs in Python)
equal the twin."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import paged_attention as paged_bench
from kernels.paged_attention import paged_decode_attention_reference, write_paged_kv
from kernels.paged_inputs import PagedDecodeInputs
from molora_runtime.model.paged_decode import paged_decode_tables
from tests.kernels.paged_cases import (
    PAGED_DTYPES,
    assert_paged_close,
    dense_attention,
    make_paged_case,
    paged_params,
    unpaged,
)


def _triton(inputs: PagedDecodeInputs) -> torch.Tensor:
    """The Triton kernel, imported after conftest set TRITON_INTERPRET=1."""
    from kernels.triton_paged_attention import paged_decode_attention_triton

    return paged_decode_attention_triton(inputs)


PATHS = {
    "cpu": paged_decode_tables,
    "reference": paged_decode_attention_reference,
    "triton": _triton,
}


@settings(max_examples=40, deadline=None)
@given(params=paged_params(max_b=4, max_len=40, dtypes=("fp32",)))
def test_twin_matches_dense_attention(params: dict) -> None:
    c = make_paged_case(**params)
    assert_paged_close(paged_decode_attention_reference(c), dense_attention(c))


@settings(max_examples=120, deadline=None)
@given(params=paged_params())
def test_cpu_path_matches_twin(params: dict) -> None:
    c = make_paged_case(**params)
    want = paged_decode_attention_reference(c)
    got = paged_decode_tables(c)
    assert_paged_close(got, want)
    assert not got[c.context_lens == 0].any(), "padding rows must be exactly zero"


@pytest.fixture(scope="module")
def triton_paged():
    """Imported here, after conftest set TRITON_INTERPRET=1."""
    from kernels import triton_paged_attention

    return triton_paged_attention


@settings(max_examples=12, deadline=None)
@given(
    params=paged_params(max_b=3, max_len=36, max_d=16),
    splits=st.sampled_from([None, 1, 2, 5]),
)
def test_triton_interpreted_matches_twin(triton_paged, params: dict, splits: int | None) -> None:
    """Direct and split-K launches (the merge kernel, empty splits past a short row's end)."""
    c = make_paged_case(**params)
    got = triton_paged.paged_decode_attention_triton(c, splits=splits)
    assert_paged_close(got, paged_decode_attention_reference(c))
    assert not got[c.context_lens == 0].any()


def test_triton_launch_choices(triton_paged) -> None:
    """Tiles stay within the register budget; splits fill the GPU only when rows are few."""
    assert triton_paged.launch_shape(3, 64) == (4, 32, 64)
    assert triton_paged.launch_shape(1, 8) == (1, 128, 8)
    assert triton_paged.launch_shape(8, 128) == (8, 16, 128)
    q = torch.zeros(1)
    assert triton_paged.choose_splits(q, 4, 4096, 32) == 1  # interpreter: 1 "SM"
    assert triton_paged.choose_splits(q, 1, 4096, 32) == 2
    assert triton_paged.choose_splits(q, 1, 64, 32) == 1  # too short to split


@pytest.mark.parametrize("block_size", [4, 16])
def test_triton_smollm_heads_exact_multiples(block_size: int) -> None:
    """SmolLM2's 9 query / 3 KV heads (non-power-of-two group), lengths 1 and n·block."""
    c = make_paged_case(3, [1, 2 * block_size, 3, 0, 70], kv_heads=3, group=3, head_dim=64,
                        block_size=block_size)  # fmt: skip
    want = paged_decode_attention_reference(c)
    assert_paged_close(_triton(c), want)
    from kernels.triton_paged_attention import paged_decode_attention_triton

    assert_paged_close(paged_decode_attention_triton(c, splits=3), want)


def test_strided_query_and_int64_tables() -> None:
    """A q view out of a fused qkv buffer and int64 tables/lengths give the same result."""
    c = make_paged_case(7, [5, 17, 9], kv_heads=2, group=2, head_dim=16, block_size=4)
    qkv = torch.zeros(3, 4 + 4, 16)
    qkv[:, :4] = c.q
    q = qkv[:, :4]
    want = paged_decode_attention_reference(c)
    bt, lens = c.block_tables.long(), c.context_lens.long()
    for backend in ("cpu", "triton"):
        got = PATHS[backend](replace(c, q=q, block_tables=bt, context_lens=lens))
        assert_paged_close(got, want)


def test_unpaged_helper_and_mixed_cache_dtype() -> None:
    """gather_paged_kv returns positions in order; a bf16 cache serves an fp32 query."""
    c = make_paged_case(1, [11], kv_heads=1, group=2, head_dim=8, block_size=4)
    k, _ = unpaged(c, 0)
    for p in range(11):
        assert torch.equal(k[0, p], c.k_cache[int(c.block_tables[0, p // 4]), 0, p % 4])
    kb, vb = c.k_cache.bfloat16(), c.v_cache.bfloat16()
    mixed = replace(c, k_cache=kb, v_cache=vb)
    want = paged_decode_attention_reference(mixed)
    assert want.dtype == torch.float32
    torch.testing.assert_close(paged_decode_tables(mixed), want, rtol=3e-2, atol=3e-2)
    got = _triton(mixed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", sorted(PAGED_DTYPES))
def test_all_padding_and_empty_batch(dtype: str) -> None:
    c = make_paged_case(0, [0, 0], kv_heads=2, group=1, head_dim=8, block_size=4,
                        dtype=PAGED_DTYPES[dtype])  # fmt: skip
    for path in PATHS.values():
        out = path(c)
        assert out.shape == c.q.shape and not out.any()
    e = make_paged_case(0, [], kv_heads=1, group=1, head_dim=8, block_size=4)
    assert paged_decode_tables(e).shape == (0, 1, 8)


@pytest.mark.parametrize("path", ["reference", "cpu", "triton"])
def test_bad_inputs(path: str) -> None:
    c = make_paged_case(0, [3], kv_heads=2, group=2, head_dim=8, block_size=4)
    with pytest.raises(ValueError, match="multiple"):
        PATHS[path](replace(c, q=c.q[:, :3]))
    with pytest.raises(ValueError, match="head dim"):
        PATHS[path](replace(c, q=c.q[..., :4]))


@given(st.integers(1, 3))
@settings(max_examples=3, deadline=None)
def test_scale_is_applied(mult: int) -> None:
    c = make_paged_case(4, [6, 9], kv_heads=1, group=3, head_dim=8, block_size=8)
    scaled = replace(c, scale=c.scale * mult)
    got = paged_decode_tables(scaled)
    assert_paged_close(got, paged_decode_attention_reference(scaled))


def test_benchmark_layouts_agree() -> None:
    """benchmarks/paged_attention.py's paged and contiguous copies hold the same K/V."""
    p = paged_bench._problem([5, 40, 17], torch.float32, torch.device("cpu"))
    outs = [fn(p, 0.125) for fn in paged_bench.PATHS.values()]
    for got in outs[1:]:
        torch.testing.assert_close(got, outs[0], rtol=1e-5, atol=1e-5)
    row = {"batch": 3, "paged_vs_span": 1.5, "paged_vs_sdpa": 0.5, "paged_gbps": 2.0}
    assert paged_bench.summarize([row])["paged_gbps_best_b3"] == 2.0


def test_write_then_attend_equals_dense() -> None:
    """Tokens written one by one through write_paged_kv are what decode attention reads."""
    g = torch.Generator().manual_seed(0)
    kvh, d, bs, n = 2, 8, 4, 11
    k_cache = torch.zeros(6, kvh, bs, d)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[4, 1, 5, 0]], dtype=torch.int32)
    keys, vals = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
    for p in range(n):
        slot = torch.tensor([int(table[0, p // bs]) * bs + p % bs])
        write_paged_kv(k_cache, keys[p : p + 1], slot)
        write_paged_kv(v_cache, vals[p : p + 1], slot)
    q = torch.randn(1, 4, d, generator=g)
    got = paged_decode_tables(PagedDecodeInputs(q, k_cache, v_cache, table, torch.tensor([n]), 0.3))
    kk, vv = (
        keys.transpose(0, 1).repeat_interleave(2, 0),
        vals.transpose(0, 1).repeat_interleave(2, 0),
    )
    want = torch.softmax(torch.einsum("hd,hld->hl", q[0], kk) * 0.3, -1)
    torch.testing.assert_close(got[0], torch.einsum("hl,hld->hd", want, vv), rtol=1e-5, atol=1e-5)

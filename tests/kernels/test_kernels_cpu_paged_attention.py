"""The CPU paged decode-attention kernel (`kernels.cpu_paged_attention`) equals its twin
(`paged_decode_attention_reference`) on scattered fp32 and bf16 caches, GQA groups, padded rows
and partial blocks, and refuses inputs that would make it read outside the cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings

from kernels import cpu_paged_attention as cpa
from kernels.paged_attention import paged_decode_attention_reference
from tests.kernels.paged_cases import assert_paged_close, make_paged_case, paged_params

pytestmark = pytest.mark.skipif(not cpa.available(), reason="the kernel does not build here")


@settings(max_examples=120, deadline=None)
@given(params=paged_params(dtypes=("bf16", "fp32")))
def test_kernel_matches_twin(params: dict) -> None:
    c = make_paged_case(**params)
    want = paged_decode_attention_reference(c)
    got = cpa.paged_decode(c)
    assert got.dtype == c.q.dtype and got.shape == c.q.shape
    assert_paged_close(got, want)
    assert not got[c.context_lens == 0].any(), "padding rows must be exactly zero"


@pytest.mark.parametrize("threads", [1, 2])
def test_smollm_heads_long_context_and_threads(threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        c = make_paged_case(3, [1, 16, 300, 0, 257], kv_heads=3, group=3, head_dim=64,
                            block_size=16, dtype=torch.bfloat16)  # fmt: skip
        assert_paged_close(cpa.paged_decode(c), paged_decode_attention_reference(c))
    finally:
        torch.set_num_threads(before)


def test_a_block_outside_the_cache_is_refused_even_after_an_in_place_edit() -> None:
    c = make_paged_case(1, [20, 5], kv_heads=1, group=2, head_dim=8, block_size=4)
    cpa.paged_decode(c)  # in bounds: passes, and is remembered
    c.block_tables[0, 1] = c.k_cache.shape[0]  # same tensor, edited: checked again
    with pytest.raises(ValueError, match="outside the cache"):
        cpa.paged_decode(c)
    c.block_tables[0, 1] = -1
    with pytest.raises(ValueError, match="outside the cache"):
        cpa.paged_decode(c)


def test_entries_past_a_length_are_never_read() -> None:
    c = make_paged_case(2, [5, 9], kv_heads=2, group=1, head_dim=8, block_size=4)
    want = paged_decode_attention_reference(c)
    tables = c.block_tables.clone()
    tables[0, 2:] = 10**6  # past sequence 0's two blocks: padding the kernel must not touch
    got = cpa.paged_decode(replace(c, block_tables=tables))
    assert_paged_close(got, want)


def test_bad_inputs_are_refused() -> None:
    c = make_paged_case(4, [6, 3], kv_heads=1, group=1, head_dim=8, block_size=4)
    too_long = c.context_lens.clone()
    too_long[0] = c.block_tables.shape[1] * 4 + 1
    with pytest.raises(ValueError, match="exceeds its block table"):
        cpa.paged_decode(replace(c, context_lens=too_long))
    half = c.k_cache.half()
    with pytest.raises(ValueError, match="fp32 or bf16"):
        cpa.paged_decode(replace(c, k_cache=half, v_cache=c.v_cache.half()))
    strided = c.k_cache.repeat(1, 1, 1, 2)[..., ::2]  # the same values, not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        cpa.paged_decode(replace(c, k_cache=strided, v_cache=strided))
    with pytest.raises(ValueError, match="batch mismatch"):
        cpa.paged_decode(replace(c, q=c.q[:1]))


def test_empty_batch() -> None:
    c = make_paged_case(5, [4], kv_heads=1, group=2, head_dim=8, block_size=4)
    empty = replace(c, q=c.q[:0], block_tables=c.block_tables[:0], context_lens=c.context_lens[:0])
    got = cpa.paged_decode(empty)
    assert got.shape == (0, 2, 8)

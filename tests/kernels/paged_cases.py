"""Random paged-KV decode problems: scattered block tables, padded rows, GQA, and a dense twin."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from kernels.paged_attention import gather_paged_kv
from kernels.paged_inputs import PagedDecodeInputs

PAGED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_paged_case(
    seed: int,
    lens: list[int],
    kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    extra_blocks: int = 2,
    pad_id: int = 0,
) -> PagedDecodeInputs:
    """Blocks are handed out in a random order (so tables are scattered, never contiguous);
    each table is padded to the widest sequence (+1 column) with `pad_id`."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + extra_blocks + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max([*need, 0]) + 1
    tables = torch.full((len(lens), width), pad_id, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[at : at + n], dtype=torch.int32)
        at += n
    H = kv_heads * group
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(len(lens), H, head_dim, generator=g).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return PagedDecodeInputs(q, k, v, tables, lens_t, head_dim**-0.5)


def dense_attention(c: PagedDecodeInputs) -> torch.Tensor:
    """Naive softmax attention over each sequence's un-paged K/V (built position by position)."""
    B, H, D = c.q.shape
    kvh, bs = c.k_cache.shape[1], c.k_cache.shape[2]
    group = H // kvh
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b, n in enumerate(c.context_lens.tolist()):
        for h in range(H):
            if n == 0:
                continue
            kv = h // group
            ks = torch.stack(
                [c.k_cache[int(c.block_tables[b, p // bs]), kv, p % bs] for p in range(n)]
            ).double()
            vs = torch.stack(
                [c.v_cache[int(c.block_tables[b, p // bs]), kv, p % bs] for p in range(n)]
            ).double()
            w = torch.softmax(ks @ c.q[b, h].double() * c.scale, dim=0)
            out[b, h] = w @ vs
    return out.to(c.q.dtype)


def unpaged(c: PagedDecodeInputs, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(c.context_lens[b])
    return gather_paged_kv(c.k_cache, c.block_tables[b], n), gather_paged_kv(
        c.v_cache, c.block_tables[b], n
    )


# (rtol, atol relative to 1 + max |out|): the torch path runs bf16/fp16 GEMMs (rounded scores
# and probabilities), the twin fp32 from the same inputs.
PAGED_TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def assert_paged_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol, atol = PAGED_TOLERANCES[got.dtype]
    scale = 1.0 + (float(want.float().abs().max()) if want.numel() else 0.0)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * scale)


@st.composite
def paged_params(
    draw: st.DrawFn, max_b: int = 6, max_len: int = 70, max_d: int = 40, dtypes: tuple = ()
) -> dict:
    """Lengths incl. 0 (padding rows), 1 and exact block multiples; block sizes 4/8/16; GQA 1-3."""
    block_size = draw(st.sampled_from([4, 8, 16]))
    length = st.one_of(
        st.integers(0, max_len),
        st.just(1),
        st.integers(1, max(1, max_len // block_size)).map(lambda n: n * block_size),
    )
    names = dtypes or tuple(sorted(PAGED_DTYPES))
    return {
        "seed": draw(st.integers(0, 2**31 - 1)),
        "lens": draw(st.lists(length, min_size=1, max_size=max_b)),
        "kv_heads": draw(st.integers(1, 3)),
        "group": draw(st.integers(1, 3)),
        "head_dim": draw(st.sampled_from([8, 16, 24, max_d])),
        "block_size": block_size,
        "dtype": PAGED_DTYPES[draw(st.sampled_from(names))],
        "pad_id": draw(st.sampled_from([0, 1])),
    }

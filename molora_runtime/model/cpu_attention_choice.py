"""Which CPU decode attention serves a KV-cache shape, decided by timing both on this CPU.

Two paths compute the same attention (`kernels.paged_attention` holds their twin): the C++
kernel reading blocks in place (`kernels.cpu_paged_attention`) and the PyTorch path that gathers
blocks into batched GEMMs (`paged_decode.gathered_decode`). Which is faster depends on the CPU
(native bf16 GEMMs or not, vector width) and the cache's dtype and head layout, so the first
decode of each shape has `kernels.chooser` time both at a few batch sizes, keep the winner for
the process and the table per machine kind, and log it once. `MOLORA_CPU_ATTENTION` (`kernel`,
`gathered`; default `auto`) forces one where it runs. This module only says what the two
candidates are and how one is timed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from kernels import chooser, cpu_paged_attention
from kernels.paged_inputs import PagedDecodeInputs

ATTENTION_ENV = "MOLORA_CPU_ATTENTION"
KINDS = ("kernel", "gathered")
BATCHES = (1, 8, 32)  # decode batch sizes timed
CONTEXT = 256  # context length of every timed sequence
# the decode attention's decision, kept per cache shape for the process
CHOOSER = chooser.Chooser(
    "CPU decode attention", ATTENTION_ENV, KINDS, unit="us per layer by batch", size="batch",
    logger=logging.getLogger(__name__),
)  # fmt: skip

# one layer's decode inputs -> out: the gathered PyTorch path
DecodeFn = Callable[[PagedDecodeInputs], torch.Tensor]


def forced_kind() -> str | None:
    """The kind `MOLORA_CPU_ATTENTION` forces, or None for `auto`; any other value is refused."""
    return CHOOSER.forced()


def shape_key(k_cache: torch.Tensor, heads: int) -> str:
    _, kv_heads, block_size, hd = k_cache.shape
    dtype = str(k_cache.dtype).removeprefix("torch.")
    return f"attention:{dtype}:heads={heads}/{kv_heads}:block={block_size}:hd={hd}:ctx={CONTEXT}"


def candidates(
    k_cache: torch.Tensor, heads: int, kinds: Sequence[str], gathered: DecodeFn
) -> dict[str, chooser.Candidate]:
    """Each kind as a `kernels.chooser` candidate: a decode of `b` random sequences of
    `CONTEXT` positions over a cache shaped like `k_cache` (scattered blocks)."""
    _, kv_heads, block_size, hd = k_cache.shape
    width = -(-CONTEXT // block_size)
    gen = torch.Generator().manual_seed(0)
    num_blocks = max(BATCHES) * width + 1
    shape = (num_blocks, kv_heads, block_size, hd)
    k = torch.randn(shape, generator=gen).to(k_cache.dtype)
    v = torch.randn(shape, generator=gen).to(k_cache.dtype)
    blocks = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    run: dict[str, DecodeFn] = {"kernel": cpu_paged_attention.paged_decode, "gathered": gathered}

    def candidate(kind: str) -> chooser.Candidate:
        def make(b: int) -> chooser.Runner:
            q = torch.randn(b, heads, hd, generator=gen).to(k_cache.dtype)
            tables = blocks[: b * width].view(b, width)
            lens = torch.full((b,), CONTEXT, dtype=torch.int32)
            inputs = PagedDecodeInputs(q, k, v, tables, lens, hd**-0.5)
            return lambda: run[kind](inputs)

        return make

    return {kind: candidate(kind) for kind in kinds}


def runnable_kinds(k_cache: torch.Tensor) -> list[str]:
    """The kinds that can serve `k_cache` here (the gathered path always can)."""
    kernel = (
        k_cache.device.type == "cpu"
        and k_cache.dtype in cpu_paged_attention.CACHE_DTYPES
        and cpu_paged_attention.available()
    )
    return ["kernel", "gathered"] if kernel else ["gathered"]


def choose(k_cache: torch.Tensor, heads: int, gathered: DecodeFn) -> str:
    """The kind that serves decodes over caches shaped like `k_cache` with `heads` query heads
    (`gathered`: the PyTorch path, over padded block tables)."""

    def measure(kinds: Sequence[str]) -> chooser.Table:
        with torch.no_grad():
            return chooser.measure(candidates(k_cache, heads, kinds, gathered), BATCHES)

    return CHOOSER.choose(shape_key(k_cache, heads), runnable_kinds(k_cache), measure)


def forget() -> None:
    """Drop this process's decisions (tests, or a forced kind changed in the environment)."""
    CHOOSER.forget()

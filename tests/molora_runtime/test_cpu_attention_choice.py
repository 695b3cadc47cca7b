"""CPU decode attention on the path measured faster per cache shape
(`model.cpu_attention_choice`): every path the runtime can take equals the twin; the choice
follows this machine's stored table, is measured and stored when there is none, a forced kind
is honoured and a misspelled one refused."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kernels import choice_cache, cpu_paged_attention
from kernels.cpu_extension_build import CACHE_ENV
from kernels.paged_attention import paged_decode_attention_reference
from kernels.paged_inputs import PagedDecodeInputs
from molora_runtime.model import cpu_attention_choice as choice
from molora_runtime.model.attention_meta import CacheAttention, decode_plan
from molora_runtime.model.paged_decode import paged_decode, paged_decode_tables

KERNEL = cpu_paged_attention.available()  # built (or found) in the user's cache, once


@pytest.fixture(autouse=True)
def fresh_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(choice.ATTENTION_ENV, raising=False)
    choice.forget()
    yield
    choice.forget()  # picks made on this test's rigged tables stay with it


def _problem(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    nb, kvh, bs, hd, group = 40, 3, 16, 64, 3
    lens = [1, 16, 70, 5, 33]  # the eager step has no padding rows
    k = torch.randn(nb, kvh, bs, hd, generator=g).to(dtype)
    v = torch.randn(nb, kvh, bs, hd, generator=g).to(dtype)
    q = torch.randn(len(lens), kvh * group, hd, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: len(lens) * 5].view(len(lens), 5).to(torch.int32)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def _meta(tables: torch.Tensor, lens: torch.Tensor, k: torch.Tensor) -> CacheAttention:
    """The eager step's metadata of these decodes (its gathered plan over the real blocks)."""
    rows = [tables[b, : -(-int(n) // k.shape[2])].tolist() for b, n in enumerate(lens)]
    kv = SimpleNamespace(block_size=k.shape[2], kv_heads=k.shape[1], scratch_block=0)
    return CacheAttention(
        positions=lens.long() - 1, slot_blocks=torch.zeros(0, dtype=torch.long),
        slot_offsets=torch.zeros(0, dtype=torch.long), num_decode=len(rows),
        prefill_segments=[], block_tables=tables, context_lens=lens,
        decode_plan=decode_plan(rows, lens.tolist(), kv, torch.device("cpu")),  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["kernel", "gathered"])
def test_every_path_equals_the_twin(
    dtype: torch.dtype, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kind == "kernel" and not KERNEL:
        pytest.skip("the kernel does not build here")
    monkeypatch.setenv(choice.ATTENTION_ENV, kind)
    q, k, v, tables, lens = _problem(dtype)
    inputs = PagedDecodeInputs(q, k, v, tables, lens, 0.125)
    want = paged_decode_attention_reference(inputs)
    got = paged_decode(inputs, _meta(tables, lens, k))
    assert choice.choose(k, q.shape[1], paged_decode_tables) == kind
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.skipif(not KERNEL, reason="the kernel does not build here")
@pytest.mark.parametrize("faster", ["kernel", "gathered"])
def test_the_stored_table_decides(faster: str, caplog: pytest.LogCaptureFixture) -> None:
    _, k, *_ = _problem(torch.bfloat16)
    slow = {b: 1e-3 for b in choice.BATCHES}
    quick = {b: 1e-4 for b in choice.BATCHES}
    other = "gathered" if faster == "kernel" else "kernel"
    choice_cache.store(choice.shape_key(k, 9), {faster: quick, other: slow})
    with caplog.at_level(logging.INFO, logger=choice.__name__):
        assert choice.choose(k, 9, paged_decode_tables) == faster
    assert "(stored" in caplog.text and faster in caplog.text


@pytest.mark.skipif(not KERNEL, reason="the kernel does not build here")
def test_a_shape_without_a_table_is_measured_and_stored() -> None:
    _, k, *_ = _problem(torch.float32)
    key = choice.shape_key(k, 9)
    assert choice_cache.load(key) is None
    kind = choice.choose(k, 9, paged_decode_tables)
    table = choice_cache.load(key)
    assert table is not None and set(table) == {"kernel", "gathered"}
    assert all(set(times) == set(choice.BATCHES) for times in table.values())
    assert kind in table
    choice.forget()
    assert choice.choose(k, 9, paged_decode_tables) == kind  # from the store, not re-timed


def test_a_forced_kind_that_cannot_run_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(choice.ATTENTION_ENV, "kernel")
    k = torch.zeros(4, 1, 4, 8, dtype=torch.float16)  # the kernel takes fp32 and bf16 caches
    assert choice.choose(k, 2, paged_decode_tables) == "gathered"


def test_a_misspelled_forced_kind_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(choice.ATTENTION_ENV, "fused")
    with pytest.raises(ValueError, match="MOLORA_CPU_ATTENTION"):
        choice.choose(torch.zeros(4, 1, 4, 8), 2, paged_decode_tables)

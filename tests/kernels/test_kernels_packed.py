"""The packed stacked backend equals its twin, the plain stacked backend (`kernels.stacked`),
over random shapes; packed copies follow every write to the slot buffers. The CPU backend is
picked once by the chooser: among the stacked candidates, stored per probe shape, forced by
`MOLORA_CPU_LORA`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import choice_cache, chooser, cpu_topk_delta
from kernels.cpu_extension_build import CACHE_ENV
from molora_runtime.model import cpu_lora_choice
from molora_runtime.model.cpu_lora import GroupedLoRA, PackedLoRA, StackedLoRA
from molora_runtime.model.lora_backend import choose_backend
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.model.packed_linear import pack_weight
from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers
from tests.kernels.kernel_cases import TOLERANCES

BF16 = torch.bfloat16
CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    pack_weight(torch.zeros(8, 8, dtype=BF16)) is None,
    reason="no bf16 packing (panels or oneDNN) here",
)
PLAIN, PACKED = StackedLoRA(), PackedLoRA()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to bf16 rounding (both sides are bf16 GEMMs, accumulated in another order)."""
    rtol, atol = TOLERANCES[BF16]
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * (1.0 + scale))


def _buffers(S: int, L: int, r: int, d_in: int, d_out: int, seed: int) -> LoRABuffers:
    g = torch.Generator().manual_seed(seed)
    buf = LoRABuffers.allocate(S, L, r, d_in, d_out, BF16, CPU, stacked=True)
    for slot in range(1, S):
        for layer in range(L):
            a = (torch.randn(r, d_in, generator=g) / d_in**0.5).to(BF16)
            b = (torch.randn(d_out, r, generator=g) / r**0.5).to(BF16)
            buf.write(slot, layer, a, b)
    return buf


def _ctx(T: int, S: int, seed: int, first: int, count: int) -> LoRAContext:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, S, (T, 2), generator=g)
    return LoRAContext(ids, torch.rand(T, 2, generator=g), PLAIN, stacked_slots=(first, count))


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 40),
    S=st.integers(2, 6),
    r=st.sampled_from([1, 4, 8, 16]),
    d_in=st.integers(8, 160),
    d_out=st.integers(8, 200),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_packed_matches_stacked_over_a_slot_range(
    T: int, S: int, r: int, d_in: int, d_out: int, seed: int, data: st.DataObject
) -> None:
    buf = _buffers(S, 2, r, d_in, d_out, seed)
    first = data.draw(st.integers(1, S - 1))
    count = data.draw(st.integers(1, S - first))
    ctx = _ctx(T, S, seed, first, count)
    x = torch.randn(T, d_in, generator=torch.Generator().manual_seed(seed + 1)).to(BF16)
    base = torch.randn(T, d_out, generator=torch.Generator().manual_seed(seed + 2)).to(BF16)
    with torch.inference_mode():
        want = PLAIN.add(base.clone(), x, buf, 1, ctx)
        got = PACKED.add(base.clone(), x, buf, 1, ctx)
    _close(got, want)


def test_packed_copies_follow_writes_and_clears() -> None:
    S, r, d_in, d_out, T = 4, 8, 64, 96, 6
    buf = _buffers(S, 1, r, d_in, d_out, seed=3)
    ctx = _ctx(T, S, 4, 1, S - 1)
    ctx.slot_ids[:, 0] = 2  # every token uses slot 2
    x = torch.randn(T, d_in).to(BF16)

    def delta(backend: StackedLoRA) -> torch.Tensor:
        return backend.add(torch.zeros(T, d_out, dtype=BF16), x, buf, 0, ctx).float()

    with torch.inference_mode():
        first = delta(PACKED)
        _close(first, delta(PLAIN))
        buf.write(2, 0, torch.ones(r, d_in, dtype=BF16), torch.ones(d_out, r, dtype=BF16))
        after_write = delta(PACKED)
        assert not torch.allclose(after_write, first)
        _close(after_write, delta(PLAIN))
        for slot in range(1, S):
            buf.clear_slot(slot)
        assert not delta(PACKED).any()  # cleared slots: no delta, not a stale packed copy


def test_group_members_writes_reach_the_groups_packed_copies() -> None:
    # A fused group's members write through views of the group's tensors; the group's packed
    # copies must see those writes (views share their base's version counter).
    group = GroupBuffers.stacked_group(3, 1, 4, 32, [16, 8], [True, True], BF16, CPU)
    x = torch.randn(5, 32).to(BF16)
    ctx = LoRAContext(torch.full((5, 1), 1), torch.ones(5, 1), PACKED, stacked_slots=(1, 2))

    def delta() -> torch.Tensor:
        return ctx.add_lora(torch.zeros(5, 24, dtype=BF16), x, group, 0).float()

    with torch.inference_mode():
        assert not delta().any()
        member = group.members[1]
        assert member is not None
        member.write(1, 0, torch.ones(4, 32, dtype=BF16), torch.ones(8, 4, dtype=BF16))
        got = delta()
        assert not got[:, :16].any() and got[:, 16:].abs().min() > 0


def test_cpu_backend_is_one_of_the_stacked_candidates() -> None:
    group = GroupBuffers.stacked_group(5, 1, 8, 64, [64, 32, 32], [True] * 3, BF16, CPU)
    chosen = choose_backend(CPU, group)
    names = ("stacked", "stacked-packed", *(("grouped",) if cpu_topk_delta.available() else ()))
    assert isinstance(chosen, StackedLoRA) and chosen.name in names
    assert isinstance(chosen, GroupedLoRA) == (chosen.name == "grouped")
    # where the grouped kernel runs, every CPU backend hands it the learned tables
    assert (chosen.grouped is not None) == cpu_topk_delta.available()
    assert choose_backend(torch.device("meta")).name == "reference"


def test_the_cpu_choice_is_measured_once_stored_and_can_be_forced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_lora_choice.LORA_ENV, raising=False)
    cpu_lora_choice.CHOOSER.forget()
    group = GroupBuffers.stacked_group(5, 1, 8, 64, [64, 32], [True, True], BF16, CPU, 1)
    key = cpu_lora_choice.probe_key(group)
    assert choice_cache.load(key) is None
    chosen = choose_backend(CPU, group)
    table = choice_cache.load(key)
    assert table is not None and set(table) == set(cpu_lora_choice.backends())
    assert chosen.name == chooser.pick(table)
    rigged = {name: {cpu_lora_choice.PROBE_TOKENS: 1e-3} for name in table}
    rigged["stacked-packed"] = {cpu_lora_choice.PROBE_TOKENS: 1e-6}
    choice_cache.store(key, rigged)
    cpu_lora_choice.CHOOSER.forget()  # a new process: the store decides, nothing is timed
    assert type(choose_backend(CPU, group)) is PackedLoRA
    monkeypatch.setenv(cpu_lora_choice.LORA_ENV, "stacked")
    assert type(choose_backend(CPU, group)) is StackedLoRA
    monkeypatch.setenv(cpu_lora_choice.LORA_ENV, "fastest")
    with pytest.raises(ValueError, match="MOLORA_CPU_LORA='fastest'"):
        choose_backend(CPU, group)
    cpu_lora_choice.CHOOSER.forget()

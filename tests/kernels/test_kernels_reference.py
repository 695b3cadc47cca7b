"""Every PyTorch reference variant and the CPU dispatch equal the dense definition."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from kernel_cases import assert_matches, case_params, make_case

import kernels
from kernels import dispatch
from kernels.reference import REFERENCE_VARIANTS, routed_lora_dense

VARIANTS = sorted(set(REFERENCE_VARIANTS) - {"dense"})
REPO = Path(__file__).resolve().parents[2]


@settings(max_examples=60, deadline=None)
@given(params=case_params(max_t=24, max_d=96, max_r=32))
def test_reference_variants_match_dense(params: dict) -> None:
    c = make_case(**params)
    want = routed_lora_dense(c.x, c.A, c.B, c.slot_ids, c.weights)
    for name in VARIANTS:
        got = REFERENCE_VARIANTS[name](c.x, c.A, c.B, c.slot_ids, c.weights)
        assert_matches(got, want)


def test_dense_definition_by_hand() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    A = torch.zeros(3, 1, 2)
    A[1, 0] = torch.tensor([1.0, 0.0])  # picks x[:, 0]
    A[2, 0] = torch.tensor([0.0, 1.0])  # picks x[:, 1]
    A[0, 0] = torch.tensor([9.0, 9.0])  # slot 0 must be ignored even if non-zero
    B = torch.ones(3, 2, 1)
    ids = torch.tensor([[1, 2], [0, 2], [-1, 1]])
    w = torch.tensor([[0.5, 2.0], [3.0, 1.0], [7.0, -1.0]])
    want = torch.tensor([[4.5, 4.5], [4.0, 4.0], [-5.0, -5.0]])
    for name, fn in REFERENCE_VARIANTS.items():
        torch.testing.assert_close(fn(x, A, B, ids, w), want, msg=name)


@pytest.mark.parametrize("name", sorted(REFERENCE_VARIANTS))
def test_all_empty_and_zero_tokens(name: str) -> None:
    fn = REFERENCE_VARIANTS[name]
    c = make_case(0, T=5, k=2, S=3, r=4, d_in=8, d_out=6, pattern="empty")
    assert torch.equal(fn(c.x, c.A, c.B, c.slot_ids, c.weights), torch.zeros(5, 6))
    c0 = make_case(0, T=0, k=2, S=3, r=4, d_in=8, d_out=6)
    assert fn(c0.x, c0.A, c0.B, c0.slot_ids, c0.weights).shape == (0, 6)


@pytest.mark.parametrize("T", [3, dispatch.CPU_ONEHOT_MAX_T, dispatch.CPU_ONEHOT_MAX_T + 5])
@pytest.mark.parametrize("name", ["auto", *VARIANTS])
def test_gradients_match_dense(T: int, name: str) -> None:
    """Learned-router training backpropagates through the op into the gate weights (and x)."""
    c = make_case(7, T=T, k=2, S=4, r=4, d_in=16, d_out=12, pattern="random")
    g = torch.randn(T, 12, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (
        routed_lora_dense,
        kernels.routed_lora if name == "auto" else REFERENCE_VARIANTS[name],
    ):
        x = c.x.clone().requires_grad_()
        w = c.weights.clone().requires_grad_()
        (fn(x, c.A, c.B, c.slot_ids, w) * g).sum().backward()
        grads.append((w.grad, x.grad))
    (wd, xd), (wg, xg) = grads
    torch.testing.assert_close(wg, wd, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xg, xd, rtol=1e-4, atol=1e-5)
    # inactive pairs get exactly zero gradient
    assert torch.all(wg[c.slot_ids <= 0] == 0)


def test_cpu_dispatch_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    few, many = 5, dispatch.CPU_ONEHOT_MAX_SLOTS + 1

    def pick(T: int, slots: int, backend: str | None = None) -> str:
        return dispatch.select_backend(torch.zeros(T, 4), slots, (), backend)

    assert pick(1, many) == pick(dispatch.CPU_MASKED_MAX_T, few) == "masked"
    assert pick(dispatch.CPU_MASKED_MAX_T + 1, few) == "onehot"
    assert pick(dispatch.CPU_ONEHOT_MAX_T, few) == "onehot"
    assert pick(dispatch.CPU_MASKED_MAX_T + 1, many) == "segmented"
    assert pick(dispatch.CPU_ONEHOT_MAX_T + 1, few) == "segmented"
    assert pick(3, few, "gather") == "gather"
    monkeypatch.setenv(dispatch.BACKEND_ENV, "onehot")
    assert pick(300, many) == "onehot"
    with pytest.raises(ValueError, match="unknown routed-LoRA backend"):
        pick(3, few, "nope")


@pytest.mark.parametrize("T", [4, dispatch.CPU_ONEHOT_MAX_T + 3])
def test_multi_output_equals_single_calls(T: int) -> None:
    c = make_case(3, T=T, k=2, S=4, r=4, d_in=16, d_out=12)
    c2 = make_case(4, T=T, k=2, S=4, r=4, d_in=16, d_out=5)
    outs = kernels.routed_lora_multi(c.x, [(c.A, c.B), (c2.A, c2.B)], c.slot_ids, c.weights)
    for (A, B), got in zip([(c.A, c.B), (c2.A, c2.B)], outs, strict=True):
        assert_matches(got, routed_lora_dense(c.x, A, B, c.slot_ids, c.weights))


def test_importing_kernels_does_not_import_triton() -> None:
    code = (
        "import sys, torch, kernels\n"
        "x = torch.randn(3, 8); A = torch.randn(2, 2, 8); B = torch.randn(2, 4, 2)\n"
        "ids = torch.tensor([[1], [0], [1]]); w = torch.ones(3, 1)\n"
        "kernels.routed_lora(x, A, B, ids, w); kernels.routed_lora_multi(x, [(A, B)], ids, w)\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != dispatch.BACKEND_ENV}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=120)

"""Every PyTorch reference twin equals the dense definition, values and gradients."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from kernels.reference import REFERENCE_VARIANTS, routed_lora_dense
from tests.kernels.kernel_cases import assert_matches, case_params, make_case

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


@pytest.mark.parametrize("T", [3, 40])
@pytest.mark.parametrize("name", VARIANTS)
def test_gradients_match_dense(T: int, name: str) -> None:
    """Learned-router training backpropagates through the op into the gate weights (and x)."""
    c = make_case(7, T=T, k=2, S=4, r=4, d_in=16, d_out=12, pattern="random")
    g = torch.randn(T, 12, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (routed_lora_dense, REFERENCE_VARIANTS[name]):
        x = c.x.clone().requires_grad_()
        w = c.weights.clone().requires_grad_()
        (fn(x, c.A, c.B, c.slot_ids, w) * g).sum().backward()
        grads.append((w.grad, x.grad))
    (wd, xd), (wg, xg) = grads
    torch.testing.assert_close(wg, wd, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xg, xd, rtol=1e-4, atol=1e-5)
    # inactive pairs get exactly zero gradient
    assert torch.all(wg[c.slot_ids <= 0] == 0)


def test_segmented_never_reads_a_slot_a_row_does_not_use() -> None:
    """A slot of Inf touches only the rows routed to it (the select the backend relies on)."""
    c = make_case(5, T=6, k=2, S=4, r=4, d_in=16, d_out=12, pattern="random")
    ids = torch.tensor([[1, 0], [2, 1], [0, 0], [3, 0], [1, 2], [2, 0]])
    A, B = c.A.clone(), c.B.clone()
    A[3].fill_(float("inf"))
    B[3].fill_(float("inf"))
    got = REFERENCE_VARIANTS["segmented"](c.x, A, B, ids, c.weights)
    want = REFERENCE_VARIANTS["segmented"](c.x, c.A, c.B, ids, c.weights)
    clean = (ids != 3).all(dim=1)
    assert torch.equal(got[clean], want[clean])
    assert not torch.isfinite(got[~clean]).all()


def test_importing_kernels_does_not_import_triton() -> None:
    code = (
        "import sys, torch, kernels, kernels.stacked, kernels.paged_attention\n"
        "x = torch.randn(3, 8); A = torch.randn(2, 2, 8); B = torch.randn(2, 4, 2)\n"
        "ids = torch.tensor([[1], [0], [1]]); w = torch.ones(3, 1)\n"
        "kernels.routed_lora_dense(x, A, B, ids, w)\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)

"""`answer_loss(per_example=True)`: each example's answer weighs the same, however long it is."""

from __future__ import annotations

import math

import pytest
import torch

from molora_runtime.multimodal.digits import parse_mixture
from molora_runtime.training.batching import IGNORE, answer_loss


def _setup():
    """Identity head over 4 'vocab' logits; row 0 supervises 1 token, row 1 supervises 3."""
    head = torch.nn.Identity()
    hidden = torch.zeros(2, 4, 4)
    hidden[0, 0] = torch.tensor([0.0, 5.0, 0.0, 0.0])  # row 0: label 0 is hard
    hidden[1, :3, 2] = 5.0  # row 1: label 2 is easy
    labels = torch.full((2, 4), IGNORE)
    labels[0, 0] = 0
    labels[1, :3] = 2
    return hidden, head, labels


def test_per_example_is_mean_of_row_means() -> None:
    hidden, head, labels = _setup()
    ce = torch.nn.functional.cross_entropy
    row0 = ce(hidden[0, :1], labels[0, :1])
    row1 = ce(hidden[1, :3], labels[1, :3])
    got = answer_loss(hidden, head, labels, per_example=True)
    assert math.isclose(float(got), float((row0 + row1) / 2), rel_tol=1e-6)


def test_default_is_token_mean_where_long_rows_dominate() -> None:
    hidden, head, labels = _setup()
    token = answer_loss(hidden, head, labels)
    flat = torch.nn.functional.cross_entropy(hidden[labels != IGNORE], labels[labels != IGNORE])
    assert math.isclose(float(token), float(flat), rel_tol=1e-6)
    assert float(answer_loss(hidden, head, labels, per_example=True)) > float(token)


def test_rows_without_labels_are_skipped() -> None:
    hidden, head, labels = _setup()
    hidden = torch.cat([hidden, torch.zeros(1, 4, 4)])
    labels = torch.cat([labels, torch.full((1, 4), IGNORE)])
    two = answer_loss(hidden[:2], head, labels[:2], per_example=True)
    assert math.isclose(float(answer_loss(hidden, head, labels, per_example=True)), float(two))


def test_per_example_gradient_flows() -> None:
    hidden, head, labels = _setup()
    hidden.requires_grad_(True)
    answer_loss(hidden, head, labels, per_example=True).backward()
    assert hidden.grad is not None and float(hidden.grad.abs().sum()) > 0


def test_parse_mixture() -> None:
    assert parse_mixture("read=0.85,mixed=0.15") == {"read": 0.85, "mixed": 0.15}
    with pytest.raises(ValueError):
        parse_mixture("read=0.5")
    with pytest.raises(ValueError):
        parse_mixture("write=1.0")

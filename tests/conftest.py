"""Shared fixtures: a small model, its data, one batch."""

from __future__ import annotations

import pytest

import parallelkit as pk


@pytest.fixture(scope="session")
def digits():
    return pk.data.digits()


@pytest.fixture(scope="session")
def mlp(digits):
    """(loss_fn, params) of the small MLP on digits."""
    apply, params = pk.models.build("mlp", digits.input_shape, digits.num_classes)
    return pk.models.classifier_loss(apply), params


@pytest.fixture
def batch(digits):
    """One global batch of 64 host arrays."""
    return next(pk.data.batches(digits, 64, steps=1))

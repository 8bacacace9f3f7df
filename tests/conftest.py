"""Shared fixtures: a small model, its data, one batch; whether a browser test can run."""

from __future__ import annotations

import os

import pytest
from helpers import browser_missing

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


@pytest.fixture(scope="session")
def browser_ready():
    """Skip a browser test where chromium or Playwright is missing; fail instead under PK_REQUIRE_BROWSER=1."""
    reason = browser_missing()
    if reason and os.environ.get("PK_REQUIRE_BROWSER") == "1":
        pytest.fail(f"PK_REQUIRE_BROWSER=1 but the browser test cannot run: {reason}", pytrace=False)
    if reason:
        pytest.skip(reason)

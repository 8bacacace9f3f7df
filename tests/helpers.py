"""Test helpers: fresh processes with their own device count, tree comparison, recompilation check, docs sections."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import parallelkit as pk

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))  # the course, in order

# The equivalence tolerance for float32, fixed by the foundation issue.
RTOL, ATOL = 1e-5, 1e-6

# Debian's chromium, driven by Playwright (executable_path: no browser download).
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def heading_anchor(heading: str) -> str:
    """A Markdown heading's anchor as GitHub and the static course write it: lower case, punctuation dropped,
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("# ").lower()).replace(" ", "-")


def docs_section(page: Path, anchor: str) -> str:
    """The text of ``page``'s ``## `` section whose heading has ``anchor``, heading included, up to the next one."""
    for part in page.read_text().split("\n## ")[1:]:
        if heading_anchor(part.split("\n", 1)[0]) == anchor:
            return "## " + part
    raise AssertionError(f"{page.relative_to(ROOT)} has no section #{anchor}")


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install -e '.[dev]' (never `playwright install`)"
    return None


def run_python(
    code: str, *, devices: int | None = None, timeout: float = 300, args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python process (its own JAX, its own device count).

    With ``devices``, the child calls ``pk.simulate_devices(devices)`` before ``code``.
    """
    prelude = f"import parallelkit as pk; pk.simulate_devices({devices})\n" if devices else ""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-c", prelude + code, *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, check=False,
    )  # fmt: skip


def tree_allclose(actual, expected, rtol: float = RTOL, atol: float = ATOL, err_msg: str = "") -> None:
    """Assert two trees have the same structure and allclose leaves."""
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol, err_msg=err_msg),
        actual,
        expected,
    )


def assert_steps_compile_once(strategy, loss_fn, params, dataset) -> None:
    """The first step compiles; the second and third (same shapes) compile nothing."""
    import optax

    import parallelkit as pk

    step, state = strategy.step(loss_fn), strategy.init(params, optax.adam(1e-3))
    first, second, third = pk.data.batches(dataset, 64, steps=3)
    with pk.inspect.count_compilations() as compiles:
        state, _ = step(state, first)
        jax.block_until_ready(state)
    assert len(compiles) >= 1
    with pk.inspect.count_compilations() as compiles:
        state, _ = step(state, second)
        state, _ = step(state, third)
        jax.block_until_ready(state)
    assert compiles == []


def small_gpt(length: int, *, dim: int = 32, depth: int = 2, dropout: float = 0.0) -> tuple:
    """(loss_fn, params) of a small byte-level GPT (4 heads, MLP width 64) for sequences of ``length`` tokens."""
    model = pk.models.GPT(256, max_length=length, dim=dim, heads=4, depth=depth, mlp_dim=64, dropout=dropout,
                          rngs=nnx.Rngs(0))  # fmt: skip
    apply, params = pk.models.functional(model)
    return pk.models.lm_loss(apply), params

"""Every strategy reproduces SingleDevice: Mirrored (both backends), CentralStorage, ParameterServer,
TensorParallel, FullySharded (ZeRO 1-3), Hybrid and Pipeline.

On 1, 2, 4 and 8 devices (TensorParallel on 2, 4 and 8, over all of them).

Each device count runs in its own process (tests/equivalence_worker.py); every
case starts from the same parameters and data. Tolerance: float32, rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from equivalence_worker import (
    MODELS,
    PIPELINE_DEVICES,
    PIPELINE_MODELS,
    PIPELINE_RUNS,
    PS_SHARDS,
    TENSOR_MODELS,
    optimizers,
    sharded_names,
)
from helpers import ATOL, ROOT, RTOL

DEVICE_COUNTS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[int, dict[str, np.ndarray]]:
    """Parameters after training, per device count; the worker processes run concurrently."""
    out = tmp_path_factory.mktemp("equivalence")
    procs = {
        n: subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "equivalence_worker.py"), str(n), str(out / f"{n}.npz")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        for n in DEVICE_COUNTS
    }
    results = {}
    for n, proc in procs.items():
        _, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"worker with {n} devices failed:\n{stderr[-3000:]}"
        with np.load(out / f"{n}.npz") as f:
            results[n] = dict(f)
    return results


def assert_equals_single_device(params: dict[str, np.ndarray], model: str, optimizer: str, name: str) -> None:
    """Strategy ``name``'s trained parameters equal SingleDevice's, and training moved them."""
    prefix = f"{model}|{optimizer}|"
    reference = {k.split("|")[3]: v for k, v in params.items() if k.startswith(prefix + "single|")}
    candidate = {k.split("|")[3]: v for k, v in params.items() if k.startswith(f"{prefix}{name}|")}
    assert reference and candidate.keys() == reference.keys()
    for path, expected in reference.items():
        np.testing.assert_allclose(candidate[path], expected, rtol=RTOL, atol=ATOL, err_msg=path)
    # The comparison means something only if training moved the parameters.
    moved = [not np.allclose(v, params[f"{model}|-|init|{p}"]) for p, v in reference.items()]
    assert all(moved), "a parameter did not change during training"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jit", "pmap"])
@pytest.mark.parametrize("model, optimizer", [(m, o) for m in MODELS for o in optimizers(m)])
@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_mirrored_equals_single_device(devices, model, optimizer, backend, trained):
    assert_equals_single_device(trained[devices], model, optimizer, backend)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["central", *(f"ps{k}" for k in PS_SHARDS)])
@pytest.mark.parametrize("model, optimizer", [(m, o) for m in MODELS for o in optimizers(m)])
@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_off_device_state_equals_single_device(devices, model, optimizer, name, trained):
    """CentralStorage and ParameterServer(sync, 1/2/3 shards): state off the compute devices, same parameters."""
    assert_equals_single_device(trained[devices], model, optimizer, name)


@pytest.mark.slow
@pytest.mark.parametrize("model, optimizer", [(m, o) for m in TENSOR_MODELS for o in optimizers(m)])
@pytest.mark.parametrize("devices", [n for n in DEVICE_COUNTS if n > 1])
def test_tensor_parallel_equals_single_device(devices, model, optimizer, trained):
    """Megatron-split MLPs (one block; two blocks) and the transformer (heads split, dropout on) with the
    weights over all devices: same parameters."""
    assert_equals_single_device(trained[devices], model, optimizer, "tensor")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jit", "multiworker"])
@pytest.mark.parametrize("optimizer", list(optimizers("transformer")))
@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_jit_strategies_with_dropout_equal_single_device(devices, optimizer, name, trained):
    """The transformer with dropout: under jit the key draws the masks for the global batch, as on one device.
    (pmap, CentralStorage and ParameterServer draw per replica: see test_model_state.py.)"""
    assert_equals_single_device(trained[devices], "transformer", optimizer, name)


SHARDED_CASES = [(n, name) for n in DEVICE_COUNTS for name in sharded_names(n)]


@pytest.mark.slow
@pytest.mark.parametrize("model, optimizer", [(m, o) for m in ("mlp", "transformer") for o in optimizers(m)])
@pytest.mark.parametrize("devices, name", SHARDED_CASES)
def test_fully_sharded_and_hybrid_equal_single_device(devices, name, model, optimizer, trained):
    """ZeRO stages 1-3 over 2, 4 and 8 devices; Hybrid 2x2, 4x2 and 2x4 (the transformer with dropout)."""
    assert_equals_single_device(trained[devices], model, optimizer, name)


@pytest.mark.slow
@pytest.mark.parametrize("model, optimizer", [(m, o) for m in PIPELINE_MODELS for o in optimizers(m)])
@pytest.mark.parametrize("name", [run[0] for run in PIPELINE_RUNS])
def test_pipeline_equals_single_device(name, model, optimizer, trained):
    """2 and 4 stages; 1, 4 and 8 microbatches; GPipe and 1F1B; stages x data 2 x 2: the MLP and the
    transformer as layers (pk.models.as_layers), against SingleDevice on pk.pipeline.sequential_loss."""
    assert_equals_single_device(trained[PIPELINE_DEVICES], f"pipe_{model}", optimizer, name)

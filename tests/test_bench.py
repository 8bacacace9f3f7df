"""`python -m parallelkit bench --quick`: valid JSON with every strategy, a PNG, honest ratios."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT

from parallelkit.bench import parse_layouts


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "parallelkit", "bench", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout


def test_quick_mode_writes_valid_json_with_every_strategy(quick):
    out, stdout = quick
    result = json.loads(out.read_text())
    names = {r["strategy"] for r in result["rows"]}
    assert names == {
        "SingleDevice", "Mirrored(jit)", "Mirrored(pmap)", "Mirrored(ring)", "CentralStorage", "PS(2 shards)",
        "TensorParallel", "FullySharded(3)", "Hybrid(data x 2)", "Pipeline(2 stages)", "MultiWorkerMirrored",
    }  # fmt: skip
    assert result["devices"] == [1, 4] and result["processes"] == [[2, 2]]
    assert result["mode"] == "shared cores" and result["jax"]
    for row in result["rows"]:
        assert row["median_step_ms"] > 0 and row["compile_s"] > 0
        assert row["samples_per_s"] == pytest.approx(row["global_batch"] / row["median_step_ms"] * 1e3)
        assert row["p10_step_ms"] <= row["median_step_ms"] <= row["p90_step_ms"]
    distributed = [r for r in result["rows"] if r["processes"] > 1]
    assert [(r["devices"], r["processes"]) for r in distributed] == [(4, 2)]
    assert "MultiWorkerMirrored" in stdout and out.with_suffix(".png").stat().st_size > 0


def test_ratios_use_single_device_on_the_same_batch_and_params_agree(quick):
    rows = json.loads(quick[0].read_text())["rows"]
    single = {r["devices"]: r for r in rows if r["strategy"] == "SingleDevice"}
    for row in rows:
        reference = single[row["devices"]]
        assert row["global_batch"] == reference["global_batch"]
        assert row["speedup"] == pytest.approx(reference["median_step_ms"] / row["median_step_ms"])
        if row["max_param_diff"] is not None:  # checked in the child: rtol 1e-5, atol 1e-6 on every parameter
            assert row["equals_single"] is True, row
    measured = [r for r in rows if r["bytes_per_step"] is not None]
    assert {r["strategy"] for r in measured} >= {"Mirrored(jit)", "CentralStorage", "FullySharded(3)"}


def test_bad_layouts_are_refused():
    assert parse_layouts("2x2 4x1") == [(2, 2), (4, 1)]
    assert parse_layouts("none") == []
    for bad in ("1x2", "2by2", "2x0"):
        with pytest.raises(SystemExit, match="PxD"):
            parse_layouts(bad)

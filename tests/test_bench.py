"""`python -m parallelkit bench --quick`: valid JSON with every strategy, a PNG, honest ratios, every row checked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT

from parallelkit.course.bench import add_ratios, format_table, parse_layouts, unequal_rows, yardsticks


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
    assert result["yardsticks"] == yardsticks(cores_as_devices=False)
    assert result["command"] == f"python -m parallelkit bench --quick --out {out}"
    for row in result["rows"]:
        assert row["median_step_ms"] > 0 and row["compile_s"] > 0
        assert row["samples_per_s"] == pytest.approx(row["global_batch"] / row["median_step_ms"] * 1e3)
        assert row["p10_step_ms"] <= row["median_step_ms"] <= row["p90_step_ms"]
    distributed = [r for r in result["rows"] if r["processes"] > 1]
    assert [(r["devices"], r["processes"]) for r in distributed] == [(4, 2)]
    assert "MultiWorkerMirrored" in stdout and out.with_suffix(".png").stat().st_size > 0


def test_ratios_use_single_device_on_the_same_batch_and_every_row_equals_it(quick):
    result = json.loads(quick[0].read_text())
    rows = result["rows"]
    single = {r["devices"]: r for r in rows if r["strategy"] == "SingleDevice"}
    for row in rows:
        reference = single[row["devices"]]
        assert row["global_batch"] == reference["global_batch"]
        assert row["speedup"] == pytest.approx(reference["median_step_ms"] / row["median_step_ms"])
        assert row["throughput_ratio"] == pytest.approx(row["samples_per_s"] / single[1]["samples_per_s"])
        assert row["scaling_efficiency"] == pytest.approx(row["throughput_ratio"] / row["devices"])
        # checked where the row ran (the pipeline against SingleDevice on sequential_loss, the
        # multi-process row against SingleDevice in its own processes): rtol 1e-5, atol 1e-6
        assert row["equals_single"] is True and row["max_param_diff"] < 1e-5, row
    assert result["all_equal_single"] is True and unequal_rows(rows) == []
    measured = [r for r in rows if r["bytes_per_step"] is not None]
    assert {r["strategy"] for r in measured} >= {"Mirrored(jit)", "CentralStorage", "FullySharded(3)"}


def test_bad_layouts_are_refused():
    assert parse_layouts("2x2 4x1") == [(2, 2), (4, 1)]
    assert parse_layouts("none") == []
    for bad in ("1x2", "2by2", "2x0"):
        with pytest.raises(SystemExit, match="PxD"):
            parse_layouts(bad)


def _row(strategy: str, devices: int, processes: int, median_ms: float, equal: bool = True) -> dict:
    return {"strategy": strategy, "devices": devices, "processes": processes, "global_batch": 32 * devices,
            "compile_s": 1.0, "median_step_ms": median_ms, "samples_per_s": 32 * devices / median_ms * 1e3,
            "speedup": None, "bytes_per_step": None, "memory_per_device": None,
            "max_param_diff": 0.0 if equal else 3e-3, "equals_single": equal}  # fmt: skip


def test_ratios_name_their_yardstick_and_a_differing_row_is_named():
    rows = [_row("SingleDevice", 1, 1, 10.0), _row("SingleDevice", 2, 1, 10.0), _row("Mirrored(jit)", 2, 1, 12.5),
            _row("MultiWorkerMirrored", 2, 2, 20.0, equal=False)]  # fmt: skip
    add_ratios(rows)
    mirrored, multi = rows[2], rows[3]
    assert mirrored["speedup"] == pytest.approx(0.8)  # against one device on the same cores
    assert mirrored["throughput_ratio"] == pytest.approx(1.6)  # against the one-device child
    assert mirrored["scaling_efficiency"] == pytest.approx(0.8) and multi["speedup"] == pytest.approx(0.5)
    assert unequal_rows(rows) == ["MultiWorkerMirrored on 2 device(s) in 2 process(es): max |dp| 3.00e-03"]
    table = format_table(rows, cores_as_devices=True)
    assert table.splitlines()[5].endswith("NO") and table.splitlines()[4].endswith("yes")
    assert "one device on one core" in table and "one device on the same n cores" in table

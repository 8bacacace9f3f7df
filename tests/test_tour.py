"""`python -m parallelkit tour`: every strategy, one table, all equal to the reference."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT

import parallelkit as pk


def test_tour_command_prints_and_saves_the_table(tmp_path):
    out = tmp_path / "tour.json"
    proc = subprocess.run(
        [sys.executable, "-m", "parallelkit", "tour", "--devices", "2", "--steps", "6", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "2 simulated CPU devices" in proc.stdout and "max |dp|" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["strategy"] for r in rows] == list(pk.tour.STRATEGIES)
    assert [r["devices"] for r in rows] == [1, 2, 2, 2, 2, 2, 2, 2, 2]
    assert rows[0]["max_param_diff"] == 0.0
    for row in rows:
        assert row["meant_to_equal"] == (row["strategy"] not in pk.tour.MEANT_TO_DIFFER)
        if not row["meant_to_equal"]:
            assert row["max_param_diff"] > 1e-5, row  # two updates a step on half batches: another path
            assert "(async: differs by design)" in proc.stdout
            continue
        assert row["max_param_diff"] < 1e-5, row
        assert row["median_step_ms"] > 0 and row["samples_per_s"] > 0
        assert row["final_loss"] == rows[0]["final_loss"] or abs(row["final_loss"] - rows[0]["final_loss"]) < 1e-5


def test_max_abs_diff():
    a = {"w": [1.0, 2.0], "b": 0.5}
    b = {"w": [1.0, 2.5], "b": 0.25}
    assert pk.tour.max_abs_diff(a, b) == 0.5


def test_assert_close_names_the_leaf_and_checks_the_structure():
    a = {"w": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}
    assert pk.tour.assert_close(a, {"w": np.full(3, 5e-7, np.float32), "b": np.zeros(2, np.float32)}) > 0
    with pytest.raises(AssertionError, match=r"leaf \['w'\] differs"):
        pk.tour.assert_close(a, {"w": np.full(3, 2e-6, np.float32), "b": np.zeros(2, np.float32)})
    with pytest.raises(AssertionError, match="differ in structure"):
        pk.tour.assert_close(a, {"w": np.zeros(3, np.float32)})

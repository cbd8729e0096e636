"""The benchmark runs at a tiny size and writes valid results (it measures nothing here)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_bench_writes_results(tmp_path):
    # its own process: the bench sets up 8 fake CPU devices itself
    proc = subprocess.run([sys.executable, "-m", "moe_train.bench", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    results = json.loads((run_dir / "results.json").read_text())
    md = (run_dir / "results.md").read_text()
    assert "Expert parallel (8 fake CPU devices)" in md and "| mesh |" in md
    assert results["quick"] is True
    ep = results["sections"]["ep"]

    def positive(v):
        return isinstance(v, (int, float)) and math.isfinite(v) and v > 0

    rows = ep["timing"]
    assert {r["dispatcher"] for r in rows} >= {"dense (dropless_moe)", "allgather", "a2a",
                                                "hierarchical"}
    for r in rows:
        t = r["time"]
        assert all(positive(t[k]) for k in ("median_s", "min_s", "max_s")), r
        assert t["min_s"] <= t["median_s"] <= t["max_s"] and t["reps"] >= 3
        if r["kind"] == "ep":
            assert 0 < r["fill"] <= 1, r
            assert not r["overflow"]
            assert positive(r["fwd_bytes_per_device"]["total"])
    assert {r["routing"] for r in rows} >= {"uniform", "zipf"}

    buckets = ep["buckets"]
    assert {b["dispatcher"] for b in buckets} == {"a2a", "hierarchical"}
    for b in buckets:
        assert 0 < b["fill"] <= 1 and 0 < b["worst_fill"] <= 1, b
        assert b["worst_fill"] <= b["fill"] + 1e-9  # the worst case never fills better
        assert b["buffer_over_received"] == pytest.approx(1 / b["fill"])
        assert b["reruns"] >= 0 and b["held_bucket"]

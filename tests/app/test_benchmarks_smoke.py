"""The never-slower benchmarks run (a few rows each, short timings): the matrix of default decisions and the eager
ops against the torch code they replace. Their figures are in docs/PERFORMANCE.md; here only that they run, check
results against eager and write what they promise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_bench_defaults_quick_rows(tmp_path):
    out = tmp_path / "bd.json"
    r = _run("bench_defaults.py", "--quick", "--families", "softmax,linear_ce", "--only", "64x32000",
             "--only", "16384", "--min-run-time", "0.01", "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["family"] for row in rows} == {"softmax", "linear_ce"}
    for row in rows:
        assert row["inductor_ms"] > 0 and row["smx_ms"] > 0 and not row["mismatch"], row
        assert " rewritten" in row["smx_action"] or " kept" in row["smx_action"], row
    # the policy's measured decisions: an evaluation linear -> CE is kept for Inductor, a training one rewritten
    lce = {row["pass"]: row for row in rows if row["family"] == "linear_ce"}
    assert "kept" in lce["infer"]["smx_action"] and "no gradient" in lce["infer"]["smx_reason"], lce["infer"]
    assert "rewritten" in lce["train"]["smx_action"], lce["train"]


def test_bench_eager_ops_quick(tmp_path):
    out = tmp_path / "eo.json"
    r = _run("bench_eager_ops.py", "--quick", "--ops", "softmax,softmax_topk", "--min-run-time", "0.01",
             "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["op"] for row in rows} == {"softmax", "softmax_topk"}
    assert all(row["torch_ms"] > 0 and row["smx_ms"] > 0 for row in rows)

"""The never-slower benchmarks run (a few rows each, short timings): the matrix of default decisions, a family script
on the same runner (benchmarks/matrix.py) and the eager ops against the torch code they replace. Their figures are in
docs/PERFORMANCE.md; here only that they run, check results against eager and write what they promise."""

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


def test_bench_quant_softmax_quick_codes(tmp_path):
    """A family script: a backend of its own (the op called directly), its own check, the peak-memory table."""
    out = tmp_path / "q.json"
    r = _run("bench_quant_softmax.py", "--quick", "--families", "codes", "--min-run-time", "0.01", "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["family"] == "codes" and row["op_ms"] > 0 and not row["mismatch"], row
    assert set(row["peak_mb"]) == {"eager", "inductor", "smx", "smx-rewrite", "op"}, row
    assert "kept" in row["smx_action"] and "rewritten" in row["action"]["smx-rewrite"], row


def test_bench_ce_guard_quick_guard_family(tmp_path):
    """A family with backends of its own (inductor-pm0, no smx-rewrite); Inductor's mis-compile shows in the exit."""
    out = tmp_path / "g.json"
    r = _run("bench_ce_guard.py", "--quick", "--families", "guard", "--min-run-time", "0.01", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [row["pass"] for row in rows] == ["infer", "train"], r.stdout[-2000:] + r.stderr[-2000:]
    for row in rows:
        assert set(row["compile_s"]) == {"eager", "inductor", "inductor-pm0", "smx"} and not row["errors"], row
        assert "attention skipped" in row["smx_action"] and not set(row["mismatch"]) - {"inductor"}, row
    assert r.returncode == (1 if any(row["mismatch"] for row in rows) else 0), r.stdout[-2000:]


def test_bench_eager_ops_quick(tmp_path):
    out = tmp_path / "eo.json"
    r = _run("bench_eager_ops.py", "--quick", "--ops", "softmax,softmax_topk", "--min-run-time", "0.01",
             "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["op"] for row in rows} == {"softmax", "softmax_topk"}
    assert all(row["torch_ms"] > 0 and row["smx_ms"] > 0 for row in rows)


def test_compare_model_rows_and_no_cuda(tmp_path, monkeypatch):
    """benchmarks/gpu/compare_model.py (GPU model vs a GPU): its pure compare() on made-up rows (matching by case,
    shape and dtype, ratios, flags, order kept), the table's cells and summary, and the exit without CUDA."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    import compare_model as cm

    def m(case, shape, dtype, pred, tpred):
        return dict(case=case, shape=shape, dtype=dtype, predicted_us=pred, torch_predicted_us=tpred)

    def meas(case, shape, dtype, ours, theirs=None, error=None):
        return dict(family="softmax", kernel="k", case=case, shape=shape, dtype=dtype, measured_us=ours,
                    torch_measured_us=theirs, error=error, torch_error=None, peak_bytes=2**20, torch_peak_bytes=None)

    model = [m("b", "8x8", "bf16", 5.0, 5.0), m("a", "4x4", "bf16", 10.0, 20.0), m("a", "4x4", "bf16", 99.0, 99.0),
             m("c", "2x2", "bf16", 1.0, 1.0)]
    measured = [meas("a", "4x4", "bf16", 15.0, 30.0),        # 1.5x its prediction, 2x faster than torch
                meas("b", "8x8", "bf16", 12.0, 8.0),         # 2.4x its prediction and slower than torch
                meas("a", "4x4", "fp32", 1.0),               # the dtype is part of the key: no model row
                meas("e", "1x1", "bf16", None, error="RuntimeError: boom")]
    rows = cm.compare(model, measured)
    assert [(r["case"], r["dtype"]) for r in rows] == [("a", "bf16"), ("b", "bf16"), ("a", "fp32"), ("e", "bf16")]
    a, b, a32, e = rows
    assert a["predicted_us"] == 10.0 and a["torch_predicted_us"] == 20.0  # the first model row of a key wins
    assert a["measured_over_predicted"] == 1.5 and a["torch_measured_over_predicted"] == 1.5
    assert a["speedup_vs_torch"] == 2.0 and a["predicted_speedup_vs_torch"] == 2.0 and a["flags"] == []
    assert abs(b["measured_over_predicted"] - 2.4) < 1e-12 and abs(b["speedup_vs_torch"] - 8 / 12) < 1e-12
    assert b["flags"] == ["slower than torch (0.67x)", "misses its roofline by 2.4x"]
    assert not a32["in_model"] and a32["predicted_us"] is None and a32["measured_over_predicted"] is None
    assert a32["speedup_vs_torch"] is None and a32["flags"] == ["no model row"]
    assert e["flags"] == ["ERR RuntimeError: boom", "no model row"] and e["measured_us"] is None
    table = "\n".join(" | ".join(cm.row_cells(r)) for r in rows)
    assert "misses its roofline by 2.4x" in table and "slower than torch" in table and "ERR" in table
    text = "\n".join(cm.summary(rows))
    assert "SLOWER THAN TORCH (measured): b 8x8 bf16 0.67x" in text
    assert "misses its roofline by more than 2x (measured / predicted): b 8x8 bf16 2.4x" in text
    assert "ERR e 1x1 bf16: RuntimeError: boom" in text and "no model row for 2 case(s)" in text
    assert "measured / predicted over 2 case(s): median 1.95" in text

    h = _run("gpu/compare_model.py", "--help")
    assert h.returncode == 0 and "measured / predicted" in h.stdout and "--budget" in h.stdout
    import torch
    if not torch.cuda.is_available():
        r = _run("gpu/compare_model.py", "--quick")
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert "CUDA" in r.stderr and "gpu_model.py" in r.stderr

"""benchmarks/eval_quant_softmax.py --quick on a tiny checkpoint trained here by `smx demo --quick`."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "eval_quant_softmax.py"


def _load_script():
    sys.path.insert(0, str(SCRIPT.parent))  # the script imports common.py from its folder
    spec = importlib.util.spec_from_file_location("eval_quant_softmax", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["eval_quant_softmax"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_help_teaches():
    text = _load_script().build_parser().format_help()
    for needle in ("What is measured", "perplexity", "held-out", "--train-if-missing", "--quick", "scale/head",
                   "offset/tensor", "within 1%", "examples:"):
        assert needle in text, needle


@pytest.mark.timeout(300)  # ~12 s on 2 idle cores (the tiny demo training included); not marked slow
def test_quick_end_to_end(tmp_path):
    ev = _load_script()
    out = tmp_path / "run"
    t0 = time.perf_counter()
    # --train-if-missing with --quick runs `smx demo --quick --backends eager --seed 0 --out <out>`
    rc = ev.main(["--checkpoint", str(out / "checkpoint"), "--quick", "--train-if-missing", "--markdown",
                  "--json", str(tmp_path / "q.json"), "--plot", str(tmp_path / "q.png")])
    elapsed = time.perf_counter() - t0
    assert rc == 0
    assert (out / "checkpoint" / "config.json").is_file() and (out / "results.json").is_file()
    print(f"smx demo --quick + eval --quick: {elapsed:.0f} s")

    doc = json.loads((tmp_path / "q.json").read_text())
    assert doc["command"].startswith("python ") and "--quick" in doc["command"]
    assert doc["environment"]["torch"] and doc["environment"]["transformers"] and doc["date"]
    (ck,) = doc["checkpoints"]
    assert ck["seq_len"] == 64 and ck["corpus"] == "topics"  # read from the demo's results.json
    assert len(ck["sites"]) == ck["n_layer"] == 2
    assert ck["eval_windows"] == 16 and ck["calib_windows"] == 16
    rows = doc["results"]
    assert {(r["bits"], r["setting"]) for r in rows} == {(b, s) for b in (8, 4) for s in ev.SETTINGS}
    fp = ck["fp32"]["ppl"]
    for r in rows:
        assert r["ppl"] > 1 and r["ppl"] != fp and r["max_abs_logit_diff_batch0"] > 0
        assert abs(r["rel_change_pct"] - 100 * (r["ppl"] / fp - 1)) < 1e-9
        assert 0 <= r["zero_fraction"] <= 1 and r["mean_abs_rowsum_err"] >= 0
    by = {(r["bits"], r["setting"]): r for r in rows}
    # fewer bits: more probabilities rounded to zero, a larger row-sum error
    assert by[(4, "none")]["zero_fraction"] > by[(8, "none")]["zero_fraction"]
    assert by[(4, "none")]["mean_abs_rowsum_err"] > by[(8, "none")]["mean_abs_rowsum_err"]
    v = doc["verdict"]
    assert set(v) >= {"goal_8bit_within_1pct", "goal_correction_beats_none", "ranking_by_bits"}
    assert list(v["ranking_by_bits"]) == ["8", "4"] and len(v["ranking_by_bits"]["4"]) == len(ev.SETTINGS)
    assert by[(8, "offset/head")]["vs_none_ci95_pct"] is not None and by[(8, "none")]["vs_none_pct"] is None
    assert "| q |" not in doc["table_markdown"] and "| run | 8 | scale/head |" in doc["table_markdown"]
    if importlib.util.find_spec("matplotlib") is not None:     # the [bench] extra; CI installs [test] only
        assert (tmp_path / "q.png").stat().st_size > 10_000
    else:
        assert not (tmp_path / "q.png").exists()


def test_missing_checkpoint_fails_clearly(tmp_path):
    ev = _load_script()
    with pytest.raises(SystemExit, match="--train-if-missing"):
        ev.main(["--checkpoint", str(tmp_path / "nope"), "--quick"])

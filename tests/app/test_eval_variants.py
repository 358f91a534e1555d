"""benchmarks/eval_variants.py end to end on a tiny demo-style checkpoint (built here in about 3 s)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from model_builders import build_tiny_lm_checkpoint  # noqa: E402

from smx_app import lm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "eval_variants.py"
SEQ_LEN = 32


def _load_script():
    sys.path.insert(0, str(SCRIPT.parent))  # the script imports common.py from its folder
    spec = importlib.util.spec_from_file_location("eval_variants", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["eval_variants"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)   # the script sets --threads 1


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny demo-style run folder: ``OUT/checkpoint`` + ``OUT/results.json``; returns OUT."""
    torch.set_num_threads(1)
    return build_tiny_lm_checkpoint(tmp_path_factory.mktemp("tiny-demo"), SEQ_LEN)


ARGS = ["--batch-size", "4", "--eval-batches", "2", "--stats-batches", "1", "--threads", "1", "--no-progress"]


def test_help_teaches():
    text = _load_script().build_parser().format_help()
    for needle in ("What is measured", "held-out", "softmax (baseline)", "calibrated", "fine-tuned", "sink mass",
                   "entropy", "--calibrate", "--finetune", "entmax_bisect", "diverged", "examples:"):
        assert needle in text, needle


@pytest.mark.timeout(300)  # ~10-15 s on 2 idle cores, the tiny checkpoint included
def test_end_to_end(ckpt, tmp_path):
    ev = _load_script()
    js, png = tmp_path / "v.json", tmp_path / "v.png"
    rc = ev.main(["--checkpoint", str(ckpt / "checkpoint"), "--variants", "temperature,multimax,sparsemax",
                  "--calibrate", "3", "--finetune", "3", *ARGS, "--markdown", "--json", str(js), "--plot", str(png)])
    assert rc == 0
    doc = json.loads(js.read_text())
    assert doc["command"].startswith("python benchmarks/eval_variants.py") and "--finetune 3" in doc["command"]
    assert doc["date"] and doc["environment"]["torch"] and doc["environment"]["transformers"]
    cfg = doc["config"]
    assert (cfg["calibrate"], cfg["finetune"], cfg["batch_size"], cfg["threads"]) == (3, 3, 4, 1)
    assert cfg["variants"] == ["temperature", "multimax", "sparsemax"]
    assert doc["data"]["seq_len"] == SEQ_LEN and doc["data"]["corpus"] == "topics"
    assert doc["eval"]["windows"] == 8 and doc["eval"]["tokens"] == 8 * (SEQ_LEN - 1)
    assert doc["diverged"] == []

    rows = {r["variant"]: r for r in doc["rows"]}
    assert [r["variant"] for r in doc["rows"]] == [ev.BASELINE, "temperature", "multimax", "sparsemax"]
    base = rows[ev.BASELINE]
    orig = doc["original"]["ppl"]
    ref = base["ppl_finetuned"]
    assert doc["baseline_ppl_finetuned"] == ref and ref != orig and math.isfinite(ref)
    assert base["ppl_swap"] is None and base["ppl_calibrated"] is None and base["ratio_finetuned"] == 1.0
    for r in rows.values():
        assert r["status"] == "ok" and r["ppl_original"] == orig and r["wall_s"] > 0
        assert r["ratio_original"] == pytest.approx(orig / ref, rel=1e-12)
        assert r["ratio_finetuned"] == pytest.approx(r["ppl_finetuned"] / ref, rel=1e-12)
        for k in ("stats_swap", "stats_finetuned"):
            st = r[k]
            assert 0 < st["entropy"] <= math.log(SEQ_LEN) + 1e-9 and 0 <= st["sink_mass"] <= 1, (r["variant"], k, st)
            assert 0 <= st["zero_fraction"] <= 1
    # temperature (T = 1) and multimax (all zero) start as softmax exactly
    for name in ("temperature", "multimax"):
        r = rows[name]
        assert abs(r["ppl_swap"] / orig - 1) < 1e-4, (name, r["ppl_swap"], orig)
        assert r["stats_swap"]["entropy"] == pytest.approx(base["stats_swap"]["entropy"], rel=1e-4)
        assert r["ppl_calibrated"] is not None and r["finetune_from"] == "calibrated"
        assert r["ratio_calibrated"] == pytest.approx(r["ppl_calibrated"] / ref, rel=1e-12)
        assert r["stats_finetuned"]["rowsum"] == pytest.approx(1.0, abs=1e-6)
        assert r["n_variant_params"] > 0 and set(r["params_calibrated"]) == set(r["learnable"])
    assert rows["temperature"]["params_start"]["T"] == [1.0] * 4
    assert rows["temperature"]["n_variant_params"] == 2 * 2          # one T per head and layer
    # sparsemax: no learnable parameter, no calibration; sparse weights
    sp = rows["sparsemax"]
    assert sp["learnable"] == [] and sp["n_variant_params"] == 0
    assert sp["ppl_calibrated"] is None and sp["ratio_calibrated"] is None and sp["finetune_from"] == "swapped"
    assert sp["ppl_swap"] != orig and sp["stats_finetuned"]["zero_fraction"] > 0
    assert sp["stats_swap"]["entropy"] < base["stats_swap"]["entropy"]
    # the table: one line per row, calibration "-" for sparsemax, ratios to the baseline
    md = doc["table_markdown"].splitlines()
    assert len(md) == 2 + 4
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in md[2:]}
    assert cells["sparsemax"][0] == "-" and cells["sparsemax"][3] == "-"
    assert cells["temperature"][3].endswith("x)") and cells[ev.BASELINE][4].endswith("(1.00x)")
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 10_000
        # --replot redraws it from the JSON alone
        assert ev.main(["--replot", str(js), "--plot", str(tmp_path / "again.png")]) == 0
        assert (tmp_path / "again.png").stat().st_size > 10_000


def test_divergence_is_recorded_and_the_run_goes_on(ckpt, tmp_path, monkeypatch):
    ev = _load_script()
    real = lm.train_steps

    def train_steps(model, windows, **kw):
        if (kw.get("desc") or "").startswith("softpick"):
            raise FloatingPointError("the training loss is nan at step 1 of 1 (lr 0.0001); try a smaller learning rate")
        return real(model, windows, **kw)

    monkeypatch.setattr(lm, "train_steps", train_steps)
    js = tmp_path / "d.json"
    rc = ev.main(["--checkpoint", str(ckpt), "--variants", "softpick,temperature", "--calibrate", "1",
                  "--finetune", "1", *ARGS, "--json", str(js)])
    assert rc == 0
    doc = json.loads(js.read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert doc["diverged"] == ["softpick"]
    assert rows["softpick"]["status"] == "diverged" and rows["softpick"]["diverged"].startswith("fine-tune: ")
    assert rows["softpick"]["ppl_swap"] > 1 and "ppl_finetuned" not in rows["softpick"]
    assert rows["temperature"]["status"] == "ok" and math.isfinite(rows["temperature"]["ppl_finetuned"])
    assert "| softpick | - |" in doc["table_markdown"] and "diverged (fine-tune)" in doc["table_markdown"]


def test_bad_options_fail_clearly(tmp_path, capsys):
    ev = _load_script()
    with pytest.raises(SystemExit):
        ev.main(["--checkpoint", str(tmp_path), "--variants", "softmax,nope"])
    assert "unknown ['softmax', 'nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="smx demo"):
        ev.main(["--checkpoint", str(tmp_path / "missing"), "--no-progress"])

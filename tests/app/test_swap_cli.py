"""``smx swap`` / ``smx eval`` and the library under them (``smx_app.lm``), on a tiny checkpoint.

The checkpoint is built once per module, the way ``smx demo`` builds one but smaller (about 3 s on 2
cores): a byte-level BPE tokenizer (vocabulary 512) trained on a slice of ``pydoc_data.topics``, a
2-layer GPT-2 (n_embd 32, 2 heads) trained 40 steps on windows of 32 tokens of the whole ``topics``
corpus, saved as ``OUT/checkpoint`` with ``OUT/results.json`` holding the demo's settings.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from model_builders import build_tiny_lm_checkpoint  # noqa: E402

import smxcompile  # noqa: E402
from smx_app import cli, demo, lm  # noqa: E402

SEQ_LEN = 32


def _run(argv: list[str]) -> tuple[int, str, str]:
    """``smx ARGV`` in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The model is tiny: one intra-op thread is fastest, and it does not collapse when another process
    keeps the second core busy (two threads then spin-wait on each other: 100x slower steps)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny demo-style run folder: ``OUT/checkpoint`` + ``OUT/results.json``; returns OUT."""
    return build_tiny_lm_checkpoint(tmp_path_factory.mktemp("tiny-demo"), SEQ_LEN)


@pytest.fixture(scope="module")
def ssmax_run(ckpt, tmp_path_factory) -> tuple[Path, str, dict]:
    """``smx swap ckpt --variant ssmax --calibrate 6 --finetune 3 --batches 4``: (out, stdout, results.json)."""
    out = tmp_path_factory.mktemp("ssmax") / "run"
    rc, stdout, stderr = _run(["swap", str(ckpt), "--variant", "ssmax", "--calibrate", "6", "--finetune", "3",
                               "--batches", "4", "--batch-size", "4", "--no-progress", "--out", str(out)])
    assert rc == 0, stderr + stdout
    return out, stdout, json.loads((out / "results.json").read_text())


# --------------------------------------------------------------------------- the library


def test_checkpoint_dir_and_lm_data(ckpt, tmp_path, monkeypatch):
    assert lm.checkpoint_dir(ckpt) == ckpt / "checkpoint"
    assert lm.checkpoint_dir(ckpt / "checkpoint") == ckpt / "checkpoint"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        lm.checkpoint_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        lm.checkpoint_dir(tmp_path)
    d = lm.lm_data(ckpt)
    assert (d.seq_len, d.corpus, d.guessed) == (SEQ_LEN, "topics", [])
    assert d.train.dtype == d.heldout.dtype == torch.int64
    assert d.train.shape[1] == d.heldout.shape[1] == SEQ_LEN
    assert d.train.shape[0] > 19 * d.heldout.shape[0] - 20 and d.heldout.shape[0] > 100
    assert d.results == ckpt / "results.json" and d.tokenizer == ckpt / "checkpoint" / "tokenizer.json"
    # without the demo's results.json: guesses, warned (the guessed corpus, topics+docstrings, stands in for
    # the topics here: parsing the standard library's docstrings takes seconds)
    monkeypatch.setitem(lm._CORPUS_CACHE, "topics+docstrings", demo.load_corpus("topics"))
    monkeypatch.setattr(lm, "_WINDOW_CACHE", {})
    bare = tmp_path / "bare"
    shutil.copytree(ckpt / "checkpoint", bare)
    with pytest.warns(UserWarning, match="guess"):
        g = lm.lm_data(bare)
    assert g.seq_len == 128 and g.corpus == demo.DEFAULTS["corpus"] and len(g.guessed) == 2
    assert lm.lm_data(bare, seq_len=SEQ_LEN, corpus="topics").heldout.equal(d.heldout)
    with pytest.raises(ValueError, match="n_positions"):
        lm.lm_data(bare, seq_len=129, corpus="topics")
    with pytest.raises(ValueError, match="unknown corpus"):
        lm.lm_data(bare, seq_len=SEQ_LEN, corpus="nope")


def test_perplexity_matches_a_direct_computation(ckpt):
    model = lm.load_lm(ckpt)
    assert not model.training and model.config._attn_implementation == "eager"
    held = lm.lm_data(ckpt).heldout[:12]
    r = lm.perplexity(model, held, batch_size=4, progress=False)
    assert r["tokens"] == 12 * (SEQ_LEN - 1) and r["windows"] == 12
    with torch.no_grad():   # transformers' own loss: the mean NLL of a batch (every batch has as many tokens)
        direct = sum(model(input_ids=b, labels=b).loss.item() for b in held.split(4)) / 3
    assert abs(r["loss"] - direct) <= 1e-6 * direct
    assert r["ppl"] == pytest.approx(math.exp(r["loss"]), rel=1e-12)
    other = lm.perplexity(model, held, batch_size=5, progress=True)
    assert other["loss"] == pytest.approx(r["loss"], rel=1e-6)
    with pytest.raises(ValueError, match="int64"):
        lm.perplexity(model, held.float(), progress=False)


def test_train_steps_variant_changes_only_variant_parameters(ckpt):
    data = lm.lm_data(ckpt)
    base = lm.load_lm(ckpt)
    with pytest.raises(ValueError, match="no learnable variant parameter"):
        lm.train_steps(base, data.train, steps=1, which="variant", progress=False)
    model = smxcompile.swap(base, "ssmax", example_inputs={"input_ids": data.heldout[:1]}, n_train=SEQ_LEN)
    model.transformer.wte.weight.requires_grad_(False)   # a user's freeze survives the calibration
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = lm.train_steps(model, data.train, steps=3, batch_size=4, which="variant", progress=False)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {n for n, _ in model.named_parameters() if n.startswith("smx_swap.")}
    assert len(changed) == 2   # one s per layer, (heads, 1, 1)
    assert not model.transformer.wte.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if n != "transformer.wte.weight")
    assert all(p.grad is None for p in model.parameters()) and not model.training
    sparse = smxcompile.swap(base, "sparsemax", example_inputs={"input_ids": data.heldout[:1]})
    with pytest.raises(ValueError, match="sparsemax"):
        lm.train_steps(sparse, data.train, steps=1, which="variant", progress=False)
    with pytest.raises(ValueError, match="which"):
        lm.train_steps(model, data.train, steps=1, which="some", progress=False)


def test_attention_stats_against_the_original_softmax(ckpt):
    data = lm.lm_data(ckpt)
    model = smxcompile.swap(lm.load_lm(ckpt), "sparsemax", example_inputs={"input_ids": data.heldout[:1]})
    w = data.heldout[:4]
    sw = lm.attention_stats(model, w, batch_size=2)
    base = lm.attention_stats(model, w, batch_size=2, baseline=True)
    rows = 4 * 2 * 2 * SEQ_LEN   # windows x layers x heads x queries
    assert sw["rows"] == base["rows"] == rows
    assert base["zero_fraction"] == 0 and sw["zero_fraction"] > 0.05   # sparsemax: exact zeros
    assert sw["entropy"] < base["entropy"]
    assert sw["rowsum"] == pytest.approx(1, abs=1e-5) and base["rowsum"] == pytest.approx(1, abs=1e-5)
    with pytest.raises(ValueError, match="not swapped"):
        lm.attention_stats(lm.load_lm(ckpt), w)


def test_save_and_load_round_trip(ckpt, tmp_path):
    data = lm.lm_data(ckpt)
    model = smxcompile.swap(lm.load_lm(ckpt), "ssmax", example_inputs={"input_ids": data.heldout[:1]})
    lm.train_steps(model, data.train, steps=2, batch_size=4, which="variant", progress=False)
    lm.train_steps(model, data.train, steps=1, batch_size=4, which="all", progress=False)
    lm.save_lm(model, tmp_path / "m", tokenizer_from=ckpt / "checkpoint")
    assert lm.is_swapped(tmp_path / "m") and not lm.is_swapped(ckpt / "checkpoint")
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    loaded = lm.load_lm(tmp_path / "m")
    assert loaded.smx_swap.manifest() == model.smx_swap.manifest()
    b = data.heldout[:3]
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=b).logits, model(input_ids=b).logits)
    for (n, p), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n


# --------------------------------------------------------------------------- the command line


def test_swap_calibrate_finetune(ckpt, ssmax_run):
    out, stdout, res = ssmax_run
    for needle in ("original", "swapped", "calibrated", "fine-tuned", "held-out perplexity", "vs original",
                   "evaluate it with:", f"smx eval {out} --batches 4 --batch-size 4"):
        assert needle in stdout, needle
    assert list(res["perplexity"]) == ["original", "swapped", "calibrated", "fine-tuned"]
    assert f"final held-out perplexity (fine-tuned): {res['final_ppl']:.3f}" in stdout
    assert res["final"] == "fine-tuned" and res["final_loss"] == res["perplexity"]["fine-tuned"]["loss"]
    assert res["eval"]["windows"] == 16 and res["perplexity"]["original"]["tokens"] == 16 * (SEQ_LEN - 1)
    assert len(res["losses"]["calibrate"]) == 6 and len(res["losses"]["finetune"]) == 3
    assert res["settings"]["seq_len"] == SEQ_LEN and res["settings"]["corpus"] == "topics"
    assert res["settings"]["n_train"] == SEQ_LEN   # default: the window length the model was trained on
    s0 = 1 / math.log(SEQ_LEN)
    learned = [x for site in res["learned"].values() for x in site["s"]]
    assert len(learned) == 4 and all(abs(x - s0) > 1e-4 for x in learned)   # calibration moved every head's s
    for f in ("config.json", "model.safetensors", "tokenizer.json", "results.json"):
        assert (out / f).is_file(), f
    assert json.loads((out / "config.json").read_text())["smx_swap"]["sites"][0]["variant"] == "ssmax"
    # the original's perplexity is the checkpoint's own
    base = lm.perplexity(lm.load_lm(ckpt), lm.lm_data(ckpt).heldout[:16], progress=False)
    assert res["perplexity"]["original"]["loss"] == pytest.approx(base["loss"], rel=1e-9)


def test_eval_reproduces_the_swap_perplexity(ckpt, ssmax_run):
    out, _, res = ssmax_run
    rc, stdout, stderr = _run(["eval", str(out), "--batches", "4", "--batch-size", "4", "--no-progress", "--json"])
    assert rc == 0, stderr
    doc = json.loads(stdout)
    assert doc["swapped"] and doc["tokens"] == res["perplexity"]["fine-tuned"]["tokens"]
    assert abs(doc["loss"] - res["final_loss"]) <= 1e-6 * res["final_loss"]
    assert abs(doc["ppl"] - res["final_ppl"]) <= 1e-6 * res["final_ppl"]
    assert doc["learned"] == res["learned"] and doc["swap"] == res["swap"]
    a = doc["attention"]
    assert a["swapped"]["rows"] == a["original"]["rows"] > 0
    assert a["swapped"]["entropy"] != a["original"]["entropy"] and a["original"]["rowsum"] == pytest.approx(1)
    # the human form: the swap summary and the comparison table
    rc, stdout, _ = _run(["eval", str(out), "--batches", "1", "--no-progress"])
    assert rc == 0
    for needle in ("held-out loss", "perplexity", "smxcompile swap: 2 site(s)", "entropy (nats)", "sink mass",
                   "original softmax"):
        assert needle in stdout, needle
    # a plain checkpoint: perplexity only
    rc, stdout, _ = _run(["eval", str(ckpt), "--batches", "4", "--batch-size", "4", "--no-progress", "--json"])
    plain = json.loads(stdout)
    assert rc == 0 and not plain["swapped"] and "attention" not in plain
    assert plain["loss"] == pytest.approx(res["perplexity"]["original"]["loss"], rel=1e-6)


def test_swap_parameter_free_variant(ckpt, tmp_path):
    out = tmp_path / "sparse"
    rc, stdout, stderr = _run(["swap", str(ckpt / "checkpoint"), "--variant", "sparsemax", "--calibrate", "3",
                               "--batches", "2", "--no-progress", "--out", str(out)])
    assert rc == 0, stderr
    assert "not applicable" in stdout and "sparsemax has no learnable parameter" in stdout
    res = json.loads((out / "results.json").read_text())
    assert list(res["perplexity"]) == ["original", "swapped"] and res["final"] == "swapped"
    assert "not applicable" in res["calibration_note"] and res["learned"] == {"transformer.h.0.attn#0": {},
                                                                              "transformer.h.1.attn#0": {}}
    loaded = lm.load_lm(out)
    assert {s.variant for s in loaded.smx_swap.sites.values()} == {"sparsemax"}


def test_swap_param_and_list(ckpt, tmp_path, capsys):
    rc, stdout, stderr = _run(["swap", str(ckpt), "--variant", "temperature", "--param", "T=1.5", "--per-site",
                               "--batches", "1", "--no-progress", "--out", str(tmp_path / "t")])
    assert rc == 0, stderr
    res = json.loads((tmp_path / "t" / "results.json").read_text())
    assert res["settings"]["params"] == {"T": 1.5} and res["learned"]["transformer.h.0.attn#0"] == {"T": [1.5]}
    for argv in (["swap", "--list-variants"], ["swap", "--variant", "list"]):
        rc, stdout, _ = _run(argv)
        assert rc == 0
        for name in smxcompile.variants.names():
            assert name in stdout, name
        assert "learnable" in stdout and "fixed" in stdout and "Martins" in stdout


@pytest.mark.parametrize("argv, message", [
    (["--variant", "nope"], "unknown variant 'nope'; known: sparsemax, entmax15"),
    (["--variant", "ssmax", "--param", "foo=1"], "variant 'ssmax' has no parameter 'foo'; its parameters: s (learnable"),
    (["--variant", "sparsemax", "--param", "s=1"], "its parameters: none"),
    (["--variant", "ssmax", "--param", "s=abc"], "'abc' is not a number"),
    (["--variant", "ssmax", "--param", "s"], "NAME=VALUE"),
    (["--variant", "entmax_bisect", "--param", "alpha=0.5"], "alpha must be >= 1"),
    (["--variant", "ssmax", "--where", "output"], "no softmax site selected by where='output'"),
    (["--variant", "ssmax", "--corpus", "nope"], "unknown corpus 'nope'"),
    (["--variant", "ssmax"], "--out DIR is required"),
    (["--out", "x"], "--variant NAME is required"),
])
def test_swap_usage_errors(ckpt, tmp_path, argv, message):
    if "--out" not in argv and "is required" not in message:
        argv = argv + ["--out", str(tmp_path / "o")]
    rc, stdout, stderr = _run(["swap", str(ckpt), *argv, "--batches", "1", "--no-progress"])
    assert rc == 2 and message in stderr and "Traceback" not in stderr + stdout, stderr
    assert not (tmp_path / "o").exists()


def test_missing_checkpoint_is_a_usage_error(tmp_path):
    rc, _, stderr = _run(["swap", str(tmp_path / "nope"), "--variant", "ssmax", "--out", str(tmp_path / "o")])
    assert rc == 2 and "smx swap: checkpoint" in stderr and "does not exist" in stderr
    rc, _, stderr = _run(["eval", str(tmp_path / "nope")])
    assert rc == 2 and "smx eval: checkpoint" in stderr and "does not exist" in stderr
    rc, _, stderr = _run(["eval", str(tmp_path)])
    assert rc == 2 and "no config.json" in stderr


def test_swap_refuses_to_overwrite_or_swap_twice(ckpt, ssmax_run, tmp_path):
    rc, _, stderr = _run(["swap", str(ckpt), "--variant", "ssmax", "--out", str(ckpt / "checkpoint")])
    assert rc == 2 and "overwrite" in stderr
    rc, _, stderr = _run(["swap", str(ckpt), "--variant", "ssmax", "--out", str(ckpt)])
    assert rc == 2 and "overwrite" in stderr
    rc, _, stderr = _run(["swap", str(ssmax_run[0]), "--variant", "ssmax", "--out", str(tmp_path / "o")])
    assert rc == 2 and "swapped model already" in stderr and not (tmp_path / "o").exists()


def test_help_teaches(capsys):
    text = cli.build_parser().format_help()
    assert "swap" in text and "eval" in text and "smx swap --list-variants" in text
    for argv, needles in ((["swap", "--help"], ("examples:", "--calibrate", "--finetune", "--param", "results.json",
                                                 "not applicable", "--list-variants", "held out")),
                          (["eval", "--help"], ("examples:", "--batches", "--json", "sink mass", "perplexity"))):
        with pytest.raises(SystemExit) as ei:
            cli.main(argv)
        assert ei.value.code == 0
        out = " ".join(capsys.readouterr().out.split())
        for n in needles:
            assert n in out, (argv, n)

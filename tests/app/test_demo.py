"""`smx demo --quick` end to end: train under every backend, agree, save, reload, report."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from smx_app import demo  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smx demo")
    demo.add_arguments(parser)
    return parser


def test_help_teaches():
    text = _parser().format_help()
    for needle in ("--quick", "--backends", "--steps", "--vocab-size", "--tolerance", "--out", "examples:", "smx demo --quick"):
        assert needle in text


def test_settings_quick_and_overrides():
    s = demo.resolve_settings(_parser().parse_args(["--quick", "--steps", "3"]))
    assert s.steps == 3 and s.vocab_size == demo.QUICK["vocab_size"] and s.quick
    full = demo.resolve_settings(_parser().parse_args([]))
    assert full.vocab_size >= 16384 and full.backends == ["eager", "inductor", "smx"]
    with pytest.raises(ValueError):
        demo.resolve_settings(_parser().parse_args(["--n-embd", "30", "--heads", "4"]))


def test_compare_catches_a_wrong_backend():
    ref = demo.BackendRun("eager", losses=[9.0, 8.0, 7.0])
    good = demo.BackendRun("inductor", losses=[9.0, 8.0 + 1e-6, 7.0 - 1e-6])
    bad = demo.BackendRun("smx", losses=[9.0, 8.0, 7.1])
    out = demo.compare([ref, good, bad], tolerance=1e-3)
    assert out["backends"]["inductor"]["agrees"] and not out["backends"]["smx"]["agrees"]
    assert not out["passed"]


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    out = tmp_path / "demo"
    args = _parser().parse_args(["--quick", "--out", str(out), "--device", "cpu"])
    result = demo.run_demo(args)
    assert result.exit_code == 0, result.results.get("agreement")

    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    backends = settings["backends"]
    assert backends == ["eager", "inductor", "smx"]
    for name in backends:
        b = results["backends"][name]
        assert b["error"] is None, b["error"]
        assert len(b["losses"]) == settings["steps"]
        assert all(abs(x - y) <= settings["tolerance"] * abs(y) for x, y in zip(b["losses"], results["backends"]["eager"]["losses"]))
    assert results["agreement"]["passed"]
    for name in backends[1:]:  # step-1 gradients were compared, and agree
        assert results["agreement"]["backends"][name]["grad_max_rel_err"] <= settings["grad_tolerance"]
    assert results["model"]["eager_attention_verified"]
    # training did something: same first loss everywhere, and it went down
    eager = results["backends"]["eager"]["losses"]
    assert eager[-1] < eager[0]

    # the checkpoint reloads and reproduces the trained model's logits
    ckpt = out / "checkpoint"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "config.json").exists()
    assert (ckpt / "tokenizer.json").exists()
    trained = next(r.model for r in result.runs if r.name == results["checkpoint"]["backend"])
    assert results["checkpoint"]["backend"] == "smx"
    trained.eval()
    batch = result.eval_batch.cpu()
    with torch.no_grad():
        want = trained(input_ids=batch).logits
        # same weights, same (eager) attention: the same logits
        loaded = GPT2LMHeadModel.from_pretrained(ckpt, attn_implementation="eager").eval()
        torch.testing.assert_close(loaded(input_ids=batch).logits, want, rtol=0, atol=1e-6)
        # transformers' default attention (SDPA) computes the same function
        default = GPT2LMHeadModel.from_pretrained(ckpt).eval()
        torch.testing.assert_close(default(input_ids=batch).logits, want, rtol=1e-4, atol=1e-4)
    assert results["checkpoint"]["reload_max_abs_logit_diff"] <= 1e-6
    tok = PreTrainedTokenizerFast.from_pretrained(ckpt)
    assert tok.decode(tok("def f(x): return x")["input_ids"]) == "def f(x): return x"

    # the rewrite report lists one attention site per transformer layer, with its causal mask recognised;
    # --quick's 64 tokens are below the CPU policy's threshold: kept, saying why
    report = results["report"]
    assert report is not None, results["report_note"]
    attention_sites = [site for site in report["sites"] if site["kind"] == "attention"]
    assert len(attention_sites) == settings["layers"], report
    assert all("causal" in site["detail"] for site in attention_sites), report
    assert all(site["action"] == "kept" and "keys; below" in site["reason"] for site in attention_sites), report
    assert not [site for site in report["sites"] if site["kind"] == "softmax"], report
    # the LM head + loss is one linear -> cross-entropy site (kept on CPU below 4096 classes: --quick has 2048)
    ce_sites = [site for site in report["sites"] if site["kind"] == "linear_cross_entropy"]
    assert [site["action"] for site in ce_sites] == ["kept"], ce_sites
    assert "2048 classes" in ce_sites[0]["reason"]


def _register_test_backends() -> None:
    """Two backends that must make the demo fail: one that crashes, one with a wrong softmax."""
    import torch.nn.functional as F
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    def broken(gm, example_inputs):
        raise RuntimeError("this backend always fails")

    def hot_softmax(gm, example_inputs):
        # softmax(1.5 * x): a kernel that gets the scale wrong
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in (F.softmax, torch.softmax):
                with gm.graph.inserting_before(node):
                    scaled = gm.graph.call_function(torch.mul, (node.args[0], 1.5))
                node.args = (scaled,) + tuple(node.args[1:])
        gm.recompile()
        return gm.forward

    for name, fn in (("smx_demo_test_broken", broken), ("smx_demo_test_hot_softmax", hot_softmax)):
        if name not in _COMPILER_FNS:
            register_backend(compiler_fn=fn, name=name)


@pytest.mark.parametrize("backend,why", [("smx_demo_test_broken", "failed"), ("smx_demo_test_hot_softmax", "step-1 gradient")])
def test_demo_fails_on_a_wrong_backend(tmp_path, backend, why):
    _register_test_backends()
    args = _parser().parse_args(["--quick", "--steps", "4", "--backends", f"eager,{backend}", "--out", str(tmp_path),
                                 "--device", "cpu"])
    result = demo.run_demo(args)
    assert result.exit_code == 1
    verdict = result.results["agreement"]["backends"][backend]
    assert not verdict["agrees"] and verdict["why"].startswith(why), verdict


def test_unknown_backend_is_a_usage_error(tmp_path):
    args = _parser().parse_args(["--quick", "--backends", "eager,no_such_backend", "--out", str(tmp_path)])
    assert demo.run(args) == 2


def test_peak_memory_sees_a_temporary_allocation():
    with demo.PeakMemory("cpu") as mem:
        x = torch.ones(16 * 2**20)  # 64 MiB, freed before the region ends
        del x
    assert mem.peak_bytes is not None and mem.method
    assert mem.peak_bytes >= 48 * 2**20, (mem.peak_bytes, mem.method)

"""smxcompile.export_onnx: the rewritten graph exported to ONNX and checked in onnxruntime (issue 8, first part)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

import smxcompile  # noqa: E402
from smxcompile import OnnxExportError, export_onnx  # noqa: E402


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x, temperature: float = 2.0):
        z = self.lin(x)
        return torch.softmax(z / temperature, dim=-1), F.log_softmax(z, dim=1)


def _onnx_ops(path):
    import onnx

    return [n.op_type for n in onnx.load(str(path)).graph.node]


def test_softmax_and_log_softmax_export_as_their_onnx_ops(tmp_path):
    torch.manual_seed(0)
    m, x = Heads().eval(), torch.randn(4, 8)
    out = export_onnx(m, (x,), tmp_path / "heads.onnx")
    assert out.report.summary() == {"softmax": {"rewritten": 1}, "log_softmax": {"rewritten": 1}}, str(out.report)
    ops = _onnx_ops(out.path)
    assert ops.count("Softmax") == 1 and ops.count("LogSoftmax") == 1 and "Exp" not in ops
    assert out.op_types["Softmax"] == 1 and out.opset >= 18
    assert out.max_abs_diff < 1e-5
    # the file runs on its own: a new input, compared with eager
    sess = ort.InferenceSession(str(out.path), providers=["CPUExecutionProvider"])
    x2 = torch.randn(4, 8)
    got = sess.run(None, {sess.get_inputs()[0].name: x2.numpy()})
    with torch.no_grad():
        ref = m(x2)
    for g, r in zip(got, ref):
        torch.testing.assert_close(torch.from_numpy(g), r, rtol=1e-5, atol=1e-6)


def test_keyword_inputs_and_a_transformers_model(tmp_path):
    model, ids = _tiny_gpt2()
    out = export_onnx(model, (), tmp_path / "gpt2.onnx", kwargs={"input_ids": ids})
    assert out.report.count(kind="attention", action="rewritten") == 2, str(out.report)
    assert out.max_abs_diff < 1e-4


def test_an_op_without_translation_names_it_and_the_way_out(tmp_path, monkeypatch):
    from smxcompile.export.onnx import translate

    class Attn(nn.Module):
        def forward(self, q, k, v):
            s = q @ k.transpose(-2, -1) * 0.25
            return torch.softmax(s, dim=-1) @ v

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    opts = {"cpu": "rewrite", "attention_normalizer": "sigmoid"}    # the attention op with a variant normalizer
    # smx::attention is translated (export/onnx/attention.py): it exports as standard ops
    out = export_onnx(Attn(), (q, k, v), tmp_path / "a.onnx", options=opts, check=False)  # the model changed: no eager check
    assert out.report.count(kind="attention", action="rewritten") == 1 and out.op_types.get("Sigmoid") == 1
    # an op whose translation module is missing: the error names the op and the option that exports it unrewritten
    monkeypatch.setattr(translate, "TRANSLATION_MODULES",
                        tuple(m for m in translate.TRANSLATION_MODULES if m != "attention"))
    with pytest.raises(OnnxExportError, match=r"smx::attention .*has no ONNX translation.*'disable': \['attention'\]"):
        export_onnx(Attn(), (q, k, v), tmp_path / "a.onnx", options=opts)
    out = export_onnx(Attn(), (q, k, v), tmp_path / "a.onnx", options={**opts, "disable": ["attention"]})
    assert out.op_types.get("Softmax") == 1


def test_a_router_exports_topk_without_a_full_softmax(tmp_path):
    class Router(nn.Module):
        def forward(self, x):
            return torch.topk(torch.softmax(x, dim=-1), 2, dim=-1)

    x = torch.randn(6, 16)
    out = export_onnx(Router(), (x,), tmp_path / "r.onnx", target="portable")
    assert out.report.count(kind="softmax_topk", action="rewritten") == 1, str(out.report)
    assert "TopK" in out.op_types and "Softmax" not in out.op_types, out.op_types   # exp(topk - max): no full softmax
    assert out.max_abs_diff < 1e-6
    plain = export_onnx(Router(), (x,), tmp_path / "p.onnx", target="portable", rewrites=())
    assert plain.op_types == {"Softmax": 1, "TopK": 1}, plain.op_types


def test_a_renormalizing_router(tmp_path):
    class Mixtral(nn.Module):
        def forward(self, x):
            w, i = torch.topk(torch.softmax(x, dim=-1, dtype=torch.float), 2, dim=-1)
            return w / w.sum(dim=-1, keepdim=True), i

    out = export_onnx(Mixtral(), (torch.randn(5, 8),), tmp_path / "m.onnx")
    assert out.report.count(kind="softmax_topk", action="rewritten") == 1, str(out.report)
    assert out.max_abs_diff < 1e-6


def test_a_graph_break_is_a_clear_error(tmp_path):
    class Breaks(nn.Module):
        def forward(self, x):
            y = torch.softmax(x, -1)
            if y.sum().item() > 0:          # data-dependent Python control flow: a graph break
                y = y * 2
            return y

    with pytest.raises(OnnxExportError, match="does not trace as one graph"):
        export_onnx(Breaks(), (torch.randn(2, 3),), tmp_path / "b.onnx")


def test_the_check_catches_a_wrong_translation(tmp_path, monkeypatch):
    from smxcompile.export.onnx import export as onnx_export

    real = onnx_export.translation_table

    def wrong(target=None):
        from onnxscript import opset18 as op

        table = real(target)

        def bad_softmax(x, dim: int, scale: float = 1.0, softcap=None, mask=None, dtype=None, return_lse: bool = False):
            return op.Softmax(x, axis=0), op.ReduceLogSumExp(x, op.Constant(value_ints=[dim]), keepdims=0)

        table[torch.ops.smx.softmax.default] = bad_softmax
        return table

    monkeypatch.setattr(onnx_export, "translation_table", wrong)
    with pytest.raises(OnnxExportError, match="output 0: onnxruntime differs from eager"):
        export_onnx(Heads().eval(), (torch.randn(4, 8),), tmp_path / "w.onnx")


def test_exported_name_is_public():
    assert smxcompile.export_onnx is export_onnx


def test_dynamic_batch_and_sequence_stay_dynamic(tmp_path):
    model, _ = _tiny_gpt2()
    g = torch.Generator().manual_seed(0)
    ids, mask = torch.randint(0, 97, (2, 16), generator=g), torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0                                         # left padding
    ids2, mask2 = torch.randint(0, 97, (3, 9), generator=g), torch.ones(3, 9, dtype=torch.long)
    mask2[0, :2] = 0
    dims = {0: "batch", 1: "seq"}
    out = export_onnx(model, (), tmp_path / "gpt2_dyn.onnx", kwargs={"input_ids": ids, "attention_mask": mask},
                      dynamic_shapes={"input_ids": dims, "attention_mask": dims},
                      check_inputs=[((), {"input_ids": ids2, "attention_mask": mask2})])
    sess = ort.InferenceSession(str(out.path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    assert names == ["input_ids", "attention_mask"]
    assert all(isinstance(d, str) for i in sess.get_inputs() for d in i.shape)     # symbolic, not 2 / 16
    assert out.max_abs_diff < 1e-4
    # the example, check_inputs, and the example narrowed along the dims that can shrink (batch 2 cannot)
    assert out.checked_shapes == [((2, 16), (2, 16)), ((3, 9), (3, 9)), ((2, 15), (2, 15))], out.checked_shapes


def test_a_dynamic_dim_of_size_one_is_refused(tmp_path):
    with pytest.raises(OnnxExportError, match="size >= 2"):
        export_onnx(Heads().eval(), (torch.randn(1, 8),), tmp_path / "h.onnx", dynamic_shapes={"x": {0: "batch"}})


def _tiny_gpt2():
    from model_builders import tiny_gpt2

    return tiny_gpt2()


@pytest.mark.parametrize("variant", ["ssmax", "sparsemax"])
def test_a_swapped_model_exports_its_variant(tmp_path, variant):
    model, ids = _tiny_gpt2()
    sw = smxcompile.swap(model, variant, example_inputs={"input_ids": ids})
    with torch.no_grad():
        for n, p in sw.named_parameters():
            if n.startswith("smx_swap."):
                p.mul_(1.5)                                   # trained values must reach the file
    out = export_onnx(sw, (), tmp_path / f"{variant}.onnx", kwargs={"input_ids": ids},
                      dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}},
                      check_inputs=[((), {"input_ids": ids[:1, :7]})])
    assert out.report.count(kind="attention", action="swapped") == 2, str(out.report)
    assert out.max_abs_diff < 1e-4


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_model_exports_quantize_dequantize_pairs(tmp_path, bits):
    model, ids = _tiny_gpt2()
    q = smxcompile.quantize_softmax(model, [{"input_ids": ids}], bits=bits, progress=False)
    out = export_onnx(q, (), tmp_path / f"q{bits}.onnx", kwargs={"input_ids": ids})
    assert out.report.count(kind="quant_softmax", action="rewritten") == 2, str(out.report)
    assert out.op_types.get("QuantizeLinear") == 2 and out.op_types.get("DequantizeLinear") == 2, out.op_types
    assert (out.op_types.get("Clip", 0) >= 2) == (bits < 8)
    assert out.max_abs_diff < 1e-4


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A tiny ``smx demo``-style run folder (trained 40 steps on Python's docs)."""
    pytest.importorskip("tokenizers")
    from model_builders import build_tiny_lm_checkpoint

    return build_tiny_lm_checkpoint(tmp_path_factory.mktemp("demo-run"))


def test_smx_export_cli(demo_run, tmp_path, capsys):
    from smx_app import cli

    run = demo_run
    assert cli.main(["export", str(run), "--out", str(tmp_path / "tiny.onnx"), "--seq-len", "16"]) == 0
    printed = capsys.readouterr().out
    assert "attention" in printed and "wrote" in printed and "max |diff|" in printed
    sess = ort.InferenceSession(str(tmp_path / "tiny.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["input_ids"]
    assert cli.main(["export", str(run), "--out", str(tmp_path / "p.onnx"), "--seq-len", "16", "--target", "portable",
                     "--compare"]) == 0
    printed = capsys.readouterr().out
    assert "target portable, attention as decompose" in printed and "onnxruntime CPU latency: plain" in printed
    assert cli.main(["export", str(run), "--out", str(tmp_path / "x.onnx"), "--options", '{"nope": 1}']) == 2
    assert "unknown smx option" in capsys.readouterr().err
    assert cli.main(["export", str(run), "--out", str(tmp_path / "x.onnx"), "--rewrites", "attention,sofmax"]) == 2
    assert "unknown kind(s) ['sofmax']" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "x.onnx")]) == 2


def test_a_branch_on_a_dynamic_size_is_refused_not_baked_in(tmp_path):
    class Branch(nn.Module):
        def forward(self, x):
            y = x * 2 if x.shape[1] > 8 else x             # only one branch reaches the graph
            return torch.softmax(y, -1)

    x = torch.randn(2, 12, 16)
    with pytest.raises(OnnxExportError, match=r"only holds for sizes in \[9, inf\]"):
        export_onnx(Branch(), (x,), tmp_path / "b.onnx", dynamic_shapes={"x": {0: "b", 1: "t"}})
    assert not hasattr(x, "_dynamo_dynamic_indices")         # the caller's tensor is left as it was
    dim = torch.export.Dim("t", min=9)                        # declared: exported, valid from 9 on
    out = export_onnx(Branch(), (x,), tmp_path / "b.onnx", dynamic_shapes={"x": {0: "b", 1: dim}})
    assert out.max_abs_diff < 1e-6


def test_bf16_is_a_clear_error(tmp_path):
    with pytest.raises(OnnxExportError, match="bf16"):
        export_onnx(Heads().to(torch.bfloat16).eval(), (torch.randn(4, 8, dtype=torch.bfloat16),), tmp_path / "h.onnx")


class FusedSoftmaxes(nn.Module):
    """A softmax with a scale and an additive mask, a soft-capped log-softmax, fp16 softmaxes with and without dtype=."""

    def forward(self, x, mask):
        a = torch.softmax(x * 0.5 + mask, -1)
        b = F.log_softmax(30.0 * torch.tanh(x / 30.0), dim=-1)
        c = torch.softmax(x.half() * 2.0, -1, dtype=torch.float32)
        d = torch.softmax(x.half(), -1)
        return a, b, c, d


def test_softmax_prologue_options_export(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16) * 4
    mask = torch.zeros(5, 16)
    mask[:, 11:] = float("-inf")
    mask[0, 7] = torch.finfo(torch.float32).min
    mask[4, :] = float("-inf")                                   # a fully masked row: NaN, as eager
    out = export_onnx(FusedSoftmaxes(), (x, mask), tmp_path / "f.onnx", rtol=1e-3, atol=1e-4)
    sites = [s.detail for s in out.report.sites if s.action == "rewritten"]
    assert any("mask" in d and "scale=0.5" in d for d in sites) and any("softcap=30" in d for d in sites), sites
    assert any("dtype=float32" in d for d in sites), sites
    assert out.op_types.get("Tanh") == 1 and out.op_types.get("LogSoftmax") == 1, out.op_types
    sess = ort.InferenceSession(str(out.path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x.numpy(), "mask": mask.numpy()})
    with torch.no_grad():
        ref = FusedSoftmaxes()(x, mask)
    assert got[0][:, 4].size and torch.from_numpy(got[0][:, 4]).isnan().all()
    assert got[2].dtype.name == "float32" and got[3].dtype.name == "float16"
    # against an fp64 gold: no worse than torch itself (+ one fp16 step for the fp16 outputs)
    x64, m64 = x.double(), mask.double()
    gold = (torch.softmax(x64 * 0.5 + m64, -1), F.log_softmax(30.0 * torch.tanh(x64 / 30.0), -1),
            torch.softmax(x.half().double() * 2.0, -1), torch.softmax(x.half().double(), -1))
    for g, r, gd, tol in zip(got, ref, gold, (1e-6, 1e-5, 1e-6, 1e-3)):
        ours = (torch.from_numpy(g).double() - gd).abs().nan_to_num(0).max()
        theirs = (r.double() - gd).abs().nan_to_num(0).max()
        assert ours <= theirs + tol, (ours, theirs)


@pytest.mark.parametrize("target", ["onnxruntime", "portable"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_forms_per_target(tmp_path, target, renormalize):
    class Sampler(nn.Module):
        def forward(self, x):
            w, i = torch.topk(torch.softmax(x, dim=-1), 3, dim=-1)
            return (w / w.sum(-1, keepdim=True) if renormalize else w), i

    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 3
    x[2] = float("-inf")                                       # an all -inf row: NaN probabilities, as eager
    x[2, :5] = torch.arange(5.0)
    out = export_onnx(Sampler(), (x,), tmp_path / "s.onnx", target=target)
    assert out.report.count(kind="softmax_topk", action="rewritten") == 1, str(out.report)
    assert out.exported["smx::softmax_topk"]["calls"] == 1
    full_softmax = out.op_types.get("Softmax", 0) and "Softmax" in out.exported["smx::softmax_topk"]["onnx"] \
        and not renormalize
    # portable: never a full Softmax; onnxruntime: its fused Softmax + TopK (measured faster); renormalized:
    # the Softmax is over the k values only
    assert bool(full_softmax) == (target == "onnxruntime" and not renormalize), out.op_types
    assert "TopK" in out.op_types and out.max_abs_diff < 1e-6


def test_rewrites_selects_kinds_and_compare_reports_both_files(tmp_path):
    class TwoSites(nn.Module):
        def forward(self, x):
            return torch.softmax(x, -1), torch.topk(torch.softmax(x * 2, -1), 2, -1)[0]

    x = torch.randn(8, 32)
    only = export_onnx(TwoSites(), (x,), tmp_path / "a.onnx", rewrites=["softmax_topk"])
    assert only.report.count(kind="softmax_topk", action="rewritten") == 1
    assert only.report.count(kind="softmax", action="rewritten") == 0
    none = export_onnx(TwoSites(), (x,), tmp_path / "b.onnx", rewrites=())
    assert none.exported == {} and none.report.count(action="rewritten") == 0
    with pytest.raises(OnnxExportError, match="unknown rewrite kind"):
        export_onnx(TwoSites(), (x,), tmp_path / "c.onnx", rewrites=["softmx"])
    out = export_onnx(TwoSites(), (x,), tmp_path / "d.onnx", compare=True)
    assert out.baseline is not None and out.baseline.error is None
    assert out.baseline.latency_ms > 0 and out.latency_ms > 0
    assert sum(out.baseline.op_types.values()) > 0
    text = str(out)
    assert "plain torch.onnx.export -> smxcompile export" in text and "onnxruntime CPU latency" in text
    assert "smx::softmax x1 -> Softmax 1" in text
    assert out.to_dict()["baseline"]["latency_ms"] == out.baseline.latency_ms


def test_bad_target_and_opset_are_clear_errors(tmp_path):
    x = torch.randn(4, 8)
    with pytest.raises(OnnxExportError, match="target must be one of"):
        export_onnx(Heads().eval(), (x,), tmp_path / "h.onnx", target="tensorrt")
    with pytest.raises(OnnxExportError, match="opset must be an int >= 18"):
        export_onnx(Heads().eval(), (x,), tmp_path / "h.onnx", opset=13)
    with pytest.raises(OnnxExportError, match="contrib op"):
        export_onnx(Heads().eval(), (x,), tmp_path / "h.onnx", target="portable", attention_op="MultiHeadAttention")
    out = export_onnx(Heads().eval(), (x,), tmp_path / "h.onnx", target="portable", opset=20)
    assert out.opset == 20 and out.target.name == "portable" and not out.target.contrib


def test_a_file_onnxruntime_cannot_load_names_its_versions(tmp_path, monkeypatch):
    import onnx

    from smxcompile.export.onnx.runtime import ort_session

    out = export_onnx(Heads().eval(), (torch.randn(4, 8),), tmp_path / "h.onnx", check=False)
    proto = onnx.load(str(out.path))
    proto.ir_version = 99                                          # a file from a newer exporter
    onnx.save(proto, str(tmp_path / "future.onnx"))
    with pytest.raises(OnnxExportError, match=r"cannot load future.onnx \(IR version 99"):
        ort_session(tmp_path / "future.onnx")


def test_the_demo_checkpoint_swapped_and_quantized_exports(demo_run, tmp_path, capsys):
    """The issue's end-to-end path: `smx swap` of the demo checkpoint, then `smx export` of its output; and the
    demo checkpoint with quantize_softmax through export_onnx; both checked in onnxruntime on two shapes."""
    from smx_app import cli, lm

    swapped = tmp_path / "softpick-run"
    assert cli.main(["swap", str(demo_run), "--variant", "softpick", "--out", str(swapped), "--batches", "1", "--batch-size", "2", "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["export", str(swapped), "--out", str(tmp_path / "softpick.onnx"), "--seq-len", "16"]) == 0
    printed = capsys.readouterr().out
    assert "swapped" in printed and "variant:softpick" in printed, printed
    model = lm.load_lm(lm.checkpoint_dir(demo_run), "cpu")
    model.config.use_cache = False
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    q = smxcompile.quantize_softmax(model, [{"input_ids": ids}], bits=6, progress=False)
    out = export_onnx(q, (), tmp_path / "q6.onnx", kwargs={"input_ids": ids},
                      dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}},
                      check_inputs=[((), {"input_ids": torch.randint(0, 512, (3, 9), generator=g)})])
    assert out.report.count(kind="quant_softmax", action="rewritten") == 2, str(out.report)
    assert out.exported["smx::quant_softmax"]["calls"] == 2
    assert out.exported["smx::quant_softmax"]["onnx"].get("QuantizeLinear") == 2


def test_usage_errors_are_clear_and_early(tmp_path):
    x = torch.randn(4, 8)
    h = Heads().eval()
    with pytest.raises(OnnxExportError, match="rewrites must be 'all' or a list"):
        export_onnx(h, (x,), tmp_path / "h.onnx", rewrites=None)
    with pytest.raises(OnnxExportError, match=r"check_inputs must be a list of \(args, kwargs\) pairs"):
        export_onnx(h, (x,), tmp_path / "h.onnx", check_inputs=[{"x": x}])
    with pytest.raises(OnnxExportError, match="is a directory"):
        export_onnx(h, (x,), tmp_path)
    with pytest.raises(OnnxExportError, match="rtol must be a number >= 0"):
        export_onnx(h, (x,), tmp_path / "h.onnx", rtol=-1)
    with pytest.raises(OnnxExportError, match="newer than the installed onnx package"):
        export_onnx(h, (x,), tmp_path / "h.onnx", target="portable", opset=99)
    with pytest.raises(OnnxExportError, match=r"fails on the example inputs .*TorchRuntimeError"):
        export_onnx(h, (torch.randn(4, 5),), tmp_path / "h.onnx")         # the model itself fails (8 features)


def test_graph_break_messages_name_the_cause(tmp_path):
    model, _ = _tiny_gpt2()
    with pytest.raises(OnnxExportError, match=r"graph break.*You have to specify either input_ids"):
        export_onnx(model, (), tmp_path / "g.onnx")                      # no inputs at all


def test_training_mode_attention_dropout_is_refused_up_front(tmp_path):
    from model_builders import tiny_gpt2

    model = tiny_gpt2(n_layer=1, attn_pdrop=0.1)[0].train()
    with pytest.raises(OnnxExportError, match=r"dropout_p=0.1.*no exact ONNX form.*model.eval\(\)"):
        export_onnx(model, (), tmp_path / "t.onnx", kwargs={"input_ids": torch.randint(0, 97, (2, 8))})


def test_compare_uses_a_dynamic_baseline_and_dims_keep_their_names(tmp_path):
    from torch.export import Dim

    model, ids = _tiny_gpt2()
    out = export_onnx(model, (), tmp_path / "c.onnx", kwargs={"input_ids": ids}, compare=True,
                      dynamic_shapes={"input_ids": {0: Dim("batch"), 1: "seq"}})    # Dim("batch"): min 0
    assert out.baseline.error is None and out.baseline.dynamic, out.baseline
    assert "static shapes" not in str(out)
    sess = ort.InferenceSession(str(out.path), providers=["CPUExecutionProvider"])
    assert sess.get_inputs()[0].shape == ["batch", "seq"] and sess.get_outputs()[0].shape == ["batch", "seq", 97]
    assert out.dynamic and ((2, 15),) in out.checked_shapes

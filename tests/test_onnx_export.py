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


def test_an_op_without_translation_names_it_and_the_way_out(tmp_path):
    class Attn(nn.Module):
        def forward(self, q, k, v):
            s = q @ k.transpose(-2, -1) * 0.25
            return torch.softmax(s, dim=-1) @ v

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    opts = {"cpu": "rewrite", "attention_normalizer": "sigmoid"}    # the attention op with a variant normalizer
    with pytest.raises(OnnxExportError, match=r"smx::attention .*'disable': \['attention'\]"):
        export_onnx(Attn(), (q, k, v), tmp_path / "a.onnx", options=opts)
    out = export_onnx(Attn(), (q, k, v), tmp_path / "a.onnx", options={**opts, "disable": ["attention"]})
    assert out.op_types.get("Softmax") == 1


def test_a_router_exports_topk_without_a_full_softmax(tmp_path):
    class Router(nn.Module):
        def forward(self, x):
            return torch.topk(torch.softmax(x, dim=-1), 2, dim=-1)

    x = torch.randn(6, 16)
    out = export_onnx(Router(), (x,), tmp_path / "r.onnx")
    assert out.report.count(kind="softmax_topk", action="rewritten") == 1, str(out.report)
    assert "TopK" in out.op_types and "Softmax" not in out.op_types, out.op_types   # exp(topk - lse): no full softmax
    assert out.max_abs_diff < 1e-6
    plain = export_onnx(Router(), (x,), tmp_path / "p.onnx", options={"cpu": "rewrite", "disable": ["softmax_topk"]})
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
    from smxcompile.backends import onnx as onnx_backend

    real = onnx_backend._translations

    def wrong(target=None):
        from onnxscript import opset18 as op

        table = real(target)

        def bad_softmax(x, dim: int, scale: float = 1.0, softcap=None, mask=None, dtype=None, return_lse: bool = False):
            return op.Softmax(x, axis=0), op.ReduceLogSumExp(x, op.Constant(value_ints=[dim]), keepdims=0)

        table[torch.ops.smx.softmax.default] = bad_softmax
        return table

    monkeypatch.setattr(onnx_backend, "_translations", wrong)
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


def test_a_dynamic_dim_of_size_one_is_refused(tmp_path):
    with pytest.raises(OnnxExportError, match="size >= 2"):
        export_onnx(Heads().eval(), (torch.randn(1, 8),), tmp_path / "h.onnx", dynamic_shapes={"x": {0: "batch"}})


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                  eos_token_id=0, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval(), torch.randint(0, 97, (2, 16),
                                                                    generator=torch.Generator().manual_seed(0))


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


def test_smx_export_cli(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from conftest import build_tiny_lm_checkpoint

    from smxcompile import cli

    run = build_tiny_lm_checkpoint(tmp_path / "run")
    assert cli.main(["export", str(run), "--out", str(tmp_path / "tiny.onnx"), "--seq-len", "16"]) == 0
    printed = capsys.readouterr().out
    assert "attention" in printed and "wrote" in printed and "max |diff|" in printed
    sess = ort.InferenceSession(str(tmp_path / "tiny.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["input_ids"]
    assert cli.main(["export", str(run), "--out", str(tmp_path / "x.onnx"), "--options", '{"nope": 1}']) == 2
    assert "unknown smx option" in capsys.readouterr().err
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

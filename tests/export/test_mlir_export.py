"""smxcompile.export_mlir: the rewritten graph through torch-mlir (torch / linalg-on-tensors / stablehlo), with
smxcompile's ops decomposed to their reference ATen forms or kept as ``torch.operator``; linalg-on-tensors
modules run on the LLVM JIT and compared with eager PyTorch."""

from __future__ import annotations

import contextlib
import itertools
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("torch_mlir", reason="torch-mlir not installed: pip install smxcompile[mlir]")

import smxcompile  # noqa: E402
from smxcompile import MlirExportError, export_mlir  # noqa: E402
from smxcompile.export.mlir import export as M  # noqa: E402
from smxcompile.export.mlir.run import LinalgModule, RunError  # noqa: E402
from smxcompile.kernels import decompositions as D  # noqa: E402

TYPES = ["torch", "linalg-on-tensors", "stablehlo"]


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        z = self.lin(x)
        return torch.softmax(z / 2.0, dim=-1), F.log_softmax(z, dim=0)


class Router(nn.Module):
    def __init__(self, renormalize: bool):
        super().__init__()
        self.renormalize = renormalize

    def forward(self, x):
        w, i = torch.topk(torch.softmax(x, dim=-1), 3, dim=-1)
        return (w / w.sum(-1, keepdim=True) if self.renormalize else w), i


class Attn(nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v


def _no_smx_left(out):
    assert out.decomposed and not out.custom_ops, out.custom_ops
    assert not any(k.startswith("torch.operator") for k in out.ops), out.ops
    assert "smx" not in out.text


def _dialect_only(out):
    """linalg-on-tensors / stablehlo: no torch dialect op is left."""
    assert not any(k.startswith("torch.") for k in out.ops), out.ops


def _run(out, *tensors):
    return [torch.from_numpy(a) for a in LinalgModule(out.text).run(*[t.numpy() for t in tensors])]


# --------------------------------------------------------------------------- softmax, log_softmax, top-k


@pytest.mark.parametrize("output_type", TYPES)
def test_softmax_and_log_softmax(output_type, tmp_path):
    torch.manual_seed(0)
    m, x = Heads().eval(), torch.randn(4, 8)
    out = export_mlir(m, (x,), output_type=output_type, path=tmp_path / "heads.mlir")
    assert out.report.summary() == {"softmax": {"rewritten": 1}, "log_softmax": {"rewritten": 1}}, str(out.report)
    assert out.output_type == output_type and out.path.read_text() == out.text
    _no_smx_left(out)
    if output_type == "torch":
        assert out.checked == "verified" and out.ops.get("torch.aten.exp", 0) >= 2, out.ops
    elif output_type == "linalg-on-tensors":
        _dialect_only(out)
        assert out.checked == "run" and out.max_abs_diff < 1e-5, (out.checked, out.max_abs_diff)
        assert out.ops["math.exp"] >= 2 and "linalg.generic" in out.ops
        x2 = torch.randn(4, 8)                      # the module on its own, against the eager model
        with torch.no_grad():
            ref = m(x2)
        for got, r in zip(_run(out, x2), ref):
            torch.testing.assert_close(got, r, rtol=1e-5, atol=1e-6)
    else:
        _dialect_only(out)
        assert out.checked == "verified" and out.ops["stablehlo.exponential"] >= 2, out.ops


@pytest.mark.parametrize("output_type,renormalize", [("linalg-on-tensors", False), ("linalg-on-tensors", True),
                                                     ("stablehlo", False), ("torch", True)])
def test_softmax_topk(output_type, renormalize):
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    out = export_mlir(Router(renormalize), (x,), output_type=output_type)
    assert out.report.count(kind="softmax_topk", action="rewritten") == 1, str(out.report)
    _no_smx_left(out)
    if output_type == "linalg-on-tensors":
        assert out.checked == "run" and out.max_abs_diff < 1e-6
        v, i = _run(out, x)
        ev, ei = Router(renormalize)(x)
        torch.testing.assert_close(v, ev, rtol=1e-5, atol=1e-7)
        assert torch.equal(i, ei)


def test_cross_entropy_statistics_decompose():
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 12)

        def forward(self, x, y):
            return F.cross_entropy(self.lin(x), y, label_smoothing=0.1)

    torch.manual_seed(0)
    x, y = torch.randn(5, 8), torch.randint(0, 12, (5,))
    y[2] = -100
    out = export_mlir(Loss().eval(), (x, y), output_type="linalg-on-tensors")
    assert out.report.count(kind="linear_cross_entropy", action="rewritten") == 1, str(out.report)
    _no_smx_left(out)
    assert out.checked == "run" and out.max_abs_diff < 1e-5


# --------------------------------------------------------------------------- attention


@pytest.fixture(scope="module")
def gpt2():
    from model_builders import tiny_gpt2

    return tiny_gpt2(seq_len=12)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("output_type", TYPES)
def test_gpt2_attention(gpt2, output_type):
    model, ids = gpt2
    out = export_mlir(model, (), kwargs={"input_ids": ids}, output_type=output_type)
    assert out.report.count(kind="attention", action="rewritten") == 2, str(out.report)
    _no_smx_left(out)
    if output_type == "torch":
        # softmax attention is torch's fused SDPA op, kept whole
        assert out.ops.get("torch.aten.scaled_dot_product_attention") == 2, out.ops
    elif output_type == "linalg-on-tensors":
        _dialect_only(out)
        assert out.ops.get("tm_tensor.attention") == 2, out.ops      # still one fused op per layer
        assert out.checked == "run" and out.max_abs_diff < 1e-4
        ids2 = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
        compiled = LinalgModule(out.text)
        (got,) = compiled.run(ids2.numpy())
        torch.testing.assert_close(torch.from_numpy(got), _logits(model, ids2), rtol=1e-4, atol=1e-4)
        # the runner refuses inputs that do not fit @main (they used to reach the code's bounds assertions,
        # which abort the process)
        assert compiled.signatures["main"] == [((2, 12), "i64")]
        with pytest.raises(RunError, match=r"tensor<2x12xi64>; the input has shape \(2, 8\)"):
            compiled.run(ids2[:, :8].numpy())
        with pytest.raises(RunError, match=r"shape \(1, 12\)"):
            compiled.run(ids2[:1].numpy())
        with pytest.raises(RunError, match="dtype int32"):
            compiled.run(ids2.int().numpy())
        with pytest.raises(RunError, match="takes 1 tensors, 2 given"):
            compiled.run(ids2.numpy(), ids2.numpy())
    else:
        _dialect_only(out)                                           # materialized: dot_general + softmax
        assert out.ops.get("stablehlo.dot_general", 0) >= 4, out.ops


def test_attention_normalizer_op_decomposes_with_dynamic_lengths():
    """smx::attention (a variant normalizer) becomes its reference form; dynamic L and S stay dynamic."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    opts = {"cpu": "rewrite", "attention_normalizer": "ssmax"}
    more = (torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 11, 16, generator=g),
            torch.randn(1, 2, 11, 16, generator=g))
    out = export_mlir(Attn(), (q, k, v), output_type="linalg-on-tensors", options=opts,
                      dynamic_shapes={"q": {2: "L"}, "k": {2: "S"}, "v": {2: "S"}}, check_inputs=[(more, {})])
    assert out.report.count(kind="attention", action="rewritten") == 1, str(out.report)
    _no_smx_left(out)
    assert "tensor<1x2x?x16xf32>" in out.text                       # symbolic, not 8
    assert out.checked == "run" and out.max_abs_diff < 1e-5
    kept = export_mlir(Attn(), (q, k, v), output_type="torch", options=opts, decompose=False)
    assert kept.custom_ops == {"torch.smx.attention": 1}, kept.custom_ops


@pytest.mark.parametrize("normalizer", sorted(set(smxcompile.NORMALIZERS) - {"softmax"}))
def test_every_attention_normalizer_lowers_and_runs(normalizer):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    out = export_mlir(Attn(), (q, k, v), output_type="linalg-on-tensors",
                      options={"cpu": "rewrite", "attention_normalizer": normalizer})
    assert out.report.count(kind="attention", action="rewritten") == 1, str(out.report)
    _no_smx_left(out)
    assert out.checked == "run" and out.max_abs_diff < 1e-5


def test_quantized_softmax_model(gpt2):
    model, ids = gpt2
    q = smxcompile.quantize_softmax(model, [{"input_ids": ids}], bits=8, progress=False)
    out = export_mlir(q, (), kwargs={"input_ids": ids}, output_type="linalg-on-tensors")
    assert out.report.count(kind="quant_softmax", action="rewritten") == 2, str(out.report)
    _no_smx_left(out)
    assert out.checked == "run" and out.max_abs_diff < 1e-4
    assert any("fptoui" in k or "roundeven" in k for k in out.ops), out.ops     # codes are computed in the module
    (got,) = _run(out, ids)
    torch.testing.assert_close(got, _logits(q, ids), rtol=1e-4, atol=1e-4)
    shlo = export_mlir(q, (), kwargs={"input_ids": ids}, output_type="stablehlo")
    _dialect_only(shlo)
    kept = export_mlir(q, (), kwargs={"input_ids": ids}, output_type="torch", decompose=False)
    assert kept.custom_ops == {"torch.smx.quant_softmax": 2}, kept.custom_ops


def test_swapped_ssmax_model(gpt2):
    model, ids = gpt2
    sw = smxcompile.swap(model, "ssmax", example_inputs={"input_ids": ids})
    with torch.no_grad():
        for n, p in sw.named_parameters():
            if n.startswith("smx_swap."):
                p.mul_(1.5)                                        # trained values must reach the module
    out = export_mlir(sw, (), kwargs={"input_ids": ids}, output_type="linalg-on-tensors")
    assert out.report.count(kind="attention", action="swapped") == 2, str(out.report)
    _no_smx_left(out)
    assert out.checked == "run" and out.max_abs_diff < 1e-4
    (got,) = _run(out, ids)
    torch.testing.assert_close(got, _logits(sw, ids), rtol=1e-4, atol=1e-4)
    _dialect_only(export_mlir(sw, (), kwargs={"input_ids": ids}, output_type="stablehlo"))


def test_gpt2_padding_masks_left_and_right(gpt2):
    """Fully masked rows (left padding under the causal mask, all finfo.min) average V in torch; the
    tm_tensor.attention a kept SDPA lowered to gave other values there, and the check on a right-padded
    example could not see it."""
    model, ids = gpt2
    right = torch.ones_like(ids)
    right[0, 11:] = 0
    left = torch.ones_like(ids)
    left[0, :5] = 0
    out = export_mlir(model, (), kwargs={"input_ids": ids, "attention_mask": right}, output_type="linalg-on-tensors",
                      check_inputs=[((), {"input_ids": ids, "attention_mask": left})])
    assert out.report.count(kind="attention", action="rewritten") == 2, str(out.report)
    assert out.checked == "run" and out.max_abs_diff < 1e-4
    assert "tm_tensor.attention" not in out.ops, out.ops                # masked: materialized
    left[1, :3] = 0
    (got,) = _run(out, ids, left)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=left).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)         # padded rows included


class Biased(nn.Module):
    def forward(self, q, k, v, b):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.5 + b, -1) @ v


def test_masked_attention_keeps_its_scale():
    """With a mask, tm_tensor.attention scaled by 1/sqrt(E) whatever the scale (every T5 encoder, scale 1)."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 6, 16, generator=g) for _ in range(3))
    b = torch.randn(2, 2, 6, 6, generator=g)
    b[0, 1, 2] = torch.finfo(torch.float32).min                         # a fully masked row, as transformers masks
    out = export_mlir(Biased(), (q, k, v, b), output_type="linalg-on-tensors")
    assert out.report.count(kind="attention", action="rewritten") == 1, str(out.report)
    assert out.checked == "run" and out.max_abs_diff < 1e-5
    assert "tm_tensor.attention" not in out.ops, out.ops
    (got,) = _run(out, q, k, v, b)
    torch.testing.assert_close(got, Biased()(q, k, v, b), rtol=1e-5, atol=1e-5)


class Sdpa(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, *mask, **self.kw)


def _fully_masked_bool(L, S):
    keep = torch.rand(2, 1, L, S, generator=torch.Generator().manual_seed(8)) > 0.3
    keep[1, 0, 0] = False                                                # a row with no key: 0 in torch
    return keep


@pytest.mark.parametrize("L,S,kw,mask,fused", [
    (4, 7, {"is_causal": True}, None, True),             # what stays tm_tensor.attention: no mask, default scale
    (7, 4, {"is_causal": True, "scale": 8 ** -0.5}, None, True),
    (6, 6, {"is_causal": True, "enable_gqa": True}, None, True),
    (6, 6, {"is_causal": True, "scale": 0.5}, None, False),     # tm_tensor.attention would scale by 1/sqrt(E)
    (5, 6, {"enable_gqa": True, "scale": 0.5}, None, False),
    (5, 6, {"scale": 0.5}, "bool", False),
    (5, 6, {}, "float", False),
], ids=["causal-L<S", "causal-L>S", "gqa-causal", "causal-scaled", "gqa-scaled", "bool-fully-masked", "float-inf-row"])
def test_sdpa_calls_in_linalg(L, S, kw, mask, fused):
    """Which SDPA calls stay one op in linalg-on-tensors, and that each form runs as torch computes it."""
    g = torch.Generator().manual_seed(9)
    hkv = 1 if kw.get("enable_gqa") else 2
    q, k, v = torch.randn(2, 2, L, 8, generator=g), torch.randn(2, hkv, S, 8, generator=g), torch.randn(2, hkv, S, 8,
                                                                                                      generator=g)
    extra = ()
    if mask == "bool":
        extra = (_fully_masked_bool(L, S),)
    elif mask == "float":
        m = torch.randn(2, 1, L, S, generator=g)
        m[0, 0, 3] = float("-inf")                                        # all -inf: 0 in torch
        extra = (m,)
    out = export_mlir(Sdpa(**kw), (q, k, v, *extra), output_type="linalg-on-tensors")
    assert out.checked == "run" and out.max_abs_diff < 1e-5
    assert ("tm_tensor.attention" in out.ops) == fused, out.ops
    (got,) = _run(out, q, k, v, *extra)
    torch.testing.assert_close(got, Sdpa(**kw)(q, k, v, *extra), rtol=1e-5, atol=1e-5)


def test_check_inputs_that_do_not_fit_the_module_are_refused(gpt2):
    """Refused before anything is lowered or run compiled (they used to abort the process in the JIT)."""
    model, ids = gpt2
    kw = {"input_ids": ids}
    static = [(ids[:, :8], r"input_ids has shape \(2, 8\); the module takes \(2, 12\), dim 1 static"),
              (ids[:1], r"dim 0 static"),
              (ids.int(), r"input_ids is torch.int32; the module takes torch.int64"),
              (ids + 100, r"check_inputs\[0\]: the model itself fails on it in PyTorch \(IndexError")]
    for x, msg in static:
        with pytest.raises(MlirExportError, match=msg):
            export_mlir(model, (), kwargs=kw, output_type="linalg-on-tensors", check_inputs=[((), {"input_ids": x})])
    dyn = {"input_ids": {1: "seq"}}
    for x, msg in [(torch.randint(0, 97, (2, 40)), r"fails on it in PyTorch \(IndexError"),   # > n_positions
                   (ids[:, :1], "sizes 2 and up")]:
        with pytest.raises(MlirExportError, match=msg):
            export_mlir(model, (), kwargs=kw, output_type="linalg-on-tensors", dynamic_shapes=dyn,
                        check_inputs=[((), {"input_ids": x})])
    with pytest.raises(ValueError, match=r"check_inputs\[0\] must be an \(args, kwargs\) pair"):
        export_mlir(model, (), kwargs=kw, output_type="linalg-on-tensors", check_inputs=[ids])
    x = torch.randn(4, 8)
    with pytest.raises(MlirExportError, match=r"has 2 tensors; the module takes 1 \(x\)"):
        export_mlir(Heads().eval(), (x,), output_type="linalg-on-tensors", check_inputs=[((x, x), {})])


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.linspace(0.5, 2.0, 8), persistent=False)

    def forward(self, x):
        return torch.softmax(x * self.w, -1)


def test_non_persistent_buffers_export_and_the_model_is_left_as_it_was(monkeypatch):
    m, x = WithBuffer(), torch.randn(3, 8)
    out = export_mlir(m, (x,), output_type="linalg-on-tensors")
    assert out.checked == "run" and out.max_abs_diff < 1e-6
    assert m._non_persistent_buffers_set == {"w"} and "w" not in m.state_dict()
    # without the fix, torch-mlir's importer asserts; that (any importer failure) is an MlirExportError
    monkeypatch.setattr(M, "persistent_buffers", lambda module: contextlib.nullcontext())
    with pytest.raises(MlirExportError, match="FX importer failed .*Could not find state mapping for buffer"):
        export_mlir(m, (x,), output_type="torch")


class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("pos", torch.randn(8, 4, generator=torch.Generator().manual_seed(10)))

    def forward(self, x):
        return torch.softmax(x + self.pos[: x.shape[1]], -1)


def test_failed_exports_leave_the_inputs_usable():
    """A Dim range the example does not fit is torch.export's ConstraintViolationError, wrapped; a refused
    dynamic capture used to leave Dynamo's dim marks on the user's tensors, and the next static export of
    them failed ("Guard failed on the same frame it was created")."""
    m, x = Positions(), torch.randn(2, 6, 4)
    with pytest.raises(MlirExportError, match=r"refuses dynamic_shapes for this example: .*4 not in range \[5"):
        export_mlir(Heads().eval(), (torch.randn(4, 8),), dynamic_shapes={"x": {0: torch.export.Dim("b", min=5)}})
    with pytest.raises(MlirExportError, match=r"only holds for sizes in \[2, 8\]"):
        export_mlir(m, (x,), dynamic_shapes={"x": {1: "seq"}})
    out = export_mlir(m, (x,), output_type="linalg-on-tensors")
    assert out.checked == "run" and out.max_abs_diff < 1e-6


def _transformers_model(name):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    if name == "llama":
        cfg = transformers.LlamaConfig(**common, num_key_value_heads=2, use_cache=False)
        cls = transformers.LlamaForCausalLM
    elif name == "bert":
        cfg, cls = transformers.BertConfig(**common), transformers.BertModel
    else:
        cfg = transformers.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                    use_cache=False)
        cls = transformers.T5EncoderModel
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg).eval()


@pytest.mark.parametrize("name", ["llama", "bert", "t5"])
def test_transformers_models_with_padding(name):
    """Llama (grouped-query heads, rotary inv_freq) and BERT (position_ids / token_type_ids) hold
    non-persistent buffers; T5's encoder attends with scale 1 and a position bias."""
    model = _transformers_model(name)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if name == "llama":
        mask[0, :4] = 0                                                 # left padding: fully masked rows
    else:
        mask[0, 9:] = 0
    state = set(model.state_dict())
    non_persistent = {n: set(mod._non_persistent_buffers_set) for n, mod in model.named_modules()}
    out = export_mlir(model, (), kwargs={"input_ids": ids, "attention_mask": mask}, output_type="linalg-on-tensors")
    assert out.report.count(kind="attention", action="rewritten") == 2, str(out.report)
    _no_smx_left(out)
    assert out.checked == "run" and out.max_abs_diff < 1e-4
    assert set(model.state_dict()) == state                            # the model is left as it was
    assert {n: set(mod._non_persistent_buffers_set) for n, mod in model.named_modules()} == non_persistent
    got = _run(out, ids, mask)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask)
    first = ref.logits if name == "llama" else ref.last_hidden_state
    torch.testing.assert_close(got[0], first, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- kept ops and errors


def test_decompose_false_keeps_smx_ops_in_the_torch_dialect():
    m, x = Heads().eval(), torch.randn(4, 8)
    out = export_mlir(m, (x,), output_type="torch", decompose=False)
    assert not out.decomposed and out.checked == "verified"
    assert out.custom_ops == {"torch.smx.softmax": 1, "torch.smx.log_softmax": 1}, out.custom_ops
    assert 'torch.operator "torch.smx.softmax"' in out.text
    assert "torch.aten.mm" in out.ops or "torch.aten.linear" in out.ops    # the rest is backend-contract torch
    for other in ("linalg-on-tensors", "stablehlo"):
        with pytest.raises(ValueError, match="decompose=False .* cannot lower"):
            export_mlir(m, (x,), output_type=other, decompose=False)


def test_bad_output_type_and_missing_torch_mlir(monkeypatch):
    m, x = Heads().eval(), torch.randn(4, 8)
    with pytest.raises(ValueError, match="output_type must be one of"):
        export_mlir(m, (x,), output_type="tosa-ish")
    monkeypatch.setitem(sys.modules, "torch_mlir", None)
    with pytest.raises(ImportError, match=r"pip install smxcompile\[mlir\]"):
        export_mlir(m, (x,))


def test_an_op_that_does_not_lower_is_named():
    class Erfinv(nn.Module):
        def forward(self, x):
            return torch.softmax(torch.erfinv(x.tanh()), -1)

    with pytest.raises(MlirExportError, match=r"torch\.aten\.erfinv to linalg-on-tensors"):
        export_mlir(Erfinv(), (torch.randn(3, 5),), output_type="linalg-on-tensors")


def test_an_smx_op_without_reference_form_is_named(monkeypatch):
    table = D.decomposition_table()
    del table[torch.ops.smx.log_softmax.default]
    monkeypatch.setattr(D, "decomposition_table", lambda: table)
    with pytest.raises(MlirExportError, match=r"smx::log_softmax .* no reference ATen form.*'log_softmax'"):
        export_mlir(Heads().eval(), (torch.randn(4, 8),), output_type="linalg-on-tensors")


def test_the_run_catches_a_wrong_reference_form(monkeypatch):
    real = D.decomposition_table

    def wrong():
        table = real()
        table[torch.ops.smx.softmax.default] = lambda x, dim, *a, **k: (torch.softmax(x, 0), x.new_zeros((0,)))
        return table

    monkeypatch.setattr(D, "decomposition_table", wrong)
    with pytest.raises(MlirExportError, match="output 0: the linalg-on-tensors module differs from eager"):
        export_mlir(Heads().eval(), (torch.randn(4, 8),), output_type="linalg-on-tensors")


def test_a_graph_break_is_a_clear_error():
    class Breaks(nn.Module):
        def forward(self, x):
            y = torch.softmax(x, -1)
            if y.sum().item() > 0:
                y = y * 2
            return y

    with pytest.raises(MlirExportError, match="does not trace as one graph"):
        export_mlir(Breaks(), (torch.randn(2, 3),))


def test_exported_name_is_public():
    assert smxcompile.export_mlir is export_mlir and "export_mlir" in smxcompile.__all__


# --------------------------------------------------------------------------- the reference forms themselves


def _same(a, b):
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        if x.numel() and x.dtype.is_floating_point:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_reference_forms_match_the_ops():
    smx = torch.ops.smx
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, generator=g)
    mask = torch.zeros(3, 7)
    mask[0, 2] = float("-inf")
    for a in [(x, -1), (x, 0, 0.5), (x, 1, 2.0, 3.0, mask, torch.float64, True),
              (x.half(), -1, 0.3, None, None, None, True)]:
        _same(smx.softmax(*a), D.softmax_ref(*a))
        _same(smx.log_softmax(*a), D.log_softmax_ref(*a))
    for k, dim, ren in itertools.product([0, 1, 3], [0, -1], [False, True]):
        v, i, lg = smx.softmax_topk(x, k, dim, 0.5, ren, None)
        rv, ri, rlg = D.softmax_topk_ref(x, k, dim, 0.5, ren, None)
        _same((v, lg), (rv, rlg))
        assert torch.equal(i, ri)
    for a in [(x, -1, 1.0, 1 / 255, 0, 0, 255, torch.uint8), (x, 0, 0.5, 1 / 15, -8, -8, 7, torch.int8)]:
        assert torch.equal(smx.quant_softmax(*a), D.quant_softmax_ref(*a))
    n, vocab = 6, 11
    logits, tgt = torch.randn(n, vocab, generator=g), torch.randint(0, vocab, (n,), generator=g)
    tgt[1] = -100
    cw = torch.rand(vocab, generator=g)
    for a in [(logits, tgt, None, None, -100, 1.0, None, False, 0), (logits, tgt, None, cw, -100, 0.5, 30.0, True, 0)]:
        _same(smx.ce_stats(*a), D.ce_stats_ref(*a))
    h, w, b = torch.randn(n, 5, generator=g), torch.randn(vocab, 5, generator=g), torch.randn(vocab, generator=g)
    a = (h, w, b, tgt, None, cw, -100, 0.5, 30.0, True, True, torch.float16, 0)
    _same(smx.linear_ce_stats(*a), D.linear_ce_stats_ref(*a))


@pytest.mark.parametrize("normalizer", sorted(smxcompile.NORMALIZERS))
def test_attention_reference_form_matches_the_op(normalizer):
    from smxcompile.kernels.attention import api as attn  # where attention() calls the op
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g),
               torch.randn(2, 2, 6, 3, generator=g))
    keep = torch.rand(2, 1, 5, 6, generator=g) > 0.3
    calls = []
    real = attn.attention_op

    def spy(*a):
        calls.append(a)
        return real(*a)

    attn.attention_op = spy
    try:
        masks = [(None, False), (keep, False), (torch.where(keep, 0.0, float("-inf")), False), (None, True)]
        for mask, causal in masks:
            attn.attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True, softcap=30.0,
                           normalizer=normalizer)
    finally:
        attn.attention_op = real
    assert len(calls) == 4
    for a in calls:
        _same(real(*a), D.attention_ref(*a))


def test_smx_export_cli_mlir(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from model_builders import build_tiny_lm_checkpoint

    from smx_app import cli

    run = build_tiny_lm_checkpoint(tmp_path / "run")
    out = tmp_path / "demo.mlir"
    assert cli.main(["export", str(run), "--format", "mlir", "--out", str(out), "--seq-len", "16"]) == 0
    printed = capsys.readouterr().out
    assert "attention" in printed and "run on MLIR's LLVM JIT" in printed, printed
    assert "torch.operator" not in out.read_text() and "linalg" in out.read_text()
    kept = tmp_path / "kept.mlir"
    shlo = tmp_path / "demo.stablehlo.mlir"                            # static shapes: no dynamic cumsum to lower
    assert cli.main(["export", str(run), "--format", "mlir", "--output-type", "stablehlo", "--out", str(shlo),
                     "--seq-len", "16"]) == 0
    assert "shapes static: input_ids (2, 16)" in capsys.readouterr().out
    assert "stablehlo." in shlo.read_text() and "tensor<2x16xi64>" in shlo.read_text()
    assert cli.main(["export", str(run), "--format", "mlir", "--output-type", "torch", "--keep-ops", "--out", str(kept),
                     "--seq-len", "16", "--options", '{"attention_normalizer": "softpick"}']) == 0
    assert 'torch.operator "torch.smx.attention"' in kept.read_text()
    capsys.readouterr()
    assert cli.main(["export", str(run), "--format", "mlir", "--keep-ops", "--out", str(kept)]) == 2
    assert "add --output-type torch" in capsys.readouterr().err
    assert cli.main(["export", str(run), "--format", "mlir", "--compare", "--out", str(kept)]) == 2
    assert "--compare: ONNX options" in capsys.readouterr().err
    assert cli.main(["export", str(run), "--output-type", "torch", "--out", str(kept)]) == 2
    assert "add --format mlir" in capsys.readouterr().err

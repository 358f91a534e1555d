"""Attention in ONNX, per form (export/onnx/attention.py): ``aten::scaled_dot_product_attention`` as the ONNX
``Attention`` op, com.microsoft ``MultiHeadAttention`` or MatMul / Softmax / MatMul, and ``smx::attention``
with every normalizer, checked in onnxruntime against the eager model as written (every spelling the attention
pass rewrites, NaN and inf in q / k / v included), against torch for direct ``F.scaled_dot_product_attention``
calls (the module docstring's semantics: ``_sdpa_ref``), the normalizers against an fp64
``attention_reference``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

from smxcompile import NORMALIZERS, OnnxExportError, export_onnx  # noqa: E402
from smxcompile.export.onnx import target as onnx_target  # noqa: E402
from smxcompile.kernels.attention import attention_reference  # noqa: E402

FORMS = ["Attention", "MultiHeadAttention", "decompose"]
FMIN = torch.finfo(torch.float32).min
NAN, NEG = float("nan"), float("-inf")


def _form_ops(form: str, op_types: dict) -> None:
    """The file holds the form asked for, and no other."""
    if form == "Attention":
        assert "Attention" in op_types and "Softmax" not in op_types and "MultiHeadAttention" not in op_types, op_types
    elif form == "MultiHeadAttention":
        assert "MultiHeadAttention" in op_types and "Softmax" not in op_types and "Attention" not in op_types, op_types
    else:
        assert "Softmax" in op_types and "MatMul" in op_types, op_types
        assert "Attention" not in op_types and "MultiHeadAttention" not in op_types, op_types


def _export(model, args, path, form, **kw):
    if form == "Attention":
        if not onnx_target.ort_loads("Attention", 23, n_inputs=3):
            pytest.skip("this onnxruntime has no opset-23 Attention kernel")
    return export_onnx(model, args, path, opset=kw.pop("opset", 23), attention_op=form, **kw)


def _run(path, *arrays):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), arrays)})[0])


def _math(q, k, v, mask=None, causal=False, gqa=False):
    """torch's definition of SDPA (the MATH backend); mask and is_causal together both apply."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if mask is not None and causal:
        tri = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        mask = mask & tri if mask.dtype == torch.bool else mask.masked_fill(~tri, NEG)
        causal = False
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def _sdpa_ref(q, k, v, mask=None, causal=False, gqa=False):
    """What the file computes for ``F.scaled_dot_product_attention`` (export/onnx/attention.py's module
    docstring): a bool mask and the causal triangle select keys (a masked score is never read, as
    ``masked_fill``), a float mask is added; a row with no key ``0 @ V`` (NaN for a float mask where
    ``s + (-inf)`` is NaN there); any other row softmax as written. Equal to torch's MATH backend on finite
    inputs."""
    if gqa:
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    keep = seen = torch.ones(s.shape[-2:], dtype=torch.bool)
    if mask is not None and mask.dtype == torch.bool:
        keep = seen = mask
    elif mask is not None:
        s, seen = s + mask, mask != NEG
    if causal:
        tri = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        keep, seen = keep & tri, seen & tri
    z = s.masked_fill(~keep, NEG)
    out = torch.softmax(z, -1) @ v
    if mask is None:
        return out
    fill = (v * 0).sum(-2, keepdim=True)
    if mask.dtype != torch.bool:
        fill = fill + torch.where(z.sum(-1, keepdim=True).isnan(), NAN, 0.0)
    return torch.where(~seen.any(-1, keepdim=True), fill, out)


def _same(got, ref, atol=2e-5, rtol=1e-4, what=""):
    """Equal NaN positions, values within tolerance elsewhere."""
    assert torch.equal(got.isnan(), ref.isnan()), f"{what}: NaN at {got.isnan().sum()} vs torch {ref.isnan().sum()}"
    torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


class SDPA(nn.Module):
    def __init__(self, causal=False, gqa=False):
        super().__init__()
        self.causal, self.gqa = causal, gqa

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, enable_gqa=self.gqa)


def _qkv(B=2, Hq=4, Hkv=4, L=6, S=6, E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, L, E, generator=g), torch.randn(B, Hkv, S, E, generator=g),
            torch.randn(B, Hkv, S, E, generator=g))


def _float_masks(B, L, S):
    """Float masks (B, 1, L, S): what onnxruntime and torch disagree on, each with torch's value in mind."""
    g = torch.Generator().manual_seed(1)
    part = torch.where(torch.rand(B, 1, L, S, generator=g) > 0.3, 0.0, NEG)
    part[..., 0] = 0.0
    out = {"partial -inf": part, "partial finfo.min": torch.where(part == 0, 0.0, FMIN)}
    m = torch.zeros(B, 1, L, S)
    m[0, :, 1] = FMIN                 # every key at finfo.min: torch averages the values (onnxruntime: 0)
    m[1, :, 2] = NEG                  # every key -inf: 0
    m[1, :, 3, :2], m[1, :, 3, 2:] = FMIN, NEG    # finfo.min and -inf: the average of the finfo.min keys
    m[0, :, 4] = -1e9
    out["fully masked rows"] = m
    return out


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ["float", "bool", "causal_pad", "causal_pad_float", "causal_L<S", "causal_L>S",
                                  "gqa"])
def test_sdpa_forms_match_torch(tmp_path, form, case):
    """``F.scaled_dot_product_attention`` in the model (kept): every form gives torch's numbers (masks bool / float,
    finfo.min and -inf, fully masked rows, causal top-left with and without a padding mask, grouped-query heads)
    and, with NaN / inf in q, k or v, the module docstring's semantics (``_sdpa_ref``): torch's default CPU kernel
    for float masks and is_causal; a bool mask selects (torch adds it as -inf: NaN from a masked key)."""
    B, L, S = 2, 6, 6
    feeds: dict[str, tuple] = {}
    torch_cpu: set[str] = set()       # feeds on which the file also equals torch's default CPU kernel
    if case in ("float", "bool", "gqa"):
        q, k, v = _qkv(Hkv=2 if case == "gqa" else 4)
        model = SDPA(gqa=case == "gqa")
        masks = _float_masks(B, L, S)
        if case == "bool":
            masks = {name: m == 0 for name, m in masks.items() if name != "partial finfo.min"}
        for name, m in masks.items():
            feeds[name] = (q, k, v, m)
        m = masks["fully masked rows"]
        qn, kn, vn, ki = q.clone(), k.clone(), v.clone(), k.clone()
        qn[0, :, 1, 0] = NAN           # a row of finfo.min (float: NaN) / no key (bool: 0 @ V)
        qn[1, :, 2, 1] = float("inf")  # a row with no key
        kn[1, :1, 5, 0] = NAN          # a key of one kv head, masked in some rows only
        ki[0, :, 3, 1] = float("inf")  # +inf / -inf scores by the sign of q's entry
        vn[1, :, 0, 3] = NAN           # a value: that column is NaN in every row of the batch entry
        feeds |= {"NaN q": (qn, k, v, m), "NaN k": (q, kn, v, m), "inf k": (q, ki, v, m), "NaN v": (q, k, vn, m)}
        if case != "bool":
            torch_cpu |= {"NaN q", "NaN k", "NaN v"}
    elif case.startswith("causal_pad"):
        q, k, v = _qkv()
        model = SDPA(causal=True)
        pad = torch.ones(B, 1, 1, S, dtype=torch.bool)
        pad[1, ..., :3] = False        # left padding: the first rows of entry 1 see no key at all
        m = pad if case == "causal_pad" else torch.where(pad, 0.0, FMIN)
        feeds["left padding"] = (q, k, v, m)
        m2 = m.clone()
        m2[0, ..., :1] = False if m.dtype == torch.bool else FMIN
        feeds["other padding"] = (q, k, v, m2)
        kn, ki = k.clone(), k.clone()
        kn[1, :, 1, 0] = NAN           # a padded key
        ki[0, :, 3, 2] = float("inf")  # a future key of rows 0-2
        feeds |= {"NaN k, padded key": (q, kn, v, m), "inf k, future key": (q, ki, v, m)}
    else:
        L, S = (4, 7) if case == "causal_L<S" else (7, 4)
        q, k, v = _qkv(L=L, S=S)
        model = SDPA(causal=True)
        feeds["causal"] = (q, k, v)
        feeds["large scores"] = (q * 30, k * 30, v)
        kn = k.clone()
        kn[0, :, 2, 0] = NAN           # a future key of rows 0 and 1: skipped, as torch's CPU kernel
        feeds["NaN k, future key"] = (q, kn, v)
        torch_cpu.add("NaN k, future key")
    first = next(iter(feeds.values()))
    out = _export(model, first, tmp_path / "a.onnx", form)
    _form_ops(form, out.op_types)
    assert out.max_abs_diff < 1e-4
    for name, args in feeds.items():
        got = _run(out.path, *args)
        ref = _sdpa_ref(*args[:3], args[3] if len(args) > 3 else None, causal=model.causal, gqa=model.gqa)
        if all(t.isfinite().all() for t in args[:3]):
            _same(ref, _math(*args[:3], args[3] if len(args) > 3 else None, causal=model.causal, gqa=model.gqa))
        if name in torch_cpu:
            _same(ref, model(*args), what=f"{case} {name}: the reference vs torch's default CPU kernel")
        _same(got, ref, what=f"{form} {case} {name}")


@pytest.mark.parametrize("form", FORMS)
def test_dynamic_batch_and_sequence(tmp_path, form):
    """Batch and sequence stay symbolic; a second shape (check_inputs) runs the same file."""
    q, k, v = _qkv(B=2, L=6, S=6)
    m = torch.zeros(2, 1, 6, 6)
    m[1, ..., :2] = FMIN
    q2, k2, v2 = _qkv(B=3, L=9, S=9, seed=3)
    m2 = torch.zeros(3, 1, 9, 9)
    m2[0, ..., :4] = FMIN
    m2[2, :, 3] = NEG
    dims = {0: "batch", 2: "seq"}
    shapes = {"q": dims, "k": dims, "v": dims, "mask": {0: "batch", 2: "seq", 3: "seq"}}
    out = _export(SDPA(causal=True), (q, k, v, m), tmp_path / "d.onnx", form, dynamic_shapes=shapes,
                  check_inputs=[((q2, k2, v2, m2), {})])
    _form_ops(form, out.op_types)
    sess = ort.InferenceSession(str(out.path), providers=["CPUExecutionProvider"])
    assert all(isinstance(i.shape[0], str) and isinstance(i.shape[2], str) for i in sess.get_inputs())
    _same(_run(out.path, q2, k2, v2, m2), _math(q2, k2, v2, m2, causal=True), what=form)


def test_gqa_in_five_dims_exports_repeated(tmp_path):
    """K and V repeated per query head in a 5-D layout: ONNX's Attention is 4-D, so they stay repeated."""
    rep = lambda x: x[:, :, :, None].expand(-1, -1, -1, 2, -1, -1).flatten(2, 3)  # noqa: E731

    class Five(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ rep(k).transpose(-2, -1) * 0.25, -1) @ rep(v)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 6, 8, generator=g), torch.randn(2, 3, 2, 6, 8, generator=g), \
        torch.randn(2, 3, 2, 6, 8, generator=g)
    out = export_onnx(Five().eval(), (q, k, v), tmp_path / "five.onnx")
    np.testing.assert_allclose(_run(out.path, q, k, v), Five()(q, k, v).numpy(), atol=1e-5, rtol=1e-5)


def test_decompose_is_standard_ops_at_opset_18(tmp_path):
    """The portable target: MatMul / Softmax / MatMul at opset 18, no com.microsoft, fully masked rows exact."""
    q, k, v = _qkv(Hkv=2)
    m = _float_masks(2, 6, 6)["fully masked rows"]
    out = export_onnx(SDPA(gqa=True), (q, k, v, m), tmp_path / "p.onnx", target="portable")
    assert out.opset == 18 and out.target.attention == "decompose"
    import onnx

    assert {o.domain for o in onnx.load(str(out.path)).opset_import} <= {"", "ai.onnx"}
    _form_ops("decompose", out.op_types)
    assert out.exported["aten::scaled_dot_product_attention"]["onnx"].get("MatMul") == 2


# --------------------------------------------------------------------------- eager spellings: NaN and inf


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def _repeat_kv(x, n):
    B, H, S, E = x.shape
    return x[:, :, None].expand(B, H, n, S, E).reshape(B, H * n, S, E)


#: The spellings the attention pass rewrites (one site each), and what each becomes: bool mask, float mask or
#: is_causal. The last two are what the SDPA node cannot carry (export/onnx/attention.py's module docstring): their
#: reference is not the site itself but the spelling whose semantics the file has.
SPELLINGS = {
    "masked_fill -inf, padding": lambda s, pad, keep, tri: s.masked_fill(~pad, NEG),
    "masked_fill finfo.min, causal+padding": lambda s, pad, keep, tri: s.masked_fill(~keep, FMIN),
    "where finfo.min, causal+padding": lambda s, pad, keep, tri: torch.where(keep, s, FMIN),
    "additive -inf, padding": lambda s, pad, keep, tri: s + torch.where(pad, 0.0, NEG),
    "additive finfo.min, causal+padding": lambda s, pad, keep, tri: s + torch.where(keep, 0.0, FMIN),
    "additive -1e9, padding": lambda s, pad, keep, tri: s + torch.where(pad, 0.0, -1e9),
    "causal masked_fill -inf": lambda s, pad, keep, tri: s.masked_fill(~tri, NEG),
    "causal where finfo.min + padding masked_fill": lambda s, pad, keep, tri: torch.where(tri, s, FMIN).masked_fill(
        ~pad, FMIN),
    "GQA masked_fill -inf, causal+padding": None,
    "causal additive -inf (constant: is_causal)": lambda s, pad, keep, tri: s + torch.where(tri, 0.0, NEG),
    "additive then masked_fill": lambda s, pad, keep, tri: (s + torch.where(keep, 0.0, FMIN)).masked_fill(~pad, NEG),
}
#: the file's semantics for the two the node cannot carry: is_causal selects; one float mask, added
AS_FILE = {
    "causal additive -inf (constant: is_causal)": lambda s, pad, keep, tri: s.masked_fill(~tri, NEG),
    "additive then masked_fill": lambda s, pad, keep, tri: s + torch.where(keep, 0.0, FMIN) + torch.where(pad, 0.0,
                                                                                                          NEG),
}


class Spellings(nn.Module):
    def __init__(self, table=SPELLINGS):
        super().__init__()
        self.table = table

    def forward(self, q, k, v, pad, keep):
        L, S = q.shape[-2], k.shape[-2]
        tri = torch.arange(L)[:, None] >= torch.arange(S)[None, :]     # constant: the pass makes it is_causal
        outs = []
        for name, spell in self.table.items():
            if spell is None:    # grouped-query heads: transformers' repeat_kv, taken un-repeated by the pass
                kv, vv = _repeat_kv(k[:, :1], q.shape[1]), _repeat_kv(v[:, :1], q.shape[1])
                outs.append(torch.softmax(_scores(q, kv).masked_fill(~keep, NEG), -1) @ vv)
            else:
                outs.append(torch.softmax(spell(_scores(q, k), pad, keep, tri), -1) @ v)
        return tuple(outs)


def _perturbed(q, k, v):
    """NaN / inf at masked keys (padded; masked in some rows only), unmasked keys, queries, values."""
    inf = float("inf")
    cases = {}

    def case(name, where, value):
        t = {"q": q, "k": k, "v": v}
        t[where[0]] = t[where[0]].clone()
        t[where[0]][where[1:]] = value
        cases[name] = (t["q"], t["k"], t["v"])

    case("NaN k, padded key", ("k", 0, slice(None), 5, 0), NAN)
    case("inf k, padded key", ("k", 0, slice(None), 4, 1), inf)
    case("-inf k, left-padded key", ("k", 1, slice(None), 0, 2), NEG)
    case("NaN k, key of one head", ("k", 1, 1, 3, 0), NAN)
    case("inf k, future key", ("k", 0, slice(None), 2, 3), inf)
    case("NaN q", ("q", 0, 1, 2, 0), NAN)
    case("inf q", ("q", 1, 0, 4, 1), inf)
    case("inf q, row with no key", ("q", 1, slice(None), 0, 0), inf)
    case("NaN v, padded key", ("v", 0, slice(None), 5, 2), NAN)
    return cases


@pytest.mark.parametrize("form", FORMS)
def test_eager_spellings_nan_inf_per_form(tmp_path, form):
    """Every spelling the attention pass rewrites, in one model, against the eager model as written with NaN /
    inf at masked keys (padding: every row; causal: some rows), unmasked keys, queries (rows with and without a
    key) and values: equal NaN positions, equal numbers. The fused forms keep the op (an ``If`` takes the
    decomposition when q or k is not finite); the two spellings whose semantics the SDPA node cannot carry equal
    what the module docstring says the file computes."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    pad = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    pad[0, ..., 4:] = False                                 # right padding
    pad[1, ..., :2] = False                                 # left padding: rows 0, 1 with causal see no key
    keep = pad & torch.ones(6, 6, dtype=torch.bool).tril()
    model = Spellings()
    out = _export(model, (q, k, v, pad, keep), tmp_path / "s.onnx", form)
    assert out.report.count(kind="attention", action="rewritten") == len(SPELLINGS), str(out.report)
    _form_ops(form, out.op_types)
    assert ("If" in out.op_types) == (form != "decompose"), out.op_types
    sess = ort.InferenceSession(str(out.path), providers=["CPUExecutionProvider"])
    as_file = Spellings({n: AS_FILE.get(n, f) for n, f in SPELLINGS.items()})
    for case, (qq, kk, vv) in _perturbed(q, k, v).items():
        feeds = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), (qq, kk, vv, pad, keep))}
        got = [torch.from_numpy(x) for x in sess.run(None, feeds)]
        eager, file = model(qq, kk, vv, pad, keep), as_file(qq, kk, vv, pad, keep)
        for name, g_, e, f in zip(SPELLINGS, got, eager, file):
            _same(g_, f if name in AS_FILE else e, what=f"{form}, {name}, {case}")
    # the two the node cannot carry do differ from eager there (a NaN / +inf score at a masked key)
    qq, kk, vv = _perturbed(q, k, v)["NaN k, padded key"]
    eager = dict(zip(SPELLINGS, model(qq, kk, vv, pad, keep)))
    assert eager["causal additive -inf (constant: is_causal)"][0].isnan().all()     # the file: rows 0-4 finite
    assert not eager["additive then masked_fill"].isnan().any()                     # the file: batch entry 0 NaN


def test_fp16_overflow_at_padding(tmp_path):
    """fp16 with inf at padded keys and queries (an overflow there), the default form: as eager in fp16."""
    class Padded(nn.Module):
        def forward(self, q, k, v, pad):
            a = torch.softmax(_scores(q, k).masked_fill(~pad, NEG), -1) @ v
            b = torch.softmax(_scores(q, k) + torch.where(pad, 0.0, torch.finfo(q.dtype).min).to(q.dtype), -1) @ v
            return a, b

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g).half() for _ in range(3))
    pad = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    pad[0, ..., 4:] = False
    out = export_onnx(Padded(), (q, k, v, pad), tmp_path / "h.onnx", atol=2e-3, rtol=2e-3)
    assert out.report.count(kind="attention", action="rewritten") == 2, str(out.report)
    form = onnx_target.resolve().attention
    _form_ops(form, out.op_types)
    assert ("If" in out.op_types) == (form != "decompose"), out.op_types
    sess = ort.InferenceSession(str(out.path), providers=["CPUExecutionProvider"])
    kk, qq = k.clone(), q.clone()
    kk[0, :, 4:, 0] = float("inf")
    qq[0, :, 5, 1] = float("-inf")
    got = sess.run(None, {i.name: t.numpy() for i, t in zip(sess.get_inputs(), (qq, kk, v, pad))})
    for g_, e, name in zip(got, Padded()(qq, kk, v, pad), ("masked_fill", "additive")):
        _same(torch.from_numpy(g_).float(), e.float(), atol=2e-3, rtol=2e-3, what=f"fp16 {name}")


# --------------------------------------------------------------------------- smx::attention: normalizers


class Eager(nn.Module):
    """Attention as transformers' eager code writes it: an additive finfo.min mask."""

    def __init__(self, softcap=None):
        super().__init__()
        self.softcap = softcap

    def forward(self, q, k, v, mask):
        s = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        return torch.softmax(s + mask, dim=-1) @ v


def _opts(name, param=None):
    return {"cpu": "rewrite", "attention_normalizer": name, "attention_norm_param": param}


def _gold(q, k, v, keep, name, param=None, scale=None):
    """fp64 ``attention_reference`` with a bool mask (True attends), GQA heads repeated there."""
    return attention_reference(q.double(), k.double(), v.double(), attn_mask=keep, scale=scale, normalizer=name,
                               norm_param=param, dtype=torch.float64).float()


class TwoSites(nn.Module):
    """Two attention sites: ``F.scaled_dot_product_attention`` with a bool padding mask, ``is_causal`` and
    grouped-query heads, and the eager spelling (``softmax(s + mask)``, finfo.min masking, as transformers writes
    it; the op sees a float mask with -inf)."""

    def forward(self, q, k, v, pad, q2, k2, v2, mask):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=pad, is_causal=True, enable_gqa=True)
        return a, Eager()(q2, k2, v2, mask)


@pytest.mark.parametrize("name", list(NORMALIZERS))
def test_every_normalizer(tmp_path, name):
    """Each normalizer through ``options={"attention_normalizer": name}`` (and ``attention_norm_param``) against an
    fp64 ``attention_reference`` and the op itself: masked keys exactly 0 and not counted in n (the op's ``n_keys``
    input), rows with no key, causal, grouped-query heads, the per-head parameter, dynamic batch and sequence."""
    from smxcompile import attention

    param = {"sigmoid": -1.5, "relu": 0.3, "softpick": 1e-3, "ssmax": 1.3, "softplus": 2.0}.get(name)
    g = torch.Generator().manual_seed(5)

    def inputs(B, L, left):
        q, k, v = (torch.randn(2, h, 7, 8, generator=g) * 1.5 for h in (4, 2, 2))
        pad = torch.ones(2, 1, 1, 7, dtype=torch.bool)
        for b, n in enumerate(left):
            pad[b, ..., :n] = False                      # left padding: with causal, rows that see no key
        q2, k2, v2 = (torch.randn(B, 3, L, 8, generator=g) * 1.5 for _ in range(3))
        keep = torch.rand(B, 1, L, L, generator=g) > 0.35
        keep[0, :, 2] = False                            # a row with no key
        return (q, k, v, pad, q2, k2, v2, torch.where(keep, 0.0, FMIN)), keep

    args, keep = inputs(2, 7, [0, 3])
    more, keep_more = inputs(3, 9, [2, 7])
    # the eager site dynamic (the pass cannot line up an SDPA call's dynamic K and V lengths)
    dims = {0: "b", 2: "t"}
    shapes = {n: dims for n in ("q2", "k2", "v2")} | {"mask": {0: "b", 2: "t", 3: "t"}}
    out = export_onnx(TwoSites(), args, tmp_path / f"{name}.onnx", options=_opts(name, param), check=False,
                      dynamic_shapes=shapes)
    if name == "softmax":       # nothing to change: torch's SDPA kept, the eager site to SDPA, both exact
        assert out.report.count(kind="attention") == 2, str(out.report)
        assert "smx::attention" not in out.exported
    else:
        assert out.report.count(kind="attention", action="rewritten") == 2, str(out.report)
        assert out.exported["smx::attention"]["calls"] == 2 and "Attention" not in out.op_types
    sess = ort.InferenceSession(str(out.path), providers=["CPUExecutionProvider"])
    for a, kp in ((args, keep), (more, keep_more)):
        got = [torch.from_numpy(x) for x in sess.run(None, {i.name: t.numpy() for i, t in zip(sess.get_inputs(), a)})]
        q, k, v, pad, q2, k2, v2, mask = a
        L = q.shape[2]
        vis = pad & torch.ones(L, L, dtype=torch.bool).tril()
        if name == "softmax":   # the model's own math: the eager site averages V on a row with no key, as eager
            _same(got[0], _math(q, k, v, pad, causal=True, gqa=True), what=name)
            _same(got[1], Eager()(q2, k2, v2, mask), what=name)
            continue
        _same(got[0], _gold(q, k, v, vis, name, param), atol=2e-5, rtol=2e-4, what=f"{name} causal+pad+gqa")
        _same(got[1], _gold(q2, k2, v2, kp, name, param), atol=2e-5, rtol=2e-4, what=f"{name} eager mask")
        _same(got[1], attention(q2, k2, v2, attn_mask=kp, normalizer=name, norm_param=param), atol=2e-5, rtol=2e-4,
              what=f"{name} vs the op")
        assert (got[0][1, :, :(~pad[1]).sum()] == 0).all() and (got[1][0, :, 2] == 0).all()  # no key: exactly 0


def test_softpick_and_softplus_keep_their_small_values(tmp_path):
    """expm1 / log1p without cancellation: scores near 0 (softpick) and very negative (softplus) exact."""
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(1, 2, 5, 8, generator=g) * 1e-3, torch.randn(1, 2, 5, 8, generator=g), \
        torch.randn(1, 2, 5, 8, generator=g)
    mask = torch.zeros(1, 1, 5, 5)
    keep = mask == 0
    for name, scale in (("softpick", 1.0), ("softplus", -40.0)):
        class Scaled(nn.Module):
            def forward(self, q, k, v, mask):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

        qq = q if name == "softpick" else q * 1e3
        out = export_onnx(Scaled(), (qq, k, v, mask), tmp_path / f"{name}.onnx", options=_opts(name), check=False)
        got = _run(out.path, qq, k, v, mask)
        _same(got, _gold(qq, k, v, keep, name, scale=scale), atol=1e-6, rtol=1e-4, what=name)


def test_where_a_fused_form_cannot_take_the_call_it_decomposes(tmp_path):
    """A 3-D query, a negative scale (onnxruntime's kernels refuse it) and fp64 (no fused kernel) decompose, with
    torch's numbers; fp64 variant normalizers are exact to fp64 rounding."""
    class Scaled(nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=-0.3)

    q, k, v = _qkv()
    m = _float_masks(2, 6, 6)["fully masked rows"]
    out = _export(SDPA(), (q[0], k[0], v[0], m[0]), tmp_path / "r3.onnx", "Attention")
    assert "Softmax" in out.op_types and "Attention" not in out.op_types and out.max_abs_diff < 1e-5
    out = _export(Scaled(), (q, k, v, m), tmp_path / "neg.onnx", "Attention")
    assert "Softmax" in out.op_types and "Attention" not in out.op_types and out.max_abs_diff < 1e-5
    q, k, v, m = q.double(), k.double(), v.double(), m.double()
    out = _export(SDPA(), (q, k, v, m), tmp_path / "f64.onnx", "Attention", atol=1e-12, rtol=1e-12)
    assert "Attention" not in out.op_types and out.max_abs_diff < 1e-12
    keep = m > -1e30
    for name in ("softpick", "entmax15"):
        out = export_onnx(SDPA(), (q, k, v, keep), tmp_path / f"{name}64.onnx", options=_opts(name), check=False)
        got = _run(out.path, q, k, v, keep)
        assert got.dtype == torch.float64
        _same(got, attention_reference(q, k, v, attn_mask=keep, normalizer=name), atol=1e-12, rtol=1e-12, what=name)


@pytest.mark.parametrize("form", FORMS)
def test_softcap_per_form(tmp_path, form):
    """Gemma-style soft-capping (softmax normalizer): the Attention op's softcap attribute, else decomposed."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) * 4 for _ in range(3))
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    keep[1, ..., :3] = False                              # left padding: rows with no key
    mask = torch.where(keep, 0.0, FMIN)
    out = _export(Eager(softcap=5.0), (q, k, v, mask), tmp_path / "c.onnx", form)
    assert out.report.count(kind="attention", action="rewritten") == 1, str(out.report)
    if form == "Attention":
        import onnx

        node = next(n for n in onnx.load(str(out.path)).graph.node if n.op_type == "Attention")
        assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}["softcap"] == 5.0
        assert "Tanh" not in out.op_types
    else:
        assert "Tanh" in out.op_types and "Attention" not in out.op_types
    assert out.max_abs_diff < 1e-4
    qn, kn, ki = q.clone(), k.clone(), k.clone()
    qn[0, 1, 2, 0] = NAN
    kn[1, :, 0, 1] = NAN                                  # a padded key (an additive mask: NaN in eager)
    ki[0, :, 3, 2] = float("inf")                         # capped to +-5
    for name, args in {"NaN q": (qn, k, v, mask), "NaN k": (q, kn, v, mask), "inf k": (q, ki, v, mask)}.items():
        _same(_run(out.path, *args), Eager(softcap=5.0)(*args), atol=1e-4, what=f"{form} softcap {name}")


def test_dropout_is_refused(tmp_path):
    class Drop(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    q, k, v = _qkv()
    with pytest.raises(OnnxExportError, match="dropout_p=0.5.* has no exact ONNX form"):
        export_onnx(Drop(), (q, k, v), tmp_path / "d.onnx", options=_opts("sigmoid"), check=False)
    with pytest.raises(Exception, match="dropout_p=0.5.* has no exact ONNX form"):
        export_onnx(Drop(), (q, k, v), tmp_path / "d.onnx", check=False)


# --------------------------------------------------------------------------- onnxruntime's own behaviour


def test_onnxruntime_behaviour_the_fixups_are_for():
    """Pins what onnxruntime does that torch does not (the reason for each fix-up in export/onnx/attention.py), and what
    the fused forms rely on; if one of these starts failing, onnxruntime changed and the fix-up may no longer be
    needed (or be wrong)."""
    from onnx import TensorProto as TP
    from onnx import helper

    def run(node, feeds, opset):
        ins = [helper.make_tensor_value_info(n, TP.BOOL if a.dtype == torch.bool else TP.FLOAT, a.shape)
               for n, a in feeds.items()]
        g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", TP.FLOAT, None)])
        imports = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
        m = helper.make_model(g, opset_imports=imports)
        m.ir_version = 11 if opset >= 23 else 10
        s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return s.run(None, {n: a.numpy() for n, a in feeds.items()})[0]

    q, k, v = _qkv(B=1, Hq=1, Hkv=1, L=3, S=4)
    mask = torch.zeros(1, 1, 3, 4)
    mask[0, 0, 1] = FMIN
    keep = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    keep[..., 3] = False                                     # key 3 masked in every row
    kn, vn = k.clone(), v.clone()
    kn[..., 3, 0] = NAN                                      # ... and its score NaN
    vn[..., 2, 1] = NAN
    attention = onnx_target.ort_loads("Attention", 23, n_inputs=3)
    if attention:
        A = helper.make_node("Attention", ["q", "k", "v", "m"], ["y"])
        y = run(A, {"q": q, "k": k, "v": v, "m": mask}, 23)
        assert (y[0, 0, 1] == 0).all(), "Attention: a row of finfo.min is no longer 0 (torch: the mean of V)"
        assert np.allclose(y[0, 0, 0], _math(q, k, v, mask)[0, 0, 0].numpy(), atol=1e-6)
        # relied on (no fix-up): a row with no key (bool all False, all -inf) is 0 @ V: 0, NaN where V is
        no_key = keep.clone()
        no_key[..., 1, :] = False
        for m in (no_key, torch.where(no_key, 0.0, NEG)):
            y = run(A, {"q": q, "k": k, "v": vn, "m": m}, 23)
            assert np.isnan(y[0, 0, 1, 1]) and (np.delete(y[0, 0, 1], 1) == 0).all(), "Attention: a row with no key"
        # the reason for the If: the mask is added to the score (bool as finfo.min), so a NaN score at a masked
        # key is a NaN row, where masked_fill (and a bool mask's selection) never reads it
        y = run(A, {"q": q, "k": kn, "v": v, "m": keep}, 23)
        assert np.isnan(y).all(), "Attention: a NaN score at a masked key no longer makes the row NaN"
        y = run(helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1), {"q": q, "k": kn, "v": v}, 23)
        assert np.isnan(y).all(), "Attention is_causal: a NaN score at a future key no longer makes the row NaN"
    mha = dict(num_heads=1)
    q3, k3, v3, kn3 = (t.transpose(1, 2).reshape(1, t.shape[2], -1) for t in (q, k, v, kn))
    MHA = helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "b"], ["y"], domain="com.microsoft", **mha)
    bias = torch.zeros(1, 1, 3, 4)
    bias[0, 0, 1] = NEG
    y = run(MHA, {"q": q3, "k": k3, "v": v3, "b": bias}, 18)
    assert np.isnan(y[0, 1]).all(), "MultiHeadAttention: a row of -inf is no longer NaN (torch: 0)"
    y = run(MHA, {"q": q3, "k": kn3, "v": v3, "b": torch.where(keep, 0.0, NEG)}, 18)
    assert np.isnan(y).all(), "MultiHeadAttention: a NaN score at a masked key no longer makes the row NaN"
    y = run(helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"], domain="com.microsoft", unidirectional=1,
                             **mha), {"q": q3, "k": k3, "v": v3}, 18)
    top_left = _math(q, k, v, causal=True)[0, 0].numpy()
    assert not np.allclose(y[0], top_left, atol=1e-5), "MultiHeadAttention unidirectional is now top-left for L < S"


# --------------------------------------------------------------------------- real models


def _tf():
    return pytest.importorskip("transformers")


def _tiny_gpt2():
    from model_builders import tiny_gpt2

    return tiny_gpt2()[0]


def test_default_target_is_the_attention_op_at_opset_23():
    tgt = onnx_target.resolve()
    if onnx_target.ort_loads("Attention", 23, n_inputs=3):
        assert (tgt.opset, tgt.attention) == (23, "Attention")
    else:
        assert tgt.attention == "decompose"
    assert onnx_target.resolve(opset=18).attention == "decompose"
    assert onnx_target.resolve("portable").attention == "decompose"


@pytest.mark.parametrize("form", FORMS)
def test_gpt2_left_padding_per_form(tmp_path, form):
    """GPT-2 with left padding (rows with no key to see, masked with finfo.min: what onnxruntime's Attention got
    wrong); the default form with dynamic batch and sequence and a second shape."""
    model = _tiny_gpt2()
    g = torch.Generator().manual_seed(0)
    ids, mask = torch.randint(0, 97, (2, 16), generator=g), torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0
    kw = {}
    if form == onnx_target.resolve().attention:
        ids2, mask2 = torch.randint(0, 97, (3, 9), generator=g), torch.ones(3, 9, dtype=torch.long)
        mask2[0, :2] = 0
        dims = {0: "batch", 1: "seq"}
        kw = dict(dynamic_shapes={"input_ids": dims, "attention_mask": dims},
                  check_inputs=[((), {"input_ids": ids2, "attention_mask": mask2})])
    out = _export(model, (), tmp_path / "gpt2.onnx", form, kwargs={"input_ids": ids, "attention_mask": mask}, **kw)
    assert out.report.count(kind="attention", action="rewritten") == 2, str(out.report)
    _form_ops(form, out.op_types)
    assert out.max_abs_diff < 1e-4


def test_llama_gqa_bert_padding_vit(tmp_path):
    """Llama (grouped-query heads, causal), BERT (a padding mask), ViT (no mask) with the default form."""
    tf = _tf()
    tgt = onnx_target.resolve()
    torch.manual_seed(0)
    lcfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    lcfg._attn_implementation = "eager"
    llama = tf.LlamaForCausalLM(lcfg).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 12, dtype=torch.long)
    am[0, :4] = 0
    out = export_onnx(llama, (), tmp_path / "llama.onnx", kwargs={"input_ids": ids, "attention_mask": am})
    assert out.report.count(kind="attention", action="rewritten") == 2, str(out.report)
    _form_ops(tgt.attention, out.op_types)
    assert out.max_abs_diff < 1e-4

    bcfg = tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)
    bcfg._attn_implementation = "eager"
    bert = tf.BertModel(bcfg, add_pooling_layer=False).eval()
    bm = torch.ones(2, 10, dtype=torch.long)
    bm[1, 6:] = 0
    out = export_onnx(bert, (), tmp_path / "bert.onnx", kwargs={"input_ids": ids[:, :10], "attention_mask": bm})
    assert out.report.count(kind="attention", action="rewritten") == 2, str(out.report)
    _form_ops(tgt.attention, out.op_types)
    assert out.max_abs_diff < 1e-4

    vcfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64)
    vcfg._attn_implementation = "eager"
    vit = tf.ViTModel(vcfg, add_pooling_layer=False).eval()
    px = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    out = export_onnx(vit, (), tmp_path / "vit.onnx", kwargs={"pixel_values": px})
    assert out.report.count(kind="attention", action="rewritten") == 2, str(out.report)
    _form_ops(tgt.attention, out.op_types)
    assert out.max_abs_diff < 1e-4

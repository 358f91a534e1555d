"""ONNX export of smxcompile's cross-entropy ops (``smx::ce_stats``, ``smx::linear_ce_stats``; export/onnx/cross_entropy.py).

Method of the ops: cut cross-entropy, Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language
Models": per row only ``lse_i = log sum_j exp(z_ij)`` and the target logit ``z_{i,y_i}`` are needed; every
CE option is ATen arithmetic on those N-vectors. In ONNX the row lse is ``m - log(max softmax)`` (``ReduceMax``,
``Softmax``, ``Log``) and the target logit ``GatherElements``: no ``LogSoftmax`` (no N x V log-probability
tensor), no ``SoftmaxCrossEntropyLoss``. Each test compares onnxruntime (CPU) with eager torch and, where
rounding matters, with an fp64 gold; shapes are tiny (N <= 48 rows, V <= 512 classes, fp32 unless said).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

import smxcompile  # noqa: E402
from smxcompile import OnnxExportError, export_onnx  # noqa: E402
from smxcompile.export.onnx import cross_entropy as onnx_ce  # noqa: E402

#: ONNX ops that would mean the log-probabilities (or torch's own loss translation) are in the file.
LOGPROB_OPS = ("LogSoftmax", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")

V = 11


def _ort(path, *inputs) -> list[np.ndarray]:
    """Run ``path`` in onnxruntime (CPU) on ``inputs`` (tensors, in the file's input order)."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: t.numpy() for i, t in zip(sess.get_inputs(), inputs)})


def _flat(out) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _close(got: list[np.ndarray], ref, rtol: float, atol: float) -> None:
    """onnxruntime outputs against reference tensors; NaN matches NaN."""
    ref = _flat(ref)
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(torch.from_numpy(np.asarray(g)).to(r.dtype), r.detach(), rtol=rtol, atol=atol,
                                   equal_nan=True, msg=lambda m, i=i: f"output {i}: {m}")


def _cut(out, kind: str, n: int) -> None:
    """``n`` sites of ``kind`` rewritten, and the file holds the lse / target-logit form, not log-probabilities."""
    assert out.report.count(kind=kind, action="rewritten") == n, str(out.report)
    assert not any(op in out.op_types for op in LOGPROB_OPS), out.op_types
    for op in ("ReduceMax", "Softmax", "Log", "GatherElements"):
        assert op in out.op_types, (op, out.op_types)
    assert "ScatterElements" not in out.op_types     # the backward-only other-class mass: dropped as dead code


def _targets(n: int, v: int, ignore: int, every: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, v, (n,), generator=g)
    y[::every] = ignore
    return y


# --------------------------------------------------------------------------- plain cross-entropy (ce_stats)


class PlainLosses(nn.Module):
    """Every ``F.cross_entropy`` option on given logits ``x`` (N, V) fp32: ``y`` (N,) int64 with -100 entries,
    ``y3`` (N,) with 3 (a real class) as the ignored value, ``q`` (N, V) fp32 probabilities; a class weight (V,)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.linspace(0.5, 2.0, V))
        self.ce = nn.CrossEntropyLoss(weight=torch.linspace(2.0, 0.25, V), ignore_index=3, label_smoothing=0.05,
                                      reduction="sum")

    def forward(self, x, y, y3, q):
        n = x.shape[0]
        return (
            F.cross_entropy(x, y),                                            # mean over non-ignored
            F.cross_entropy(x, y, reduction="none"),
            F.cross_entropy(x, y, reduction="sum"),
            F.cross_entropy(x, y3, weight=self.w, ignore_index=3),            # mean / sum of w[y] of valid rows
            F.cross_entropy(x, y, weight=self.w, label_smoothing=0.1),
            F.cross_entropy(x, y, label_smoothing=0.2, reduction="none"),
            self.ce(x, y3),                                                   # nn.CrossEntropyLoss
            F.nll_loss(F.log_softmax(x, dim=-1), y),                          # the two-call spelling
            F.cross_entropy(x, q),                                            # probability targets
            F.cross_entropy(x, q, weight=self.w, label_smoothing=0.1, reduction="none"),
            F.cross_entropy(x.view(2, n // 2, V).transpose(1, 2), y.view(2, n // 2)),   # classes moved to dim 1
        )


def _plain_inputs(n: int = 8, scale: float = 4.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g) * scale
    q = torch.softmax(torch.randn(n, V, generator=g), -1)
    return x, _targets(n, V, -100, seed=seed), _targets(n, V, 3, every=2, seed=seed + 1), q


def test_every_cross_entropy_option_exports_without_log_probabilities(tmp_path):
    """11 plain CE sites of every option -> ``smx::ce_stats``; onnxruntime == eager and == an fp64 gold; every
    target ignored gives torch's NaN mean (0/0), a zero sum and zero rows."""
    m, args = PlainLosses().eval(), _plain_inputs()
    out = export_onnx(m, args, tmp_path / "plain.onnx")
    _cut(out, "cross_entropy", 11)
    assert "ReduceLogSumExp" not in out.op_types
    assert out.max_abs_diff < 1e-5
    # fp64 gold on logits of a wider range (|x| up to ~30): the file's fp32 numbers are torch's fp32 numbers
    big = _plain_inputs(scale=10.0, seed=1)
    with torch.no_grad():
        gold = m.double()(*[t.double() if t.is_floating_point() else t for t in big])
    _close(_ort(out.path, *big), [g.float() for g in gold], rtol=1e-5, atol=1e-5)
    m.float()
    x, y, y3, q = args
    ignored = (x, torch.full_like(y, -100), torch.full_like(y3, 3), q)
    got = _ort(out.path, *ignored)
    with torch.no_grad():
        ref = m(*ignored)
    assert np.isnan(got[0]) and torch.isnan(ref[0]) and got[2] == 0 and not got[1].any()
    _close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_single_op_lse_form(tmp_path, monkeypatch):
    """``LSE_FORM = "reduce"``: the row lse as one ``ReduceLogSumExp`` (no N x V temporary; slower and less
    accurate in onnxruntime 1.32)."""
    monkeypatch.setattr(onnx_ce, "LSE_FORM", "reduce")

    class One(nn.Module):
        def forward(self, x, y):
            return F.cross_entropy(x, y, label_smoothing=0.1, reduction="none")

    x, y, _, _ = _plain_inputs()
    out = export_onnx(One(), (x, y), tmp_path / "one.onnx")
    assert out.op_types.get("ReduceLogSumExp") == 1 and "ReduceMax" not in out.op_types
    assert out.max_abs_diff < 1e-5


# --------------------------------------------------------------------------- linear -> cross-entropy (cut CE)


class LinearHeads(nn.Module):
    """Linear -> CE spellings on hidden states ``h`` (N, 8) fp32, V = 11 classes: ``nn.Linear`` with bias,
    ``h @ W.T``, GPT-2's ``addmm`` with a (D, V) classifier, temperature, soft-cap, ``F.linear_cross_entropy``,
    probability targets ``q`` (N, V); ``y`` (N,) with -100 entries, ``y3`` (N,) with 3 ignored."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.lin = nn.Linear(d, V)
        self.W = nn.Parameter(torch.randn(V, d) / d ** 0.5)
        self.M = nn.Parameter(torch.randn(d, V) / d ** 0.5)
        self.b = nn.Parameter(torch.randn(V) * 0.1)
        self.register_buffer("w", torch.linspace(0.5, 2.0, V))

    def forward(self, h, y, y3, q):
        return (
            F.cross_entropy(self.lin(h), y3, weight=self.w, ignore_index=3, label_smoothing=0.1),
            F.cross_entropy(h @ self.W.T, y, reduction="sum"),
            F.cross_entropy(torch.addmm(self.b, h, self.M), y, reduction="none"),        # Conv1D
            F.cross_entropy(F.linear(h, self.W, self.b) / 0.7, y),                        # temperature
            F.cross_entropy(30.0 * torch.tanh(F.linear(h, self.W) / 30.0), y, label_smoothing=0.2),  # soft-cap
            F.linear_cross_entropy(h, self.W, y, linear_bias=self.b, reduction="sum"),
            F.cross_entropy(self.lin(h), q, weight=self.w),                               # probability targets
        )


def _head_inputs(n: int = 8, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g) * 2
    q = torch.softmax(torch.randn(n, V, generator=g), -1)
    return h, _targets(n, V, -100, seed=seed), _targets(n, V, 3, every=2, seed=seed + 1), q


def test_linear_cross_entropy_spellings_export_as_gemm_and_lse(tmp_path):
    """7 linear -> CE sites -> ``smx::linear_ce_stats`` (Gemm, then lse and the gathered target logit)."""
    torch.manual_seed(0)
    m, args = LinearHeads().eval(), _head_inputs()
    out = export_onnx(m, args, tmp_path / "heads.onnx")
    _cut(out, "linear_cross_entropy", 7)
    assert "Gemm" in out.op_types and "Tanh" in out.op_types
    assert out.max_abs_diff < 1e-5
    other = _head_inputs(seed=2)
    with torch.no_grad():
        gold = m.double()(*[t.double() if t.is_floating_point() else t for t in other])
    _close(_ort(out.path, *other), [g.float() for g in gold], rtol=1e-5, atol=1e-5)


class ShiftedHead(nn.Module):
    """A soft-capped LM head whose (B, T, V) fp32 logits are returned, with the next-token loss on the rows
    ``logits[:, :-1]`` (the rewrite computes every row; the dropped ones get ``ignore_index``)."""

    def __init__(self, d: int = 8, v: int = 32, reduction: str = "mean"):
        super().__init__()
        self.head, self.v, self.reduction = nn.Linear(d, v, bias=False), v, reduction

    def forward(self, h, labels):
        logits = 5.0 * torch.tanh(self.head(h) / 5.0)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, self.v), labels[:, 1:].reshape(-1),
                               reduction=self.reduction)
        return logits, loss


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_returned_logits_with_a_row_shift(tmp_path, reduction):
    """Logits (2, 6, 32) returned and the loss on the shifted rows: both match eager."""
    torch.manual_seed(0)
    m = ShiftedHead(reduction=reduction).eval()
    h, labels = torch.randn(2, 6, 8), torch.randint(0, 32, (2, 6))
    labels[0, 2] = -100
    out = export_onnx(m, (h, labels), tmp_path / "shift.onnx")
    _cut(out, "linear_cross_entropy", 1)
    assert "returned" in out.report.sites[0].detail
    assert out.max_abs_diff < 1e-5


class DirectCalls(nn.Module):
    """smxcompile's own CE functions called by the model (not pass rewrites): z-loss, per-token weights,
    ``return_lse`` / ``return_z_loss``, scale and soft-cap; ``h`` (N, 8), ``x`` (N, V) of ``dtype``."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.W = nn.Parameter(torch.randn(V, 8, dtype=dtype) / 8 ** 0.5)
        self.b = nn.Parameter(torch.randn(V, dtype=dtype) * 0.1)
        self.register_buffer("w", torch.linspace(0.5, 2.0, V, dtype=dtype))

    def forward(self, h, x, y, tw):
        a = smxcompile.linear_cross_entropy(h, self.W, y, bias=self.b, class_weight=self.w, token_weight=tw,
                                            lse_square_scale=1e-2, return_lse=True, return_z_loss=True,
                                            softcap=20.0, scale=1.5, label_smoothing=0.1)
        b = smxcompile.cross_entropy(x, y, token_weight=tw, lse_square_scale=1e-3, return_lse=True,
                                     reduction="none", scale=0.5)
        return a.loss, a.lse, a.z_loss, b.loss, b.lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_z_loss_token_weights_and_lse_outputs(tmp_path, dtype):
    """Direct ``smxcompile.linear_cross_entropy`` / ``cross_entropy`` calls with every extra option; fp64 runs
    fp64 end to end (the ops' accumulation dtype): the lse outputs match at fp64 precision, the losses to 1e-7
    (torch.onnx writes the Python scalars of the ATen composition -- 0.1 of the smoothing, 1e-2 of the z-loss --
    as fp32 constants cast to fp64: ``x * 0.1`` exports as ``x * 0.10000000149``)."""
    torch.manual_seed(0)
    m = DirectCalls(dtype).eval()
    n = 8
    args = (torch.randn(n, 8, dtype=dtype), torch.randn(n, V, dtype=dtype) * 3, _targets(n, V, -100),
            torch.rand(n, dtype=dtype) + 0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-7, atol=1e-9)
    out = export_onnx(m, args, tmp_path / "direct.onnx", **tol)
    assert "Gemm" in out.op_types and "GatherElements" in out.op_types
    assert not any(op in out.op_types for op in LOGPROB_OPS), out.op_types
    with torch.no_grad():
        ref = m(*args)
    got = _ort(out.path, *args)
    _close(got, ref, **tol)                              # export_onnx compares in fp32; here in the model's dtype
    if dtype == torch.float64:
        _close([got[1], got[4]], [ref[1], ref[4]], rtol=1e-13, atol=1e-13)     # the lse of both ops
    if dtype == torch.float32:
        with torch.no_grad():
            gold = m.double()(*[t.double() if t.is_floating_point() else t for t in args])
        _close(got, [g.float() for g in gold], rtol=1e-5, atol=1e-5)


class Stats(nn.Module):
    """The statistics ops called as they are: ``ce_stats`` on ``x`` (N, V) fp32 with masked (-inf) classes and an
    all -inf row, and with probability targets ``q`` (N, V) and a class weight; ``linear_ce_stats`` on ``h``
    (N, 8) returning its logits rounded to fp16. Every output, the backward-only other-class mass included."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(V, 8) / 8 ** 0.5)
        self.register_buffer("w", torch.linspace(0.5, 2.0, V))

    def forward(self, x, y, q, h):
        smx = torch.ops.smx
        a = smx.ce_stats(x, y, None, self.w, -100, 1.0, None, True, 0)
        b = smx.ce_stats(x, y, q, self.w, -100, 2.0, None, True, 0)
        c = smx.linear_ce_stats(h, self.W, None, y, None, None, -100, 1.0, 4.0, True, True, torch.float16, 0)
        return (*a, b[0], b[3], *c)


def test_every_output_of_the_statistics_ops(tmp_path):
    """lse / target logit / other-class mass / weighted sum / returned logits, against the torch ops."""
    torch.manual_seed(0)
    n = 6
    x = torch.randn(n, V) * 3
    x[:, -2:] = float("-inf")                          # a padded vocabulary masked out
    x[4] = float("-inf")                               # a row with no finite logit: lse -inf as torch
    y = _targets(n, V, -100)
    y[5] = 3
    args = (x, y, torch.softmax(torch.randn(n, V), -1), torch.randn(n, 8))
    m = Stats().eval()
    # compared here: export_onnx's own check does not take -inf == -inf (and NaN rows) as equal
    out = export_onnx(m, args, tmp_path / "stats.onnx", check=False)
    assert "ScatterElements" in out.op_types and "Cast" in out.op_types
    with torch.no_grad():
        ref = m(*args)
    assert torch.isneginf(ref[0][4]) and torch.isnan(ref[2][4])
    _close(_ort(out.path, *args), ref, rtol=1e-5, atol=1e-5)


def test_fp16_head_reads_logits_in_fp32(tmp_path):
    """An fp16 head (h (6, 8), W (11, 8) fp16): Gemm in fp16, statistics in fp32, the loss in fp16 as eager."""
    torch.manual_seed(0)

    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, V, dtype=torch.float16)

        def forward(self, h, y):
            return F.cross_entropy(self.lin(h), y, reduction="none"), F.cross_entropy(self.lin(h).float() * 2.0, y)

    m = Half().eval()
    out = export_onnx(m, (torch.randn(6, 8, dtype=torch.float16), _targets(6, V, -100)), tmp_path / "h.onnx",
                      rtol=2e-3, atol=2e-3)
    _cut(out, "linear_cross_entropy", 2)


# --------------------------------------------------------------------------- transformers models


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=1, n_head=2, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


DYNAMIC = {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}}


def _ids(b: int, t: int, seed: int = 0):
    ids = torch.randint(0, 512, (b, t), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, : t // 3] = -100                       # a prompt that is not trained on
    return ids, labels


def test_gpt2_with_labels_dynamic_batch_and_sequence(tmp_path):
    """GPT-2 (1 layer, n_embd 32, V 512) with ``labels=``: tied lm_head -> cut CE, the label shift of
    ``ForCausalLMLoss``; dynamic (batch, seq) checked at (2, 12), (3, 7); every label ignored gives NaN."""
    model = _gpt2()
    ids, labels = _ids(2, 12)
    ids2, labels2 = _ids(3, 7, seed=1)
    out = export_onnx(model, (), tmp_path / "gpt2.onnx", kwargs={"input_ids": ids, "labels": labels},
                      dynamic_shapes=DYNAMIC, check_inputs=[((), {"input_ids": ids2, "labels": labels2})])
    _cut(out, "linear_cross_entropy", 1)
    assert out.report.count(kind="attention", action="rewritten") == 1
    assert out.max_abs_diff < 1e-4
    ids3 = torch.randint(0, 512, (2, 5))
    got = _ort(out.path, ids3, torch.full_like(ids3, -100))
    with torch.no_grad():
        ref = model(input_ids=ids3, labels=torch.full_like(ids3, -100))
    assert np.isnan(got[0]) and torch.isnan(ref.loss)
    _close(got[1:], [ref.logits], rtol=1e-4, atol=1e-5)


def test_llama_with_labels_and_num_items_in_batch(tmp_path):
    """Llama (1 layer, hidden 32, GQA, V 512): ``num_items_in_batch`` makes the loss a sum divided by it
    (gradient-accumulation normalisation); dynamic (batch, seq) checked at (2, 9) and (3, 6)."""
    model = _llama()
    ids, labels = _ids(2, 9)
    ids2, labels2 = _ids(3, 6, seed=1)
    kw = {"input_ids": ids, "labels": labels, "num_items_in_batch": torch.tensor(5)}
    out = export_onnx(model, (), tmp_path / "llama.onnx", kwargs=kw, dynamic_shapes=DYNAMIC,
                      check_inputs=[((), {"input_ids": ids2, "labels": labels2,
                                          "num_items_in_batch": torch.tensor(7)})])
    _cut(out, "linear_cross_entropy", 1)
    site = out.report.filter("linear_cross_entropy", "rewritten")[0]
    assert "reduction=sum" in site.detail, site.detail
    assert out.max_abs_diff < 1e-4


# --------------------------------------------------------------------------- what is not rewritten / refused


def test_near_misses_are_not_cut(tmp_path):
    """(N, C, d) logits with the classes on dim 1 (not rewritten), and a linear layer whose logits also feed
    other computation (not cut: the plain CE op instead); the file matches eager either way."""
    torch.manual_seed(0)

    class Near(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, V)

        def forward(self, x3, y3, h, y):
            z = self.lin(h)
            return F.cross_entropy(x3, y3), F.cross_entropy(z, y), z.softmax(-1).amax(-1)

    args = (torch.randn(2, V, 5), torch.randint(0, V, (2, 5)), torch.randn(6, 8), _targets(6, V, -100))
    out = export_onnx(Near().eval(), args, tmp_path / "near.onnx")
    assert out.report.count(kind="linear_cross_entropy", action="rewritten") == 0, str(out.report)
    skipped = out.report.filter("cross_entropy", "skipped")
    assert len(skipped) == 1 and "rank 3" in skipped[0].reason, str(out.report)
    assert out.report.count(kind="cross_entropy", action="rewritten") == 1
    assert out.op_types.get("SoftmaxCrossEntropyLoss") == 1      # torch's own translation of the skipped site
    assert "Gemm" in out.op_types and out.max_abs_diff < 1e-5


def test_a_bf16_classifier_is_refused_with_the_reason(tmp_path):
    """A bf16 autocast region around the LM head: no bf16 Gemm in onnxruntime's CPU provider -> a clear error."""
    torch.manual_seed(0)

    class Autocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, V)

        def forward(self, h, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z = self.lin(h)
            return F.cross_entropy(z.float(), y)

    with pytest.raises(OnnxExportError, match=r"smx::linear_ce_stats .*bf16 matmul.*fp32 or fp16.*"
                                              r"'disable': \['linear_cross_entropy'\]"):
        export_onnx(Autocast().eval(), (torch.randn(6, 8), _targets(6, V, -100)), tmp_path / "bf16.onnx")


def test_the_way_out_names_the_kind_of_each_op():
    from smxcompile.export.capture import rewrite_kind

    assert rewrite_kind("linear_ce_stats") == rewrite_kind("linear_ce_loss") == "linear_cross_entropy"
    assert rewrite_kind("ce_stats") == "cross_entropy"
    assert rewrite_kind("softmax_topk_backward") == "softmax_topk"

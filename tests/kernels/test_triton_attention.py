"""Tests of the flash-style attention kernels (smxcompile.kernels.attention.triton_forward / triton_backward).

On a machine without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1, set
by tests/conftest.py before triton is imported) on CPU tensors; on a CUDA machine the same tests run the
compiled kernels.

Reference: the plain formulas (full score matrix, autograd) in float64 on the same (rounded)
inputs: the gold. Accuracy criterion, elementwise: ``|ours - gold| <= |torch - gold| + tol``
where ``torch`` is the same reference computed in the input dtype and ``tol`` a few ulps of
the input dtype times the tensor's largest gold magnitude.
"""

import inspect
import math

import pytest
import torch
from kernels_testing import DEVICE, TRITON_MARKS, compile_for_sm90, require_triton

require_triton()

from smxcompile.kernels.attention import triton_backward, triton_common, triton_forward  # noqa: E402
from smxcompile.kernels.attention.triton_backward import attention_backward  # noqa: E402
from smxcompile.kernels.attention.triton_forward import attention_forward, dropout_keep_mask  # noqa: E402

pytestmark = TRITON_MARKS

NEG_INF = float("-inf")
#: small blocks: several query / key blocks even at these tiny shapes
SMALL = dict(block_m=16, block_n=16)


# ----------------------------------------------------------------------------- reference


def _n_keys(L, S, is_causal, dtype):
    n = torch.full((L,), float(S), dtype=dtype)
    if is_causal:
        n = torch.minimum(torch.arange(1, L + 1, dtype=dtype), n)
    return n[:, None]  # (L, 1)


def _sparse_support(z, vis, entmax):
    """Support of sparsemax / 1.5-entmax (of z = s or s/2) along the last dim, by sorting."""
    zs, _ = torch.sort(z.masked_fill(~vis, NEG_INF), dim=-1, descending=True)
    fin = torch.isfinite(zs)
    z0 = torch.where(fin, zs, torch.zeros_like(zs))
    kk = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype)
    c1 = z0.cumsum(-1)
    if entmax:
        c2 = (z0 * z0).cumsum(-1)
        mean = c1 / kk
        delta = (1 - (c2 - c1 * mean)) / kk
        tau = mean - torch.sqrt(delta.clamp_min(0))
        cond = fin & (tau <= z0)
    else:
        cond = fin & (1 + kk * z0 > c1)
    k = cond.sum(-1, keepdim=True)
    kth = zs.gather(-1, (k - 1).clamp_min(0))
    return vis & (z >= kth) & (k > 0)


def reference(q, k, v, mask, is_causal, scale, softcap, normalizer, norm_param, keep=None, dropout_p=0.0,
              dtype=torch.float64, grad_out=None):
    """The attention contract with plain torch ops in ``dtype``. Returns (out, grads or None)
    where grads = (dq, dk, dv, dparam or None) of ``sum(out * grad_out)``."""
    leaves = [t.detach().cpu().to(dtype).requires_grad_(grad_out is not None) for t in (q, k, v)]
    par = None
    if norm_param is not None:
        par = norm_param.detach().cpu().to(dtype).requires_grad_(grad_out is not None)
    qq, kk, vv = leaves
    B, Hq, L, E = qq.shape
    Hkv, S = kk.shape[1], kk.shape[2]
    G = Hq // Hkv
    kk, vv = kk.repeat_interleave(G, 1), vv.repeat_interleave(G, 1)
    s = (qq @ kk.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    vis = torch.ones(B, Hq, L, S, dtype=torch.bool)
    if is_causal:
        vis = vis & torch.ones(L, S, dtype=torch.bool).tril()
    if mask is not None:
        mask = mask.cpu()
        if mask.dtype == torch.bool:
            vis = vis & mask
        else:
            vis = vis & (mask != NEG_INF)
            s = s + mask.to(dtype).masked_fill(mask == NEG_INF, 0.0)
    n = _n_keys(L, S, is_causal, dtype)
    p4 = par[:, :, None, None] if par is not None else None
    zero = torch.zeros((), dtype=dtype)
    big_neg = torch.finfo(dtype).min
    if normalizer in ("softmax", "ssmax"):
        z = s * ((p4 if p4 is not None else 1.0) * torch.log(n)) if normalizer == "ssmax" else s
        w = torch.softmax(z.masked_fill(~vis, big_neg), -1)
    elif normalizer == "softmax1":
        z = s.masked_fill(~vis, NEG_INF)
        m = z.amax(-1, keepdim=True).clamp_min(0).detach()
        e = torch.exp(z - m)
        w = e / (torch.exp(-m) + e.sum(-1, keepdim=True))
    elif normalizer == "sigmoid":
        w = torch.sigmoid(s + (p4 if p4 is not None else -torch.log(n)))
    elif normalizer == "relu":
        w = torch.relu(s) * (p4 if p4 is not None else 1.0 / n)
    elif normalizer == "softpick":
        e = torch.expm1(s.masked_fill(~vis, 0.0))
        eps = p4 if p4 is not None else 1e-6
        w = torch.relu(e) / (torch.where(vis, e.abs(), zero).sum(-1, keepdim=True) + eps)
    elif normalizer == "softplus":
        c = p4 if p4 is not None else torch.log(n.clamp_min(2))
        f = torch.where(vis, torch.logaddexp(c * s.masked_fill(~vis, 0.0), zero), zero)
        den = f.sum(-1, keepdim=True)
        w = f / torch.where(den > 0, den, torch.ones_like(den))
    elif normalizer in ("sparsemax", "entmax15"):
        ent = normalizer == "entmax15"
        z = s * 0.5 if ent else s
        with torch.no_grad():
            supp = _sparse_support(z, vis, ent)
        cnt = supp.sum(-1, keepdim=True).clamp_min(1).to(dtype)
        zs = torch.where(supp, z, zero)
        mu = zs.sum(-1, keepdim=True) / cnt
        if ent:
            ss = (zs * zs).sum(-1, keepdim=True) - cnt * mu * mu
            tau = mu - torch.sqrt(((1 - ss) / cnt).clamp_min(0))
            w = torch.where(supp, (z - tau) ** 2, zero)
        else:
            tau = (zs.sum(-1, keepdim=True) - 1) / cnt
            w = torch.where(supp, z - tau, zero)
    else:
        raise ValueError(normalizer)
    w = torch.where(vis, w, zero)
    if keep is not None:
        w = w * keep.cpu().to(dtype) / (1 - dropout_p)
    out = w @ vv
    if grad_out is None:
        return out.detach(), None
    wrt = [t for t in leaves] + ([par] if par is not None else [])
    g = torch.autograd.grad(out, wrt, grad_out.detach().cpu().to(dtype), allow_unused=True)
    g = [torch.zeros_like(t) if gi is None else gi for gi, t in zip(g, wrt)]
    return out.detach(), (g[0], g[1], g[2], g[3] if par is not None else None)


# ----------------------------------------------------------------------------- helpers


def _inputs(B, Hq, Hkv, L, S, E, Ev, dtype, seed=0, qscale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hq, L, E, generator=g) * qscale).to(dtype)
    k = torch.randn(B, Hkv, S, E, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, Ev, generator=g).to(dtype)
    go = torch.randn(B, Hq, L, Ev, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (q, k, v, go)]


def _assert_gold(ours, ref, gold, tol, what=""):
    """|ours - gold| <= |ref - gold| + tol elementwise; shapes and finiteness match."""
    ours = ours.detach().double().cpu()
    gold = gold.detach().double().cpu()
    assert ours.shape == gold.shape, (what, ours.shape, gold.shape)
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    allowed = tol + (ref.detach().double().cpu() - gold).abs().nan_to_num(nan=0.0, posinf=0.0)
    err = (ours - gold).abs()
    excess = err - allowed
    assert (excess <= 0).all(), f"{what}: max excess {excess.max().item():.3e} (max err {err.max().item():.3e})"


def _eps(dtype):
    return torch.finfo(dtype).eps


def _run_and_check(q, k, v, go, mask=None, is_causal=False, scale=None, softcap=None, normalizer="softmax",
                   norm_param=None, dropout_p=0.0, seed=0, backward=True, K=None, **kw):
    """Forward (and backward) against the float64 gold; rows whose mask hides every key must
    come out exactly 0 with exactly 0 dq."""
    K = (16.0 if q.dtype == torch.float32 else 2.0) if K is None else K
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, stats = attention_forward(q, k, v, mask, is_causal, scale, softcap, normalizer, norm_param, dropout_p, seed,
                                   **kw)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1])
    assert stats.dtype == torch.float32 and stats.shape == (*q.shape[:3], 2)
    keep = None
    if dropout_p > 0:
        keep = dropout_keep_mask(q.shape[0], q.shape[1], q.shape[2], k.shape[2], dropout_p, seed, device=DEVICE)
    args = (q, k, v, mask, is_causal, scale, softcap, normalizer, norm_param, keep, dropout_p)
    gold, ggrads = reference(*args, grad_out=go if backward else None)
    ref, rgrads = reference(*args, dtype=q.dtype if q.dtype != torch.float16 else torch.float32,
                            grad_out=go if backward else None)
    eps = _eps(q.dtype)
    _assert_gold(out, ref, gold, K * eps * (1 + gold.abs().max()), "out")
    dead = None
    if mask is not None:
        dead = ~mask.any(-1) if mask.dtype == torch.bool else (mask == NEG_INF).all(-1)
        assert (out[dead] == 0).all()
    if not backward:
        return out, stats
    bkw = {n: kw[n] for n in ("block_m", "block_n") if n in kw}
    grads = attention_backward(go, q, k, v, out, stats, mask, is_causal, scale, softcap, normalizer, norm_param,
                               dropout_p, seed, **bkw)
    for name, ours, r, gd, like in zip(("dq", "dk", "dv", "dparam"), grads, rgrads, ggrads, (q, k, v, norm_param)):
        if gd is None:
            assert ours is None, name
            continue
        assert ours.shape == like.shape and ours.dtype == like.dtype, name
        _assert_gold(ours, r, gd, K * eps * (1 + gd.abs().max()), name)
    if dead is not None:
        assert (grads[0][dead] == 0).all()
    return out, stats, grads


def _bool_mask(B, H, L, S, seed=1, p=0.3, expand=False):
    """Random bool mask (True = visible) with row 2 of the last (batch, head) fully masked."""
    g = torch.Generator().manual_seed(seed)
    if expand:  # (1, 1, L, S) expanded: zero strides
        m = torch.rand(1, 1, L, S, generator=g) > p
        m[0, 0, 2] = False
        return m.to(DEVICE).expand(B, H, L, S)
    m = torch.rand(B, H, L, S, generator=g) > p
    m[-1, -1, 2] = False
    return m.to(DEVICE)


def _float_mask(B, H, L, S, seed=2, dtype=torch.float32):
    """Random additive mask, -inf in a quarter of the entries and in all of row 2 of the last batch."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(B, 1, L, S, generator=g)
    m[torch.rand(B, 1, L, S, generator=g) < 0.25] = NEG_INF
    m[-1, 0, 2] = NEG_INF
    return m.to(dtype).to(DEVICE).expand(B, H, L, S)  # head stride 0


# ----------------------------------------------------------------------------- softmax


@pytest.mark.parametrize(
    "dtype,B,Hq,Hkv,L,S,E,Ev,causal,mask,softcap",
    [
        (torch.float32, 2, 4, 2, 37, 29, 20, 24, True, "bool_expand", None),
        (torch.float32, 1, 2, 1, 19, 40, 16, 8, False, "float", 5.0),
        (torch.float32, 1, 3, 3, 33, 18, 24, 20, True, None, 2.0),
        (torch.bfloat16, 2, 4, 1, 21, 35, 24, 16, True, "bool", None),
        (torch.float16, 1, 2, 2, 17, 23, 8, 12, False, "float", None),
        (torch.float32, 1, 2, 1, 9, 13, 80, 96, True, None, None),  # E, Ev > 64, not powers of two
    ],
)
def test_softmax(dtype, B, Hq, Hkv, L, S, E, Ev, causal, mask, softcap):
    q, k, v, go = _inputs(B, Hq, Hkv, L, S, E, Ev, dtype, qscale=2.0)
    m = None
    if mask == "bool":
        m = _bool_mask(B, Hq, L, S)
    elif mask == "bool_expand":
        m = _bool_mask(B, Hq, L, S, expand=True)
    elif mask == "float":
        m = _float_mask(B, Hq, L, S, dtype=dtype)
    _run_and_check(q, k, v, go, m, causal, softcap=softcap, **SMALL)


def test_backward_grid_with_heads_on_axis_0(monkeypatch):
    """Past CUDA's 65535 programs on grid axis 1, (batch, kv head) moves to axis 0: the same gradients."""
    monkeypatch.setattr(triton_backward, "MAX_GRID_Y", 1)
    q, k, v, go = _inputs(2, 4, 2, 21, 19, 16, 16, torch.float32, qscale=2.0)
    _run_and_check(q, k, v, go, _bool_mask(2, 4, 21, 19), True, **SMALL)


def test_softmax_fully_masked_rows_and_default_blocks():
    """Rows without any visible key give out = 0 and zero gradients (bool mask, float -inf
    mask); default block sizes (one block here); a query longer than the keys, causal."""
    B, H, L, S, E = 1, 2, 20, 12, 16
    q, k, v, go = _inputs(B, H, H, L, S, E, E, torch.float32)
    bm = _bool_mask(B, H, L, S).clone()
    bm[0, 0, 3] = False
    bm[0, 1, :5] = False
    out, stats, (dq, dk, dv, _) = _run_and_check(q, k, v, go, bm, True)
    assert (out[0, 0, 3] == 0).all() and (out[0, 1, :5] == 0).all()
    assert (dq[0, 0, 3] == 0).all() and (dq[0, 1, :5] == 0).all()
    fm = torch.zeros(B, H, L, S, device=DEVICE)
    fm[0, 1, 7] = NEG_INF
    out, stats, (dq, _, _, _) = _run_and_check(q, k, v, go, fm, False, normalizer="softmax1")
    assert (out[0, 1, 7] == 0).all() and (dq[0, 1, 7] == 0).all()


# ----------------------------------------------------------------------------- streaming normalizers


@pytest.mark.parametrize("normalizer", ["softmax1", "ssmax", "sigmoid", "relu", "softpick", "softplus"])
@pytest.mark.parametrize("with_param", [False, True])
def test_streaming_normalizers(normalizer, with_param):
    B, Hq, Hkv, L, S, E = 2, 2, 1, 23, 30, 12
    q, k, v, go = _inputs(B, Hq, Hkv, L, S, E, E, torch.float32, seed=3)
    par = None
    if with_param:
        base = {"ssmax": 0.8, "sigmoid": -2.5, "relu": 0.05, "softpick": 0.3, "softplus": 1.7}.get(normalizer, 1.0)
        par = (base * (1 + 0.2 * torch.randn(B, Hq, generator=torch.Generator().manual_seed(5)))).to(DEVICE)
    causal = with_param  # both with and without causal rows (n = min(i + 1, S))
    mask = _bool_mask(B, Hq, L, S, seed=7) if not with_param else _float_mask(B, Hq, L, S, seed=8)
    _, _, grads = _run_and_check(q, k, v, go, mask, causal, softcap=4.0 if normalizer == "ssmax" else None,
                                 normalizer=normalizer, norm_param=par, **SMALL)
    if normalizer == "softmax1" and with_param:
        assert torch.equal(grads[3], torch.zeros_like(grads[3]))  # no parameter: a zero gradient


def test_streaming_bf16():
    q, k, v, go = _inputs(1, 4, 2, 26, 21, 16, 16, torch.bfloat16, seed=4)
    for normalizer in ("softpick", "sigmoid"):
        _run_and_check(q, k, v, go, None, True, normalizer=normalizer, **SMALL)


# ----------------------------------------------------------------------------- sparsemax / entmax15


@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15"])
@pytest.mark.parametrize("dtype,causal,mask", [(torch.float32, True, "bool"), (torch.float32, False, "float"),
                                               (torch.bfloat16, True, None)])
def test_sparse_normalizers(normalizer, dtype, causal, mask):
    B, Hq, Hkv, L, S, E = 1, 4, 2, 25, 34, 16
    q, k, v, go = _inputs(B, Hq, Hkv, L, S, E, 24, dtype, seed=11, qscale=3.0)
    m = _bool_mask(B, Hq, L, S, seed=12) if mask == "bool" else _float_mask(B, Hq, L, S) if mask else None
    _run_and_check(q, k, v, go, m, causal, normalizer=normalizer, **SMALL)  # (with a fully masked row)


def test_sparse_weights_sum_to_one():
    """Through v = identity the output is the weight matrix: rows sum to 1 and are sparse."""
    S = 24
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(1, 1, 16, S, generator=g) * 4).to(DEVICE)
    k = torch.eye(S).reshape(1, 1, S, S).to(DEVICE)
    for normalizer in ("sparsemax", "entmax15"):
        w, _ = attention_forward(q, k, k, None, False, 1.0, None, normalizer, None, 0.0, 0)
        w = w.cpu()
        torch.testing.assert_close(w.sum(-1), torch.ones(1, 1, 16), atol=1e-5, rtol=0)
        assert (w >= 0).all() and (w == 0).any()
        gold, _ = reference(q, k, k, None, False, 1.0, None, normalizer, None)
        torch.testing.assert_close(w.double(), gold, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- dropout


def test_dropout():
    B, Hq, Hkv, L, S, E, p = 1, 2, 1, 20, 27, 16, 0.3
    q, k, v, go = _inputs(B, Hq, Hkv, L, S, E, E, torch.float32, seed=21)
    keep = dropout_keep_mask(B, Hq, L, S, p, 1234, device=DEVICE)
    assert keep.dtype == torch.bool and keep.shape == (B, Hq, L, S)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.06
    assert torch.equal(keep, dropout_keep_mask(B, Hq, L, S, p, 1234, device=DEVICE))
    assert not torch.equal(keep, dropout_keep_mask(B, Hq, L, S, p, 1235, device=DEVICE))
    o1, _ = attention_forward(q, k, v, None, True, 0.25, None, "softmax", None, p, 1234, **SMALL)
    o2, _ = attention_forward(q, k, v, None, True, 0.25, None, "softmax", None, p, 1234, **SMALL)
    o3, _ = attention_forward(q, k, v, None, True, 0.25, None, "softmax", None, p, 99, **SMALL)
    assert torch.equal(o1, o2) and not torch.equal(o1, o3)
    # forward and backward against the reference with the kernels' own keep-mask
    _run_and_check(q, k, v, go, None, True, scale=0.25, dropout_p=p, seed=1234, **SMALL)
    par = torch.full((B, Hq), 0.9, device=DEVICE)
    _run_and_check(q, k, v, go, _bool_mask(B, Hq, L, S), False, normalizer="softpick", norm_param=par, dropout_p=p,
                   seed=2**40 + 7, **SMALL)  # a 64-bit seed
    _run_and_check(q, k, v, go, None, False, normalizer="entmax15", dropout_p=p, seed=8, **SMALL)


# ----------------------------------------------------------------------------- BLASST skipping


def test_skip_threshold():
    B, H, L, S, E = 1, 2, 16, 48, 16
    q, k, v, go = _inputs(B, H, H, L, S, E, E, torch.float32, seed=31)
    q, k = q.clone(), k.clone()
    q[..., 0] = 3.0
    k[..., 0] = 0.0
    k[:, :, 16:32, 0] = -14.0  # key tile 2: scores about 21 below the others (exp(-21) ~ 1e-9)
    exact, _ = attention_forward(q, k, v, None, False, 0.5, None, "softmax", None, 0.0, 0, **SMALL)
    tiny, _ = attention_forward(q, k, v, None, False, 0.5, None, "softmax", None, 0.0, 0, skip_threshold=1e-30,
                                **SMALL)
    assert torch.equal(exact, tiny)  # nothing skipped
    skipped, _ = attention_forward(q, k, v, None, False, 0.5, None, "softmax", None, 0.0, 0, skip_threshold=1e-3,
                                   **SMALL)
    keys = torch.ones(S, dtype=torch.bool)
    keys[16:32] = False  # the reference without tile 2
    gold, _ = reference(q, k, v, keys.expand(B, H, L, S), False, 0.5, None, "softmax", None)
    torch.testing.assert_close(skipped.double().cpu(), gold, atol=1e-5, rtol=0)
    assert (skipped - exact).abs().max() > 0  # it did skip, and only a negligible tile
    torch.testing.assert_close(skipped, exact, atol=1e-3, rtol=0)


# ----------------------------------------------------------------------------- edge cases, errors


def test_empty_and_zero_keys():
    q, k, v, go = _inputs(1, 2, 2, 5, 0, 16, 8, torch.float32)
    out, stats = attention_forward(q, k, v, None, False, 1.0, None, "softmax", None, 0.0, 0)
    assert out.shape == (1, 2, 5, 8) and (out == 0).all()
    dq, dk, dv, dp = attention_backward(go, q, k, v, out, stats, None, False, 1.0, None, "softmax", None, 0.0, 0)
    assert (dq == 0).all() and dk.shape == (1, 2, 0, 16) and dv.shape == (1, 2, 0, 8) and dp is None
    q, k, v, go = _inputs(1, 2, 2, 0, 4, 16, 8, torch.float32)
    out, stats = attention_forward(q, k, v, None, True, 1.0, None, "sparsemax", None, 0.0, 0)
    assert out.shape == (1, 2, 0, 8)


def test_errors(monkeypatch):
    q, k, v, go = _inputs(1, 4, 2, 4, 5, 16, 16, torch.float32)
    args = (None, False, 1.0, None, "softmax", None, 0.0, 0)
    with pytest.raises(ValueError, match="normalizer"):
        attention_forward(q, k, v, None, False, 1.0, None, "softmax2", None, 0.0, 0)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        attention_forward(q, k[:, :1].expand(1, 3, 5, 16), v[:, :1].expand(1, 3, 5, 16), *args)
    with pytest.raises(TypeError, match="share a dtype"):
        attention_forward(q, k.half(), v, *args)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        attention_forward(q.double(), k.double(), v.double(), *args)
    with pytest.raises(ValueError, match="attn_mask"):
        attention_forward(q, k, v, torch.ones(1, 4, 4, 4, dtype=torch.bool, device=DEVICE), *args[1:])
    with pytest.raises(TypeError, match="attn_mask"):
        attention_forward(q, k, v, torch.ones(1, 4, 4, 5, dtype=torch.int32, device=DEVICE), *args[1:])
    with pytest.raises(ValueError, match="norm_param"):
        attention_forward(q, k, v, None, False, 1.0, None, "ssmax", torch.ones(1, 3, device=DEVICE), 0.0, 0)
    with pytest.raises(ValueError, match="dropout_p"):
        attention_forward(q, k, v, None, False, 1.0, None, "softmax", None, 1.0, 0)
    with pytest.raises(ValueError, match="softcap"):
        attention_forward(q, k, v, None, False, 1.0, 0.0, "softmax", None, 0.0, 0)
    with pytest.raises(ValueError, match="skip_threshold"):
        attention_forward(q, k, v, None, False, 1.0, None, "sigmoid", None, 0.0, 0, skip_threshold=0.1)
    with pytest.raises(ValueError, match="block_n"):
        attention_forward(q, k, v, *args, block_n=8)
    with pytest.raises(ValueError, match="stats"):
        attention_backward(go, q, k, v, go, go, *args)
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="CUDA or TRITON_INTERPRET=1"):
            attention_forward(q, k, v, *args)


def test_module_imports_without_triton(import_without_triton):
    mod = import_without_triton("smxcompile.kernels.attention.triton_common",
                                "smxcompile.kernels.attention.triton_forward")
    assert mod.triton is None
    z = torch.zeros(1, 1, 2, 16)
    with pytest.raises(RuntimeError, match="need triton"):
        mod.attention_forward(z, z, z, None, False, 1.0, None, "softmax", None, 0.0, 0)


def test_offsets_are_int64_in_source():
    src = "".join(inspect.getsource(m) for m in (triton_common, triton_forward, triton_backward))
    for blk in ("BLOCK_M", "BLOCK_N", "BLOCK_E", "BLOCK_EV"):
        assert f"tl.arange(0, {blk}).to(tl.int64)" in src
    # four kernels, the backward's with either grid order
    assert src.count("tl.program_id(0).to(tl.int64)") == 5 and src.count("tl.program_id(1).to(tl.int64)") == 5
    assert "tl.program_id(0)" not in src.replace("tl.program_id(0).to(tl.int64)", "")


# ----------------------------------------------------------------------------- GPU compile


def test_kernels_compile_for_cuda():
    """Compile the kernels for sm_90 (no GPU needed): the interpreter is lax about types. Check
    in the TTIR that every pointer offset is int64 (and, without Philox, that no int32 tensor
    multiply exists), and the shared memory of the default tiles: also as a launch on contiguous
    tensors compiles them (unit strides constexpr, the others multiples of 16: vectorized loads,
    deeper pipelining, more shared memory), for sm_90 and, where the budget is 96 KiB, sm_80."""
    compile_for_sm90(
        """
        from triton.backends.compiler import GPUTarget
        from smxcompile.kernels.attention import triton_backward as b, triton_common as c, triton_forward as f
        FLOATS = {"scale", "softcap", "dropout_p", "log_skip"}
        def sig(fn, types, cs):
            return {n: "constexpr" if n in cs else types.get(n, "fp32" if n in FLOATS else
                    "*fp32" if n.endswith("_ptr") else "i64" if n == "seed" else "i32") for n in fn.arg_names}
        n = 0
        def comp(fn, types, cs, limit_kib=96, contiguous=False, tgt=target, **opts):
            global n
            cs = dict(cs, **{c: False for c in ("DOT_F32", "FIX_BF16") if c in fn.arg_names})
            attrs = {}
            if contiguous:  # what Triton specializes for contiguous tensors: unit strides, multiples of 16
                cs.update({a: 1 for a in fn.arg_names if a.endswith("_se") or a == "mk_ss"})
                s = sig(fn, types, cs)
                div = [a for a in fn.arg_names if s[a] != "constexpr" and (
                    a.endswith("_ptr") or a[-3:] in ("_sb", "_sh", "_sl", "_ss") or a in ("L", "S", "E", "EV"))]
                attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div}
            k = triton.compile(triton.compiler.ASTSource(fn, sig(fn, types, cs), constexprs=cs, attrs=attrs),
                               target=tgt, options=opts)
            for line in k.asm["ttir"].splitlines() if not contiguous else ():
                mt = re.search(r"tt\\.addptr %[^,]+, %[^ ]+ : [^,]+, ([^ ]+?)(?: loc|$)", line.strip())
                if mt:
                    assert mt.group(1).endswith("i64>") or mt.group(1) == "i64", line
                if not cs.get("DROPOUT", True):  # Philox multiplies uint32 tensors
                    assert not ("arith.muli" in line and "xi32>" in line), line
            assert k.metadata.shared <= limit_kib * 1024, (fn.__name__, tgt.arch, contiguous, cs, k.metadata.shared)
            n += 1
        sm80 = GPUTarget("cuda", 80, 32)
        for dt, norm, mask, e, drop, skip in [("bf16", 0, 1, 64, True, True), ("fp16", 8, 2, 128, False, False),
                                             ("fp32", 5, 0, 64, False, False), ("bf16", 6, 2, 256, True, False),
                                             ("fp32", 7, 1, 256, False, False), ("fp32", 6, 2, 128, True, False)]:
            opts = dict(num_warps=4 if dt == "fp32" and e <= 64 else 8, num_stages=c.stages(e, dt == "fp32"))
            cs = dict(NORM=norm, HAS_PARAM=norm in (5, 6), MASK_KIND=mask, IS_CAUSAL=norm != 5, HAS_SOFTCAP=norm == 0,
                      DROPOUT=drop, BLOCK_E=e, BLOCK_EV=e, PREC="tf32x3" if dt == "fp32" else "ieee")
            fwd, pre, bwd = (dict(cs, BLOCK_M=t[dt == "fp32"][e][0], BLOCK_N=t[dt == "fp32"][e][1])
                             for t in ((c.BLOCKS_16, c.BLOCKS_32), (c.PRE_BLOCKS_16, c.PRE_BLOCKS_32),
                                       (c.BWD_BLOCKS_16, c.BWD_BLOCKS_32)))
            types = {p: "*" + dt for p in ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dk_ptr", "dv_ptr")}
            types["mask_ptr"] = "*u8" if mask == 1 else "*bf16"
            # fp32 with head dims > 128: <= 160 KiB (sm_80 / sm_90; not sm_86 / sm_89)
            opts["limit_kib"] = 160 if dt == "fp32" and e > 128 else 96
            for kw in [{}, dict(contiguous=True)] + [dict(contiguous=True, tgt=sm80)] * (opts["limit_kib"] == 96):
                comp(f._fwd_kernel, types, dict(fwd, SKIP=skip), **kw, **opts)
                comp(b._bwd_pre_kernel, types, pre, **kw, **opts)
                comp(b._bwd_kernel, types, bwd, **kw, **opts)
        comp(f._keep_kernel, {"out_ptr": "*u8"}, dict(BLOCK_M=16, BLOCK_N=64), num_warps=4)
        print("compiled", n)
        """,
        compiled=52,
        timeout=900,
    )

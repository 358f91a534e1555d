"""Tests of the fused softmax + top-k Triton kernels (smxcompile.kernels.softmax_topk.triton_kernels).

On a machine without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1,
set by tests/conftest.py before triton is imported) on CPU tensors. On a CUDA machine (TRITON_INTERPRET
unset) the same tests run the compiled kernels on the GPU.

Indices must equal, exactly, the first k of a *stable* descending sort of
``z = x.float() * scale`` (fp32, computed by torch the same way as the kernel): the k
largest, exact ties lowest index first, NaN first, -inf last.

Accuracy criterion for values and logd (``log(sum(exp(z - max z)))``, the log of the
normalizer relative to the row max): against an fp64 gold (softmax in fp64 at those
indices), our error may not exceed torch's own error (``torch.topk(torch.softmax(z, -1), k)``
in fp32) by more than a few ulps of the output dtype: ``|ours - gold| <= |torch - gold| + tol``.
Backward: against autograd through the fp64 reference (softmax, then gather at our
indices), same criterion with torch's fp32 autograd as the baseline, elementwise with a
tolerance of a few ulps of each entry's terms, and per row with ``16 eps scale sum_j |g_j v_j|``
(the size of the terms the gradient is a difference of) -- also for logits shifted by
1000 or 10000, where a backward through ``exp(z - lse)`` with an fp32 ``lse`` loses ~|lse| ulps.
"""


import pytest
import torch
from kernels_testing import DEVICE, INTERPRET, TRITON_MARKS, compile_for_sm90, require_triton

require_triton()

from smxcompile.kernels import triton_helpers  # noqa: E402
from smxcompile.kernels.softmax_topk import triton_kernels as tk  # noqa: E402
from smxcompile.kernels.softmax_topk.triton_kernels import softmax_topk_backward, softmax_topk_forward  # noqa: E402

pytestmark = TRITON_MARKS

INF = float("inf")
NAN = float("nan")


def _randn(*shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _small_splits(monkeypatch, block=64, min_split=128, merge=128):
    """Force the split path (several programs per row, merge kernel looping over groups)
    on short rows: cheap in the interpreter."""
    monkeypatch.setattr(tk, "_SINGLE_TILE_MAX", 32)
    monkeypatch.setattr(tk, "_LOOP_BLOCK", block)
    monkeypatch.setattr(tk, "_MIN_SPLIT_COLS", min_split)
    monkeypatch.setattr(tk, "_MERGE_ELEMS", merge)
    monkeypatch.setattr(tk, "_INTERPRETER_SMS", 64)


# ----------------------------------------------------------------------------- references


def _z32(x, scale):
    return x.float().cpu() * scale


def _ref_indices(x, k, scale):
    return torch.sort(_z32(x, scale), dim=-1, descending=True, stable=True).indices[:, :k]


def _logd(z):
    """log(sum(exp(z - max z))) along the last dim, in z's dtype (NaN for rows of NaN, +inf or only -inf)."""
    return torch.log(torch.exp(z - z.amax(-1, keepdim=True)).sum(-1))


def _gold_values(x, idx, scale, renormalize):
    """fp64 softmax at idx (renormalized over idx), and fp64 logd."""
    z = x.double().cpu() * scale
    v = torch.softmax(z, -1).gather(-1, idx.cpu())
    if renormalize:
        v = v / v.sum(-1, keepdim=True)
    return v, _logd(z)


def _torch_values(x, k, scale, renormalize):
    z = _z32(x, scale)
    v = torch.topk(torch.softmax(z, -1), k, dim=-1).values
    if renormalize:
        v = v / v.sum(-1, keepdim=True)
    return v, _logd(z)


def _assert_logd(logd, ref_logd, gold_logd, x, scale):
    """logd in [0, log n]: a few ulps of its size, plus 1 ulp of 1 (the sum's rounding is relative to
    the normalizer d >= 1, so an absolute error in log d); compiled exp / log approximations on a GPU
    add ~|z - max| ulps."""
    mag = gold_logd.abs() + 1
    if not INTERPRET:
        z = x.double().cpu() * scale
        spread = (z.amax(-1, keepdim=True) - z).masked_fill(~torch.isfinite(z), 0).amax()
        mag = mag * (1 + spread)
    assert_gold(logd, ref_logd, gold_logd, torch.float32, rtol_ulps=2.0, atol_ulps=1.0, mag=mag)


def assert_gold(ours, ref, gold, out_dtype, rtol_ulps=2.0, atol_ulps=0.5, mag=None):
    """ours may not be further from gold than torch's `ref` by more than a few ulps of out_dtype.

    tol = rtol_ulps ulps of `mag` (default |gold|) + atol_ulps ulps of max |mag|."""
    assert ours.shape == gold.shape, (ours.shape, gold.shape)
    ours, ref, gold = ours.double().cpu(), ref.double().cpu(), gold.double().cpu()
    fin = torch.isfinite(gold)
    assert torch.isfinite(ours[fin]).all()
    o, r, g = ours[fin], ref[fin], gold[fin]
    if g.numel() == 0:
        return
    m = g.abs() if mag is None else mag.double().cpu()[fin]
    eps = torch.finfo(out_dtype).eps
    tol = rtol_ulps * eps * m + atol_ulps * eps * m.max()
    excess = (o - g).abs() - (r - g).abs() - tol
    assert (excess <= 0).all(), f"max excess over torch's error: {excess.max().item():.3e}"


def _check_fwd(x, k, scale=1.0, renormalize=False, out_dtype=None):
    """Run the forward and check indices (exact), values and logd (gold criterion)."""
    values, indices, logd = softmax_topk_forward(x, k, scale=scale, renormalize=renormalize, out_dtype=out_dtype)
    out_dtype = out_dtype or x.dtype
    R = x.shape[0]
    assert values.shape == (R, k) and values.dtype == out_dtype and values.is_contiguous()
    assert indices.shape == (R, k) and indices.dtype == torch.int64 and indices.is_contiguous()
    assert logd.shape == (R,) and logd.dtype == torch.float32
    assert values.device == x.device and indices.device == x.device and logd.device == x.device
    ref_idx = _ref_indices(x, k, scale)
    assert torch.equal(indices.cpu(), ref_idx), "indices differ from the stable top-k of z"
    gold, gold_logd = _gold_values(x, ref_idx, scale, renormalize)
    ref, ref_logd = _torch_values(x, k, scale, renormalize)
    mag = None
    if not INTERPRET:
        # compiled for a GPU, tl.exp is exp2(z * log2 e): an error ~ |z| ulps
        z = (x.double().cpu() * scale).abs()
        z = z.masked_fill(~torch.isfinite(z), 0).amax()
        mag = gold.abs() * (1 + z)
    assert_gold(values, ref.to(out_dtype), gold, out_dtype, mag=mag)
    _assert_logd(logd, ref_logd, gold_logd, x, scale)
    return values, indices, logd


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize(
    "R,n,k",
    [(5, 1, 1), (37, 7, 1), (37, 7, 2), (9, 7, 7), (300, 8, 2), (33, 8, 8), (40, 64, 8), (6, 64, 64),
     (3, 1000, 50), (3, 1000, 64), (2, 5000, 2), (2, 5000, 64)],
    ids=str,
)
def test_forward_sizes(R, n, k):
    x = _randn(R, n, seed=n + k)
    _check_fwd(x, k)
    _check_fwd(x, k, scale=0.37, renormalize=True)


@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["default", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_forward_dtypes(dtype, out_dtype):
    x = _randn(6, 100, dtype=dtype, seed=1)
    for renormalize in (False, True):
        _check_fwd(x, 10, scale=1.7, renormalize=renormalize, out_dtype=out_dtype)


def test_forward_k_above_64():
    """k up to MAX_K (256): buffers of 128 and 256 keys."""
    x = _randn(3, 300, seed=2)
    _check_fwd(x, 100, renormalize=True)
    _check_fwd(x, tk.MAX_K)


def test_forward_ties_lowest_index_first():
    """Integer-valued data (exact ties), -0.0 and +0.0 tie, in fp32 and bf16, one tile and split."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 4, (4, 70), generator=g).float()
    x[3, ::2] = -0.0
    x[3, 1::2] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype).to(DEVICE)
        for k in (1, 5, 64, 70):
            _check_fwd(xd, k, renormalize=k == 5)
    _, idx, _ = softmax_topk_forward(x[3:].to(DEVICE), 4)
    assert idx.tolist() == [[0, 1, 2, 3]]


def test_forward_strided_rows():
    """Row stride != row length: a column slice of a wider tensor, and every other row."""
    base = _randn(8, 90, seed=4)
    for x in (base[:, 5:75], base[::2, 3:], base[1:, :7], base[2:3]):
        assert x.stride(-1) == 1
        _check_fwd(x, min(7, x.shape[1]), scale=2.0)
        _check_fwd(x, min(7, x.shape[1]), renormalize=True)


def test_forward_split_path(monkeypatch):
    """Several programs per row (splits) and a merge kernel looping over split groups;
    rows whose best entries sit in late splits; tiles that never enter the buffer."""
    _small_splits(monkeypatch)
    n = 700
    x = _randn(3, n, seed=5)
    x[1] = torch.arange(n, dtype=torch.float32) / 100   # ascending: every tile enters
    x[2] = -torch.arange(n, dtype=torch.float32) / 100  # descending: only the first does
    plan = tk._plan(3, n, 64, x.device)
    assert plan["splits"] > 2 and not plan["SINGLE_TILE"] and plan["chunk"] > plan["BLOCK"]
    assert tk._MERGE_ELEMS // 64 < plan["splits"]  # the merge kernel loops
    for k, renormalize in ((1, False), (8, True), (50, False)):
        _check_fwd(x, k, scale=0.8, renormalize=renormalize)
    _check_fwd(x.to(torch.bfloat16), 64, renormalize=True, out_dtype=torch.float32)


def test_forward_long_rows():
    """Rows of ~70000 columns: split across programs by the default plan (4 fake SMs in the
    interpreter), fp16 input with fp32 accumulation; and the backward through the same rows."""
    n = 70_003
    x = _randn(2, n, dtype=torch.float16, scale=4.0, seed=6)
    x[1, 5:40000] = -INF
    plan = tk._plan(2, n, 8, x.device)
    assert plan["splits"] > 1
    values, indices, logd = _check_fwd(x, 8, out_dtype=torch.float32)
    g = _randn(2, 8, seed=7, scale=1.0)
    _check_bwd(g, x, values, indices, logd, scale=1.0, renormalize=False)


def test_forward_very_long_row():
    """262147 columns (k = 1: the cheapest network in the interpreter)."""
    x = _randn(1, 262_147, seed=8)
    x[0, 262_100] = 30.0
    values, indices, _ = _check_fwd(x, 1)
    assert indices.item() == 262_100


# ----------------------------------------------------------------------------- special values


def _special_rows(n, far):
    """Rows with special values; `far` puts them at the end (late split / tile)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(9, n, generator=g) * 3
    j = n - 3 if far else 2
    x[0] = -INF                      # all -inf: NaN values, NaN logd
    x[1, j] = NAN                    # NaN: NaN values, NaN logd
    x[2, j] = INF                    # +inf: NaN values, NaN logd
    x[3, :] = -INF                   # 3 finite entries, k larger: value 0 for -inf picks
    x[3, [1, j, n // 2]] = torch.tensor([1.0, 2.0, -1.0])
    x[4] = -INF
    x[4, j] = INF                    # only +inf and -inf
    x[5, j], x[5, 1] = INF, NAN      # +inf and NaN
    x[6] = -INF
    x[6, j] = NAN                    # NaN among -inf
    x[7, ::3] = -INF                 # some -inf among finite
    x[8] = -INF
    x[8, j] = -1e4                   # one very negative finite value among -inf
    return x


@pytest.mark.parametrize("split", [False, True], ids=["tile", "split"])
@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_forward_special_values(dtype, renormalize, split, monkeypatch):
    n = 300 if split else 40
    if split:
        _small_splits(monkeypatch)
        assert tk._plan(9, n, 8, torch.device(DEVICE))["splits"] > 1
    x = _special_rows(n, far=split).to(dtype).to(DEVICE)
    k = 6
    values, indices, logd = softmax_topk_forward(x, k, renormalize=renormalize)
    z = x.float().cpu()
    special = [0, 1, 2, 4, 5, 6]
    ordinary = [3, 7, 8]
    # indices: valid, distinct, the stable top-k (NaN first, -inf last, ties lowest first)
    idx = indices.cpu()
    assert ((idx >= 0) & (idx < n)).all()
    assert all(len(set(r)) == k for r in idx.tolist())
    assert torch.equal(idx, _ref_indices(x, k, 1.0))
    # values: NaN exactly on the special rows (softmax of such a row is all NaN in torch)
    v = values.cpu()
    assert torch.isnan(v[special]).all() and not torch.isnan(v[ordinary]).any()
    ref = torch.softmax(z, -1)
    assert torch.isnan(ref[special]).all()
    # -inf picks are 0; the 3 finite ones come first
    assert (v[3, 3:] == 0).all() and (v[3, :3] > 0).all()
    assert (v[8, 1:] == 0).all() and v[8, 0].item() == 1.0
    gold, gold_logd = _gold_values(x, idx, 1.0, renormalize)
    tref, tref_logd = _torch_values(x, k, 1.0, renormalize)
    assert_gold(v[ordinary], tref[ordinary].to(dtype), gold[ordinary], dtype)
    # logd: NaN exactly on the special rows (as the fp64 formula), accurate on the others
    logd = logd.cpu()
    assert torch.isnan(logd[special]).all() and torch.isfinite(logd[ordinary]).all()
    assert torch.isnan(gold_logd[special]).all()
    assert logd[8].item() == 0.0     # one finite entry: d == 1
    _assert_logd(logd[ordinary], tref_logd[ordinary], gold_logd[ordinary], x[ordinary], 1.0)


def test_forward_neginf_splits(monkeypatch):
    """Whole splits / tiles of -inf before and between finite ones."""
    _small_splits(monkeypatch)
    x = _randn(4, 600, seed=10)
    x[0, :500] = -INF
    x[1, 64:540] = -INF
    x[2, :599] = -INF                 # only the last entry finite
    x[3, 200:] = -INF
    x[3, :200] -= 1000.0              # very negative finite values
    for renormalize in (False, True):
        values, _, logd = _check_fwd(x, 8, renormalize=renormalize)
        assert torch.isfinite(logd).all()
    assert (values[2, 1:] == 0).all()


@pytest.mark.parametrize("shape,k", [((0, 5), 3), ((3, 5), 0), ((3, 0), 0), ((0, 0), 0)], ids=str)
def test_empty(shape, k):
    x = torch.randn(shape).to(DEVICE)
    for renormalize in (False, True):
        values, indices, logd = softmax_topk_forward(x, k, scale=2.0, renormalize=renormalize)
        assert values.shape == (shape[0], k) and indices.shape == (shape[0], k) and indices.dtype == torch.int64
        assert logd.shape == (shape[0],) and logd.dtype == torch.float32 and (logd == 0).all()
        dx = softmax_topk_backward(values, values, indices, x, logd, scale=2.0, renormalize=renormalize)
        assert dx.shape == shape and dx.dtype == x.dtype and (dx == 0).all()


# ----------------------------------------------------------------------------- backward


def _check_bwd(g, x, values, indices, logd, scale, renormalize, out_dtype=None):
    """Ours (from our forward's values / logd) vs fp32 torch autograd vs fp64 autograd gold,
    all at the same indices: elementwise (a few ulps of each entry's terms) and per row
    (``16 eps scale sum_j |g_j v_j|``)."""
    idx = indices.cpu()

    def autograd_dx(dtype):
        xx = x.cpu().to(dtype).requires_grad_(True)
        p = torch.softmax(xx * scale, -1)
        v = p.gather(-1, idx)
        if renormalize:
            v = v / v.sum(-1, keepdim=True)
        (dx,) = torch.autograd.grad((v * g.cpu().to(dtype)).sum(), xx)
        return dx, p.detach(), v.detach()

    gold, p64, v64 = autograd_dx(torch.float64)
    ref, _, _ = autograd_dx(torch.float32)
    ours = softmax_topk_backward(g, values, indices, x, logd, scale=scale, renormalize=renormalize,
                                 out_dtype=out_dtype)
    out_dtype = out_dtype or x.dtype
    assert ours.shape == x.shape and ours.dtype == out_dtype and ours.is_contiguous()
    assert ours.device == x.device
    # the natural magnitude of dx: its terms
    gv = (g.cpu().double() * v64).abs()
    sel = torch.zeros_like(p64).scatter(-1, idx, gv)
    if renormalize:
        mag = scale * (sel + torch.zeros_like(p64).scatter(-1, idx, v64 * gv.sum(-1, keepdim=True)))
    else:
        mag = scale * (sel + p64 * gv.sum(-1, keepdim=True))
    if not INTERPRET:
        z = (x.double().cpu() * scale).abs()
        mag = mag * (1 + z.masked_fill(~torch.isfinite(z), 0).amax())
    assert_gold(ours, ref.to(out_dtype), gold, out_dtype, rtol_ulps=4.0, atol_ulps=0.1, mag=mag)
    # per row: |ours - gold| <= |torch - gold| + 16 eps scale sum_j |g_j v_j|
    o, r = ours.double().cpu(), ref.to(out_dtype).double()
    row_tol = 16 * torch.finfo(out_dtype).eps * scale * gv.sum(-1, keepdim=True)
    excess = (o - gold).abs() - (r - gold).abs() - row_tol
    assert (excess <= 0).all(), f"max excess over torch's error + row tol: {excess.max().item():.3e}"
    if renormalize:
        unselected = torch.ones_like(p64, dtype=torch.bool).scatter(-1, idx, False)
        assert (ours.cpu()[unselected] == 0).all()
    return ours


@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("R,n,k", [(5, 7, 7), (12, 50, 5), (3, 1000, 64)], ids=str)
def test_backward(R, n, k, dtype, renormalize):
    x = _randn(R, n, dtype=dtype, seed=11)
    scale = 0.6
    values, indices, logd = softmax_topk_forward(x, k, scale=scale, renormalize=renormalize)
    g = _randn(R, k, seed=12, scale=1.0).to(dtype)
    _check_bwd(g, x, values, indices, logd, scale, renormalize)


@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renorm"])
@pytest.mark.parametrize("shift", [1000.0, 10000.0])
def test_backward_shifted_logits(shift, renormalize):
    """Softmax is shift-invariant, so is the gradient's accuracy: logits around +1000 / +10000 (the
    backward rebuilds p relative to the row max, z[indices[:, 0]], and the small logd; through
    exp(z - lse) with an fp32 lse it lost ~|lse| ulps: 7.7e-5 / 1.9e-3 relative). Values rounded to
    bf16 (out_dtype) do not cost fp32 gradient accuracy either: the backward recomputes them."""
    for (R, n, k), scale in (((16, 64, 2), 1.0), ((8, 1000, 8), 0.5), ((3, 300, 50), 1.0)):
        x = _randn(R, n, seed=n + k) + shift
        for out_dtype in (None, torch.bfloat16):
            values, indices, logd = _check_fwd(x, k, scale=scale, renormalize=renormalize, out_dtype=out_dtype)
            g = _randn(R, k, seed=16, scale=1.0)
            _check_bwd(g, x, values, indices, logd, scale, renormalize)


def test_backward_shifted_logits_split_rows(monkeypatch):
    """Shifted logits on rows the forward splits across programs (the merge kernel writes logd)."""
    _small_splits(monkeypatch)
    x = _randn(3, 700, seed=17) + 1000.0
    assert tk._plan(3, 700, 8, x.device)["splits"] > 1
    values, indices, logd = _check_fwd(x, 8, out_dtype=torch.bfloat16)
    _check_bwd(_randn(3, 8, seed=18, scale=1.0), x, values, indices, logd, 1.0, False)


@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renorm"])
def test_backward_does_not_read_values(renormalize):
    """The values are recomputed from x in fp32: the forward's (bf16, or garbage) give the same dx."""
    x = _randn(7, 90, seed=19)
    v32, idx, logd = softmax_topk_forward(x, 6, scale=1.5, renormalize=renormalize)
    v16, idx16, _ = softmax_topk_forward(x, 6, scale=1.5, renormalize=renormalize, out_dtype=torch.bfloat16)
    assert torch.equal(idx, idx16)
    g = _randn(7, 6, seed=20, scale=1.0)
    a = softmax_topk_backward(g, v32, idx, x, logd, scale=1.5, renormalize=renormalize)
    b = softmax_topk_backward(g, v16, idx, x, logd, scale=1.5, renormalize=renormalize)
    c = softmax_topk_backward(g, torch.full_like(v32, NAN), idx, x, logd, scale=1.5, renormalize=renormalize)
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renorm"])
def test_backward_special_rows(renormalize):
    """Rows with NaN / +inf / only -inf: NaN gradients like eager softmax's backward (the whole row;
    renormalized: the k selected entries, the others get none); the other rows are accurate."""
    x = _special_rows(40, far=False).to(DEVICE)
    k = 6
    values, indices, logd = softmax_topk_forward(x, k, renormalize=renormalize)
    g = _randn(9, k, seed=21, scale=1.0)
    dx = softmax_topk_backward(g, values, indices, x, logd, renormalize=renormalize).cpu()
    special, ordinary = [0, 1, 2, 4, 5, 6], [3, 7, 8]
    xx = x.cpu().requires_grad_(True)
    (eager,) = torch.autograd.grad((torch.softmax(xx, -1).gather(-1, indices.cpu()) * g.cpu()).sum(), xx)
    if renormalize:
        selected = torch.zeros_like(dx, dtype=torch.bool).scatter(-1, indices.cpu(), True)
        assert torch.isnan(dx[special][selected[special]]).all()
        assert (dx[special][~selected[special]] == 0).all()
    else:
        assert torch.isnan(eager[special]).all()
        assert torch.isnan(dx[special]).all()
    assert torch.isfinite(dx[ordinary]).all()
    assert (dx[ordinary][torch.isneginf(x.cpu()[ordinary])] == 0).all()
    _check_bwd(g[ordinary], x[ordinary], values[ordinary], indices[ordinary], logd[ordinary], 1.0, renormalize)


@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renorm"])
def test_backward_strided_and_out_dtype(renormalize):
    """Strided x rows, transposed grad / values / indices, int32 indices, fp32 out from bf16."""
    base = _randn(6, 80, dtype=torch.bfloat16, seed=13)
    x = base[:, 10:70]
    values, indices, logd = softmax_topk_forward(x, 9, scale=1.3, renormalize=renormalize, out_dtype=torch.float32)
    g = _randn(9, 6, seed=14, scale=1.0).t()
    assert not g.is_contiguous()
    v_t = values.t().contiguous().t()
    i_t = indices.t().contiguous().t().to(torch.int32)
    _check_bwd(g, x, v_t, i_t.long(), logd, 1.3, renormalize, out_dtype=torch.float32)
    a = softmax_topk_backward(g, v_t, i_t, x, logd, scale=1.3, renormalize=renormalize, out_dtype=torch.float32)
    b = softmax_topk_backward(g.contiguous(), values, indices, x, logd, scale=1.3, renormalize=renormalize,
                              out_dtype=torch.float32)
    assert torch.equal(a, b)
    if renormalize:  # logd is unused there, and may be empty
        c = softmax_topk_backward(g, values, indices, x, logd[:0], scale=1.3, renormalize=True,
                                  out_dtype=torch.float32)
        assert torch.equal(a, c)


# ----------------------------------------------------------------------------- the op's Triton path


@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renorm"])
def test_op_triton_path_empty_shapes(triton_spy, renormalize):
    """smx::softmax_topk on the Triton path (forced on CPU in the interpreter): no rows, rows of no
    columns (reshape(-1, 0) would be ambiguous), k == 0; forward shapes and zero gradients."""
    import smxcompile

    calls = triton_spy(tk, "softmax_topk_forward", "softmax_topk_backward")
    cases = [((0, 8), 2, -1), ((3, 0), 0, -1), ((2, 0, 4), 3, -1), ((2, 0, 4), 0, 1), ((4, 50), 0, -1),
             ((4, 0, 5), 0, 1), ((0,), 0, 0)]
    for shape, k, dim in cases:
        x = torch.randn(shape, device=DEVICE, requires_grad=True)
        r = smxcompile.softmax_topk(x, k, dim, renormalize=renormalize)
        want = list(shape)
        want[dim] = k
        assert r.values.shape == r.indices.shape == tuple(want), (shape, k, dim)
        (r.values * 3).sum().backward()
        assert x.grad.shape == x.shape and not x.grad.any(), (shape, k, dim)
    assert calls["softmax_topk_forward"] == len(cases) and calls["softmax_topk_backward"] >= 1
    # and an ordinary 3-d case through both kernels, dim 1
    x = (_randn(2, 30, 3, seed=22) + 1000.0).requires_grad_(True)
    r = smxcompile.softmax_topk(x, 4, 1, renormalize=renormalize, dtype=torch.bfloat16)
    g = _randn(2, 4, 3, seed=23, scale=1.0, dtype=torch.bfloat16).float()  # (autograd casts it to bf16)
    (dx,) = torch.autograd.grad((r.values.float() * g).sum(), x)
    xx = x.detach().double().requires_grad_(True)
    v = torch.softmax(xx, 1).gather(1, r.indices)
    if renormalize:
        v = v / v.sum(1, keepdim=True)
    (gold,) = torch.autograd.grad((v * g.double()).sum(), xx)
    tol = 16 * torch.finfo(torch.float32).eps * (g.double().abs() * v.detach().abs()).sum(1, keepdim=True)
    assert ((dx.double() - gold).abs() <= tol).all()


# ----------------------------------------------------------------------------- plan, errors, compile


def test_plan(monkeypatch):
    """Launch plans on a pretend 132-SM GPU: long rows split to fill it, short rows share programs;
    the chunks always cover the row exactly once."""
    monkeypatch.setattr(tk, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    p = tk._plan(4, 262_144, 64, cuda)
    assert 4 * p["splits"] >= 132 and p["ROWS"] == 1
    p = tk._plan(16_384, 8, 2, cuda)
    assert p["SINGLE_TILE"] and p["splits"] == 1 and p["ROWS"] * p["BLOCK"] <= tk._ROWS_TILE_ELEMS and p["ROWS"] >= 16
    g = torch.Generator().manual_seed(15)
    for _ in range(300):
        R = int(torch.randint(1, 5000, (1,), generator=g))
        n = int(torch.randint(1, 3_000_000, (1,), generator=g))
        k_pad = 1 << int(torch.randint(0, 9, (1,), generator=g))
        k_pad = min(k_pad, triton_helpers.next_pow2(n))
        for dev in (cuda, torch.device("cpu")):
            p = tk._plan(R, n, k_pad, dev)
            assert p["BLOCK"] >= k_pad and p["chunk"] % p["BLOCK"] == 0
            assert (p["splits"] - 1) * p["chunk"] < n <= p["splits"] * p["chunk"]
            assert p["SINGLE_TILE"] == (p["chunk"] == p["BLOCK"])
            assert p["splits"] == 1 or p["ROWS"] == 1


def test_errors(monkeypatch):
    x = _randn(3, 300)
    with pytest.raises(ValueError, match="MAX_K"):
        softmax_topk_forward(x, tk.MAX_K + 1)
    with pytest.raises(ValueError, match=r"\[0, n\]"):
        softmax_topk_forward(x[:, :5], 6)
    with pytest.raises(ValueError, match=r"\[0, n\]"):
        softmax_topk_forward(x, -1)
    with pytest.raises(TypeError, match="int"):
        softmax_topk_forward(x, True)
    with pytest.raises(TypeError, match="int"):
        softmax_topk_forward(x, 2.0)
    with pytest.raises(ValueError, match="stride 1"):
        softmax_topk_forward(x[:, ::2], 3)
    with pytest.raises(ValueError, match="stride 1"):
        softmax_topk_forward(x.t(), 2)
    with pytest.raises(ValueError, match="2-D"):
        softmax_topk_forward(x.reshape(3, 3, 100), 2)
    with pytest.raises(TypeError, match="float16"):
        softmax_topk_forward(x.double(), 2)
    with pytest.raises(TypeError, match="float16"):
        softmax_topk_forward(x.long(), 2)
    with pytest.raises(ValueError, match="scale"):
        softmax_topk_forward(x, 2, scale=0.0)
    with pytest.raises(TypeError, match="out_dtype"):
        softmax_topk_forward(x, 2, out_dtype=torch.int32)
    too_long = torch.empty(0, device="meta").as_strided((1, 2**31), (2**31, 1))
    with pytest.raises(ValueError, match="too long"):
        softmax_topk_forward(too_long, 2)
    v, i, logd = softmax_topk_forward(x[:, :20], 4)
    xs = x[:, :20]
    with pytest.raises(ValueError, match="shape"):
        softmax_topk_backward(v[:, :3], v, i, xs, logd)
    with pytest.raises(ValueError, match="logd"):
        softmax_topk_backward(v, v, i, xs, logd[:2])
    with pytest.raises(ValueError, match="R = 3"):
        softmax_topk_backward(v[:2], v[:2], i[:2], xs, logd)
    with pytest.raises(TypeError, match="indices"):
        softmax_topk_backward(v, v, i.float(), xs, logd)
    with pytest.raises(ValueError, match="stride 1"):
        softmax_topk_backward(v, v, i, x[:, :40:2], logd)
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="CUDA or TRITON_INTERPRET=1"):
            softmax_topk_forward(xs, 2)
        with pytest.raises(RuntimeError, match="CUDA or TRITON_INTERPRET=1"):
            softmax_topk_backward(v, v, i, xs, logd)


def test_module_imports_without_triton(import_without_triton):
    """Loading the module with triton unavailable works; the launchers then raise clearly."""
    mod = import_without_triton("smxcompile.kernels.softmax_topk.triton_select",
                                "smxcompile.kernels.softmax_topk.triton_kernels")
    assert mod.triton is None
    x = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="need triton"):
        mod.softmax_topk_forward(x, 2)
    with pytest.raises(RuntimeError, match="need triton"):
        mod.softmax_topk_backward(x[:, :2], x[:, :2], x[:, :2].long(), x, x[:, 0])


def test_kernels_compile_for_cuda():
    """Compile the kernels for sm_90 (no GPU needed): the interpreter is lax about types.
    Check in the TTIR that every pointer offset is int64. Small tiles keep it quick; the
    default tiles (K_PAD up to 256, BLOCK 2048) compile the same code with larger shapes."""
    compile_for_sm90(
        """
        from smxcompile.kernels.softmax_topk import triton_kernels as m
        def sig(fn, types, cs):
            def default(a):
                if a == "scale":
                    return "fp32"
                if a.endswith("_ptr"):
                    return "*fp32"
                return "i64" if a.endswith(("_rs", "_cs", "_s")) else "i32"
            return {a: "constexpr" if a in cs else types.get(a, default(a)) for a in fn.arg_names}
        n = 0
        def comp(fn, types, cs, **opts):
            global n
            k = triton.compile(triton.compiler.ASTSource(fn, sig(fn, types, cs), constexprs=cs), target=target,
                               options=opts)
            for line in k.asm["ttir"].splitlines():
                mt = re.search(r"tt\\.addptr %[^,]+, %[^ ]+ : [^,]+, ([^ ]+?)(?: loc|$)", line.strip())
                if mt:
                    assert mt.group(1).endswith("i64>") or mt.group(1) == "i64", line
            assert "ld.local" not in k.asm["ptx"], (fn.__name__, cs)  # no register spills
            n += 1
        I = {"idx_ptr": "*i64", "wsk_ptr": "*i64"}
        comp(m._softmax_topk_fwd_kernel, dict(I, x_ptr="*bf16", vals_ptr="*bf16"),
             dict(K_PAD=2, ROWS=64, BLOCK=8, SINGLE_TILE=True, FINAL=True, RENORM=True), num_warps=4)
        for final in (False, True):
            comp(m._softmax_topk_fwd_kernel, dict(I, x_ptr="*fp16", vals_ptr="*fp32"),
                 dict(K_PAD=4, ROWS=1, BLOCK=32, SINGLE_TILE=False, FINAL=final, RENORM=False), num_warps=1)
        comp(m._softmax_topk_merge_kernel, dict(I, vals_ptr="*fp16"), dict(K_PAD=4, G=4, RENORM=True), num_warps=1)
        comp(m._softmax_topk_bwd_dense_kernel, dict(x_ptr="*bf16", g_ptr="*fp32", i_ptr="*i64", dx_ptr="*bf16"),
             dict(K_PAD=64, ROWS=2, BLOCK=2048), num_warps=8)
        for renorm in (False, True):
            comp(m._softmax_topk_bwd_sparse_kernel, dict(x_ptr="*fp16", g_ptr="*fp32", i_ptr="*i32",
                 dx_ptr="*fp32"), dict(K_PAD=64, ROWS=64, RENORM=renorm), num_warps=8)
        print("compiled", n)
        """,
        compiled=7,
    )

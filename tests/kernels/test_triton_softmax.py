"""Tests of the Triton softmax kernels (smxcompile.kernels.softmax.triton_kernels).

On a machine without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1,
set by tests/conftest.py before triton is imported) on CPU tensors. On a CUDA machine (TRITON_INTERPRET
unset) the same tests run the compiled kernels on the GPU.

Accuracy criterion: against an fp64 gold, our error may not exceed torch's own error
(torch run in the input dtype) by more than a few ulps of the output dtype:
``|ours - gold| <= |torch - gold| + tol``, elementwise. NaN patterns must equal torch's.
"""


import pytest
import torch
from kernels_testing import DEVICE, INTERPRET, TRITON_MARKS, compile_for_sm90, require_triton

require_triton()

from smxcompile.kernels import triton_helpers  # noqa: E402
from smxcompile.kernels.softmax import triton_kernels as ts  # noqa: E402
from smxcompile.kernels.softmax.triton_kernels import softmax_backward, softmax_forward  # noqa: E402

pytestmark = TRITON_MARKS

INF = float("inf")
NAN = float("nan")


def _eps(dtype):
    return torch.finfo(dtype).eps


# ----------------------------------------------------------------------------- references


def _prologue(x, scale=1.0, softcap=None, mask=None, dtype=None):
    """z in `dtype` (default x.dtype): x*scale, softcap, + mask."""
    dtype = dtype or x.dtype
    z = x.to(dtype) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if mask is not None:
        z = z + mask.to(dtype)
    return z


def _torch_fwd(x, dim, log=False, dtype=None, **kw):
    """(y, lse) by torch: the prologue and softmax in `dtype` (default: x's dtype)."""
    z = _prologue(x, dtype=dtype, **kw)
    y = (torch.log_softmax if log else torch.softmax)(z, dim)
    return y, torch.logsumexp(z, dim)


def _gold_fwd(x, dim, log=False, **kw):
    return _torch_fwd(x, dim, log, dtype=torch.float64, **kw)


def assert_gold(ours, ref, gold, out_dtype, rtol_ulps=2.0, atol_ulps=0.5, scale=None):
    """ours may not be further from gold than torch's `ref` by more than a few ulps.

    tol = rtol_ulps ulps of each value + atol_ulps ulps of the largest |value| (lse and
    log-softmax lose absolute, not relative, precision: lse = max + log(sum)). `scale`
    replaces |gold| as the magnitude where errors scale with something else (the terms of
    a difference in backward, |z| after a prologue).

    NaN patterns must equal torch's (`ref`), infinities must equal gold's."""
    assert ours.shape == gold.shape, (ours.shape, gold.shape)
    ours, ref, gold = ours.double().cpu(), ref.double().cpu(), gold.double().cpu()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref)), "NaN pattern differs from torch"
    inf = torch.isinf(gold) & ~torch.isnan(ref)
    assert torch.equal(ours[inf], gold[inf]), "infinities differ from the gold"
    fin = torch.isfinite(gold) & ~torch.isnan(ref)
    assert torch.isfinite(ours[fin]).all()
    o, r, g = ours[fin], ref[fin], gold[fin]
    if g.numel() == 0:
        return
    mag = g.abs() if scale is None else scale.double().cpu()[fin]
    eps = _eps(out_dtype)
    tol = rtol_ulps * eps * mag + atol_ulps * eps * mag.max()
    excess = (o - g).abs() - (r - g).abs() - tol
    assert (excess <= 0).all(), f"max excess over torch's error: {excess.max().item():.3e}"


def _check_fwd(x, dim, log=False, block_size=None, out_dtype=None, return_lse=True, **kw):
    y, lse = softmax_forward(x, dim, log=log, out_dtype=out_dtype, return_lse=return_lse, block_size=block_size, **kw)
    out_dtype = out_dtype or x.dtype
    assert y.dtype == out_dtype and y.shape == x.shape and y.is_contiguous()
    ref_y, ref_lse = _torch_fwd(x, dim, log, **kw)
    gold_y, gold_lse = _gold_fwd(x, dim, log, **kw)
    scale = None
    if kw.get("softcap") is not None or kw.get("mask") is not None or not INTERPRET:
        # z itself is rounded (differently from torch: another tanh), or, compiled for a GPU,
        # tl.exp is exp2(z * log2 e) with an error ~ |z| ulps; y's error then scales with
        # |z|: d(softmax) = p * (dz - sum p dz), d(log_softmax) = dz - sum p dz
        z = _prologue(x, dtype=torch.float64, **kw).abs()
        z = z.masked_fill(~torch.isfinite(z), 0).amax()  # NaN / inf entries have no finite |z| to scale by
        scale = gold_y.abs() + z if log else gold_y.abs() * (1 + z)
    if out_dtype == x.dtype:
        assert_gold(y, ref_y, gold_y, out_dtype, scale=scale)
    else:  # torch's fp32 math vs ours; ours is rounded once to out_dtype
        ref32 = _torch_fwd(x, dim, log, dtype=torch.float32, **kw)[0].to(out_dtype)
        assert_gold(y, ref32, gold_y, out_dtype, scale=scale)
    if return_lse:
        assert lse.dtype == torch.float32 and lse.shape == gold_lse.shape and lse.is_contiguous()
        assert_gold(lse, ref_lse, gold_lse, torch.float32, atol_ulps=2.0)
    else:
        assert lse.dtype == torch.float32 and lse.numel() == 0
    return y, lse


def _randn(*shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("block_size", [None, 8], ids=["single", "multi"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_forward_dtypes_dims(dtype, dim, log, block_size):
    x = _randn(5, 7, 33, dtype=dtype, seed=1)
    _check_fwd(x, dim, log=log, block_size=block_size)


@pytest.mark.parametrize("block_size", [None, 4], ids=["single", "multi"])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize(
    "view",
    ["step_slice", "permute", "transpose", "expand", "expand_dim", "offset"],
)
def test_forward_strided_inputs(view, dim, block_size):
    base = _randn(6, 9, 20, seed=2)
    x = {
        "step_slice": lambda: base[1:, ::2, 1::3],
        "permute": lambda: base.permute(2, 0, 1),
        "transpose": lambda: base.transpose(0, 2)[:, 3:],
        "expand": lambda: base[:1].expand(4, 9, 20),
        "expand_dim": lambda: base[:, :, :1].expand(6, 9, 11),  # stride 0 along the last dim
        "offset": lambda: base[2:5, 3:, 4:],
    }[view]()
    assert not x.is_contiguous()
    _check_fwd(x, dim, log=dim == 1, block_size=block_size)


@pytest.mark.parametrize("block_size", [None, 8], ids=["single", "multi"])
@pytest.mark.parametrize(
    "mask_shape,dim",
    [((1, 1, 24), -1), ((3, 1, 24), -1), ((24,), 2), ((3, 5, 24), -1), ((3, 5, 1), 1), ((1, 5, 24), 0)],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_mask_scale_softcap(dtype, mask_shape, dim, block_size):
    x = _randn(3, 5, 24, dtype=dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    mask = torch.randn(mask_shape, generator=g)
    mask = mask.masked_fill(torch.rand(mask_shape, generator=g) < 0.3, -INF).to(DEVICE)
    kw = dict(scale=0.37, softcap=4.0, mask=mask)
    _check_fwd(x, dim, log=False, block_size=block_size, **kw)
    _check_fwd(x, dim, log=True, block_size=block_size, **kw)


def test_forward_mask_fully_masked_rows_and_dtype():
    """A mask that removes whole rows gives NaN rows (like torch); fp16 mask on fp32 x."""
    x = _randn(3, 4, 17, seed=5)
    mask = torch.zeros(3, 1, 17, dtype=torch.float16, device=DEVICE)
    mask[1] = -INF
    mask[2, 0, 5:] = -INF
    for bs in (None, 4):
        y, _ = _check_fwd(x, -1, block_size=bs, mask=mask)
        assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any()


@pytest.mark.parametrize("block_size", [None, 16], ids=["single", "multi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_softcap_range(dtype, block_size):
    """softcap over a wide range of |z / softcap| (tanh near 0, mid-range and saturated)."""
    x = torch.cat([torch.linspace(-40, 40, 97), torch.linspace(-1, 1, 31)]).reshape(2, 64).to(dtype).to(DEVICE)
    for softcap in (3.0, 50.0):
        _check_fwd(x, -1, softcap=softcap, block_size=block_size)
        _check_fwd(x, 0, scale=2.5, softcap=softcap, log=True, block_size=block_size)


def test_tanh_accuracy():
    """The kernel's tanh (polynomial near 0, exp form elsewhere) within a few fp32 ulps.

    With one column per row, lse = z exactly, so lse exposes softcap * tanh(x / softcap)."""
    u = torch.cat([torch.linspace(-12, 12, 2001), torch.linspace(-0.3, 0.3, 2001), torch.tensor([0.0, 1e-30, 1e-8])])
    _, lse = softmax_forward(u.reshape(-1, 1).to(DEVICE), -1, softcap=1.0, return_lse=True)
    exact = torch.tanh(u.double())
    ulp = torch.finfo(torch.float32).eps * exact.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert ((lse.double().cpu() - exact).abs() <= 3 * ulp).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=str)
def test_forward_out_dtype(out_dtype):
    x = _randn(4, 6, 30, dtype=torch.bfloat16, seed=6)
    _check_fwd(x, 1, out_dtype=out_dtype)
    _check_fwd(x, -1, out_dtype=out_dtype, log=True, block_size=8)


def test_forward_no_lse_and_scalar():
    x = _randn(3, 10, seed=7)
    _check_fwd(x, -1, return_lse=False)
    s = torch.tensor(2.5, device=DEVICE)
    y, lse = softmax_forward(s, 0, return_lse=True)
    assert y.shape == () and y.item() == 1.0 and lse.shape == () and lse.item() == 2.5


# ----------------------------------------------------------------------------- special values


def _special_rows(C, far):
    """Rows with special values; `far` puts them in a late block (multi-block path)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(9, C, generator=g) * 3
    j = C - 3 if far else 2
    x[0] = -INF                      # all -inf: NaN row, lse -inf
    x[1, j] = NAN                    # NaN: NaN row
    x[2, j] = INF                    # +inf: NaN row, lse +inf
    x[3, ::3] = -INF                 # some -inf: finite
    x[4] = -INF
    x[4, j] = INF                    # only +inf and -inf
    x[5, j], x[5, 1] = INF, NAN      # +inf and NaN
    x[6] = -INF
    x[6, j] = NAN                    # NaN among -inf
    x[7, j], x[7, 0] = INF, -INF     # +inf and -inf among finite
    x[8] = -INF
    x[8, j] = -1e4                   # one very negative finite value among -inf
    return x


@pytest.mark.parametrize("block_size", [None, 8], ids=["single", "multi"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_forward_special_values(dtype, log, block_size):
    x = _special_rows(40, far=block_size is not None).to(dtype).to(DEVICE)
    y, lse = softmax_forward(x, -1, log=log, return_lse=True, block_size=block_size)
    ref = (torch.log_softmax if log else torch.softmax)(x, -1)
    ref_lse = torch.logsumexp(x.float(), -1)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    assert torch.isnan(y[[0, 1, 2, 4, 5, 6, 7]]).all() and not torch.isnan(y[[3, 8]]).any()
    assert lse[0].item() == -INF and lse[2].item() == INF and lse[4].item() == INF
    gold, gold_lse = _gold_fwd(x, -1, log)
    assert_gold(y, ref, gold, dtype)
    assert_gold(lse, ref_lse, gold_lse, torch.float32, atol_ulps=2.0)
    # the same rows along dim 0 of a transposed view
    y_t, lse_t = softmax_forward(x.t(), 0, log=log, return_lse=True, block_size=block_size)
    assert torch.equal(torch.isnan(y_t), torch.isnan(ref.t()))
    assert_gold(y_t, ref.t(), gold.t(), dtype)
    assert_gold(lse_t, ref_lse, gold_lse, torch.float32, atol_ulps=2.0)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])
def test_multiblock_neginf_prefix_blocks(log):
    """All -inf blocks before finite ones must not poison the online recurrence."""
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(9))
    x[0, :16] = -INF                 # two all -inf blocks, then finite
    x[1, :39] = -INF                 # only the last element finite
    x[2, :8] = -INF
    x[2, 8:] -= 1000.0               # very negative finite values after an -inf block
    x[3, :24] = -INF
    x[3, 24:] += 1000.0              # very large finite values after -inf blocks
    x[4, 8:16] = -INF                # an -inf block between finite ones
    x = x.to(DEVICE)
    y, lse = _check_fwd(x, -1, log=log, block_size=8)
    assert not torch.isnan(y).any() and torch.isfinite(lse).all()


@pytest.mark.parametrize("shape,dim", [((0, 5), -1), ((3, 0), 1), ((2, 0, 4), 1), ((2, 0, 4), -1), ((0,), 0)], ids=str)
def test_empty(shape, dim):
    x = torch.empty(shape, device=DEVICE)
    for log in (False, True):
        y, lse = softmax_forward(x, dim, log=log, return_lse=True)
        assert y.shape == x.shape and y.numel() == 0
        ref_lse = torch.logsumexp(x, dim)
        assert lse.shape == ref_lse.shape and torch.equal(lse, ref_lse)
        y, lse = softmax_forward(x, dim, log=log)
        assert lse.numel() == 0 and lse.dtype == torch.float32
        dz = softmax_backward(torch.empty_like(x), x, dim, log=log)
        assert dz.shape == x.shape


def test_wide_16bit_rows_take_one_pass(monkeypatch):
    """A 16-bit row of up to MAX_FUSED_BLOCK_16 columns is reduced in one block of 32 warps (no mask, strided
    rows, unit column stride, C and row stride multiples of 16); fp32, a mask, a column stride or an odd C keep
    MAX_FUSED_BLOCK (two passes beyond it)."""
    C = 20_000
    plans = []
    real = ts.row_plan
    monkeypatch.setattr(ts, "row_plan", lambda *a: plans.append(real(*a)) or plans[-1])
    x = _randn(2, C, dtype=torch.bfloat16, seed=13)
    _check_fwd(x, -1)
    _check_fwd(x, -1, log=True, softcap=5.0)
    assert [p[1:] for p in plans] == [(ts.MAX_FUSED_BLOCK_16, True, 32)] * 2
    plans.clear()
    mask = torch.zeros(C, device=x.device)
    _check_fwd(x, -1, mask=mask)
    _check_fwd(x.float(), -1)
    _check_fwd(x.t().contiguous().t(), -1)  # column stride 2
    _check_fwd(x[:, 8:], -1)  # C % 16 != 0
    assert [p[1:3] for p in plans] == [(ts.LOOP_BLOCK, False)] * 4


def _record_tails(monkeypatch, kernel: str) -> list:
    """Wrap ``ts.<kernel>``'s launches: the list gets each launch's TAIL (None for a one-pass launch)."""
    tails, real = [], getattr(ts, kernel)

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                tails.append(None if kw["SINGLE"] else kw["TAIL"])
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ts, kernel, Recorder())
    return tails


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_multiblock_tail_in_registers(monkeypatch, dtype):
    """The forward's multi-block path keeps a row's last columns (from a block boundary) in registers: for aligned
    unit-stride rows without a mask or soft-cap TAIL_BLOCK_WIDE once C reaches it, else TAIL_BLOCK; otherwise
    TAIL_BLOCK_ANY. Constants shrunk so the interpreter sweeps many heads: a tail that starts mid-row, a head of 0
    to several blocks, NaN / +inf / all -inf in the head or the tail, a mask and a soft-cap."""
    for name, v in (("MAX_FUSED_BLOCK", 32), ("MAX_FUSED_BLOCK_16", 64), ("TAIL_BLOCK", 32), ("TAIL_BLOCK_WIDE", 64),
                    ("TAIL_BLOCK_ANY", 16), ("LOOP_BLOCK", 16)):
        monkeypatch.setattr(ts, name, v)
    tails = _record_tails(monkeypatch, "_softmax_fwd_kernel")
    for C in (33, 48, 50, 64, 80, 97, 160):
        x = _randn(6, C, dtype=dtype, scale=4.0, seed=C)
        x[1, C - 3] = float("nan")       # in the tail
        x[2, 0] = INF                    # in the head (or tail when the head is empty)
        x[3, :] = -INF
        x[4, : C - 5] = -INF             # only the tail finite
        x[5, C - 20:] = -INF             # the tail's finite part shorter, the max in the head
        n = len(tails)
        _check_fwd(x, -1)
        _check_fwd(x, -1, log=True, scale=0.5)
        if dtype != torch.float32 and C in (48, 64):  # aligned 16-bit rows up to MAX_FUSED_BLOCK_16: one pass
            assert tails[n:] == [None] * 2
        else:
            assert tails[n:] == [(64 if C >= 64 else 32) if C % 16 == 0 else 16] * 2, (C, tails[n:])
        fin = x[[0, 4, 5]]  # (the prologue's error scale needs rows without NaN / +inf)
        _check_fwd(fin, -1, softcap=3.0)
        _check_fwd(fin, -1, mask=torch.where(_randn(C, seed=1) > 1, -INF, 0.0).to(DEVICE))
        assert tails[-1] == 16 and tails[-2] in (16, None), (C, tails[-2:])  # (aligned 16-bit soft-capped: one pass)
    assert {16, 64} | ({32} if dtype == torch.float32 else set()) <= set(tails)  # (16-bit rows of 48: one pass)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_multiblock_tail_in_registers(monkeypatch, dtype):
    """The backward's multi-block path keeps the last columns (from a block boundary) of a row's g and y in registers:
    the largest power of two of columns that fits BWD_TAIL_BYTES of both, as loaded (16-bit: twice fp32's), at most
    C. Constants shrunk so the interpreter sweeps many heads: a tail that starts mid-row, a head of 0 to several
    blocks, NaN / inf in g or z in the head or the tail, all -inf rows; softmax and log-softmax, with and without
    grad_lse."""
    for name, v in (("MAX_FUSED_BLOCK", 8), ("LOOP_BLOCK", 8), ("BWD_TAIL_BYTES", 128), ("TAIL_BLOCK_ANY", 16)):
        monkeypatch.setattr(ts, name, v)
    tails = _record_tails(monkeypatch, "_softmax_bwd_kernel")
    tail = 128 // (2 * dtype.itemsize)  # 32 columns of 16-bit g and y, 16 of fp32
    for C in (9, 16, 17, 24, 32, 33, 50, 64, 97, 160):
        z = _randn(7, C, dtype=dtype, scale=4.0, seed=C)
        g = _randn(7, C, dtype=dtype, scale=1.0, seed=C + 1)
        z[1, C - 3] = NAN                # NaN rows of y
        z[2, 0] = INF
        z[3, :] = -INF
        z[4, : C - 5] = -INF             # y zero but in the tail
        z[5, C - 8:] = -INF              # y zero in the tail
        g[5, 1] = NAN                    # in the head (or tail when the head is empty)
        g[6, C - 2] = INF                # in the tail
        n = len(tails)
        for log in (False, True):
            _check_bwd(g, z, -1, log=log, grad_lse=None, block_size=None)
            _check_bwd(g, z, -1, log=log, grad_lse=_randn(7, seed=C + 2, scale=1.0).to(dtype), block_size=None)
        # unaligned rows (C % 16 != 0): at most TAIL_BLOCK_ANY
        want = None if C <= 8 else min(tail if C % 16 == 0 else 16, 1 << (C.bit_length() - 1))
        assert tails[n:] == [want] * 4, (C, tails[n:])
    assert {8, 16, tail} <= set(tails)


@pytest.mark.parametrize("C", [8, 40000], ids=["one-block", "tail"])
def test_backward_grad_lse_any_strides(C):
    """grad_lse of any strides: lse.sum()'s gradient is a 1-D stride-0 tensor, a slice has stride 2; the kernel
    reads a contiguous copy (both read past the tensor, or the wrong rows, when passed as they are)."""
    R = 3
    z = _randn(R, C, seed=C)
    g = _randn(R, C, seed=C + 1, scale=1.0)
    for gl in (torch.full((1,), 0.7).expand(R), _randn(2 * R, seed=5, scale=1.0)[::2]):
        for log in (False, True):
            _check_bwd(g, z, -1, log=log, grad_lse=gl.to(DEVICE), block_size=None)


def test_long_row_multiblock():
    """One row longer than 65536 (no column ceiling), fp16 input with fp32 accumulation."""
    C = 70_000
    x = _randn(2, C, dtype=torch.float16, scale=4.0, seed=10)
    x[1, 5:40000] = -INF
    _, block, single, _ = triton_helpers.row_plan(2, C, x.device, None, ts.MAX_FUSED_BLOCK, ts.LOOP_BLOCK)
    assert not single and block < C
    _check_fwd(x, -1)
    _check_fwd(x, -1, log=True, scale=0.5)
    # backward through the two-pass path
    z = x.float()
    g = _randn(2, C, seed=11)
    _check_bwd(g, z, -1, log=False, grad_lse=_randn(2, seed=12), block_size=None)
    _check_bwd(g, z, -1, log=True, grad_lse=None, block_size=None)


# ----------------------------------------------------------------------------- backward


def _check_bwd(g, z, dim, log, grad_lse, block_size, out_dtype=None, relayout=None):
    """Ours vs torch autograd in z's dtype vs fp64 autograd gold, all from the same z.

    Our y input is the fp64 (log-)softmax of z rounded to z's dtype (torch's autograd uses
    its own y): a y with forward error (e.g. torch's own on a 70000-long row, ~20 ulps)
    would make ours look worse than torch against the gold for reasons outside the kernel.
    `relayout` may give y another memory layout (same values)."""
    dtype = z.dtype
    z = z.detach()
    y_in = (torch.log_softmax if log else torch.softmax)(z.double(), dim).to(dtype)
    if relayout is not None:
        y_in = relayout(y_in)

    def autograd_dz(zz, gg, gl):
        zz = zz.clone().requires_grad_(True)
        yy = (torch.log_softmax if log else torch.softmax)(zz, dim)
        out = (yy * gg).sum()
        if gl is not None:
            out = out + (torch.logsumexp(zz, dim) * gl).sum()
        (dz,) = torch.autograd.grad(out, zz)
        return yy.detach(), dz

    p64, gold = autograd_dz(z.double(), g.double(), None if grad_lse is None else grad_lse.double())
    # the natural magnitude of dz = p * (g - S) (softmax) or g - p * S (log): its terms, with
    # S's rounding error proportional to the sum of |terms| (not to |S|)
    gl64 = 0.0 if grad_lse is None else grad_lse.double().unsqueeze(dim).abs()
    g64 = g.double().abs()
    if log:  # (1 + |y|): the error of exp(y), ~ |y| ulps for tl.exp compiled for a GPU
        scale = g64 + p64.exp() * (1 + p64.abs()).nan_to_num(posinf=0.0) * (g64.sum(dim, keepdim=True) + gl64)
    else:
        scale = p64 * (g64 + (g64 * p64).sum(dim, keepdim=True) + gl64)
    y_ref, ref = autograd_dz(z.to(dtype), g.to(dtype), None if grad_lse is None else grad_lse.to(dtype))
    ours = softmax_backward(g, y_in, dim, log=log, grad_lse=grad_lse, out_dtype=out_dtype, block_size=block_size)
    out_dtype = out_dtype or dtype
    assert ours.dtype == out_dtype and ours.shape == y_in.shape and ours.is_contiguous()
    assert_gold(ours, ref, gold, out_dtype, rtol_ulps=4.0, atol_ulps=0.1, scale=scale)
    return ours


@pytest.mark.parametrize("block_size", [None, 8], ids=["single", "multi"])
@pytest.mark.parametrize("with_lse", [False, True], ids=["nolse", "lse"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward(dtype, dim, log, with_lse, block_size):
    z = _randn(4, 5, 24, seed=13).to(dtype)
    g = _randn(4, 5, 24, seed=14, scale=1.0).to(dtype)
    lse_shape = [s for i, s in enumerate(z.shape) if i != dim % 3]
    gl = _randn(*lse_shape, seed=15, scale=1.0) if with_lse else None
    _check_bwd(g, z, dim, log, gl, block_size)


@pytest.mark.parametrize("block_size", [None, 4], ids=["single", "multi"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])
def test_backward_strided_and_out_dtype(log, block_size):
    """Permuted y, sliced grad, expanded (0-stride) grad_lse, fp32 output from bf16."""
    z = _randn(6, 8, 14, seed=16).to(torch.bfloat16).permute(2, 0, 1)  # (14, 6, 8)
    y = (torch.log_softmax if log else torch.softmax)(z, 1).permute(0, 2, 1).contiguous().permute(0, 2, 1)
    g = _randn(14, 6, 16, seed=17, scale=1.0)[:, :, ::2].to(torch.bfloat16)
    gl = _randn(14, 1, seed=18, scale=1.0).expand(14, 8)
    _check_bwd(g, z, 1, log, gl, block_size, relayout=lambda t: t.permute(0, 2, 1).contiguous().permute(0, 2, 1))
    assert not y.is_contiguous()
    # fp32 output: compare with torch in fp32 on the same y
    ours = softmax_backward(g, y, 1, log=log, grad_lse=gl, out_dtype=torch.float32, block_size=block_size)
    p = y.float().exp() if log else y.float()
    if log:
        exp = g.float() - p * (g.float().sum(1, keepdim=True) - gl[:, None])
    else:
        exp = p * (g.float() - (g.float() * p).sum(1, keepdim=True) + gl[:, None])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, exp, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- layouts and errors


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b,
        lambda b: b[:, ::2, 1::3],
        lambda b: b.permute(2, 0, 1),
        lambda b: b.permute(1, 2, 0)[1:, :, 2:],
        lambda b: b[:1, :1].expand(3, 4, 5),
        lambda b: b[0, :, :1].expand(2, 6, 3),
        lambda b: b.unsqueeze(1).expand(4, 2, 6, 5).transpose(0, 3),
    ],
)
def test_row_layout_matches_strides(make):
    """row_layout's row offsets equal the element offsets torch would use, for every dim."""
    base = torch.arange(4 * 6 * 5, dtype=torch.int64).reshape(4, 6, 5)
    x = make(base)
    for dim in range(x.dim()):
        table, s0, n1, s1, cs, mode = triton_helpers.row_layout(x, dim)
        r = torch.arange(x.numel() // x.shape[dim], dtype=torch.int64)
        if mode == triton_helpers.MODE_STRIDE:
            got = r * s0
        elif mode == triton_helpers.MODE_2D:
            got = (r // n1) * s0 + (r % n1) * s1
        else:
            got = table
        # base holds its own flat index, so a row's first element *is* its offset (+ storage offset)
        rows = x.movedim(dim, -1).reshape(-1, x.shape[dim])
        assert torch.equal(got, rows[:, 0] - x.storage_offset())
        if x.shape[dim] > 1:
            assert torch.equal(rows[:, 1] - rows[:, 0], torch.full_like(r, cs))


def test_row_layout_int64_offsets():
    """Offsets past 2**31 are computed in int64 (checked on a meta tensor: no memory)."""
    x = torch.empty(0, device="meta").as_strided((3, 4, 8), (2**33, 2**31 + 7, 1))
    table, s0, n1, s1, cs, mode = triton_helpers.row_layout(x, 2)
    assert mode == triton_helpers.MODE_2D and (s0, n1, s1, cs) == (2**33, 4, 2**31 + 7, 1)
    x = torch.empty(0, device="meta").as_strided((3, 4, 5, 8), (2**33, 2**31 + 7, 3, 1))
    table, *_, mode = triton_helpers.row_layout(x, 3)
    assert mode == triton_helpers.MODE_TABLE and table.dtype == torch.int64
    assert table.device.type == "meta" and table.shape == (60,)


def test_errors(monkeypatch):
    x = _randn(2, 5)
    with pytest.raises(IndexError):
        softmax_forward(x, 2)
    with pytest.raises(TypeError):
        softmax_forward(x.to(torch.int64), -1)
    with pytest.raises(TypeError, match="bool"):
        softmax_forward(x, -1, mask=torch.ones(5, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="broadcast"):
        softmax_forward(x, -1, mask=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="softcap"):
        softmax_forward(x, -1, softcap=0.0)
    with pytest.raises(ValueError, match="block_size"):
        softmax_forward(x, -1, block_size=12)
    with pytest.raises(ValueError, match="shape"):
        softmax_backward(x, x[:, :4], -1)
    with pytest.raises(ValueError, match="lse"):
        softmax_backward(x, x, -1, grad_lse=torch.zeros(3, device=DEVICE))
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="CUDA or TRITON_INTERPRET=1"):
            softmax_forward(x, -1)
        with pytest.raises(RuntimeError, match="CUDA or TRITON_INTERPRET=1"):
            softmax_backward(x, x, -1)


def test_module_imports_without_triton(import_without_triton):
    """Loading the module with triton unavailable works; the launchers then raise clearly."""
    mod = import_without_triton("smxcompile.kernels.softmax.triton_kernels")
    assert mod.triton is None
    with pytest.raises(RuntimeError, match="need triton"):
        mod.softmax_forward(torch.zeros(2, 3), -1)
    with pytest.raises(RuntimeError, match="need triton"):
        mod.softmax_backward(torch.zeros(2, 3), torch.zeros(2, 3), -1)


def test_kernels_compile_for_cuda():
    """The interpreter is lax about types: compile the kernels for sm_90 (no GPU needed)."""
    compile_for_sm90(
        """
        from smxcompile.kernels.softmax import triton_kernels as ts
        def sig(fn, ptrs, ints, floats, cs):
            s = {n: "constexpr" for n in cs}
            s.update({n: t for n, t in ptrs.items()})
            s.update({n: t for n, t in ints.items()})
            s.update({n: "fp32" for n in floats})
            order = [n for n in fn.arg_names]
            return {n: s[n] for n in order}
        def ints(prefixes, ty):
            return {p + k: ty for p in prefixes for k in ("_s0", "_n1", "_s1", "_cs")} | {"R": ty, "C": ty}
        n = 0
        for single, log, mode, ity, dt, rows in [(True, False, 0, "i32", "fp16", 4), (False, True, 2, "i64", "bf16", 1),
                                                 (True, True, 1, "i64", "fp32", 2), (False, False, 1, "i32", "fp32", 1)]:
            rows_t = "*i64" if mode == 2 else "*" + dt
            cs = dict(X_MODE=mode, MASK_MODE=2, Y_MODE=mode, HAS_MASK=not log, HAS_SOFTCAP=single, LOG=log,
                      WRITE_LSE=not single, ROWS=rows, BLOCK=128, SINGLE=single, TAIL=0 if single else 256)
            ptrs = {"x_ptr": "*" + dt, "x_rows": rows_t, "mask_ptr": "*fp32", "mask_rows": "*i64",
                    "y_ptr": "*" + dt, "y_rows": rows_t, "lse_ptr": "*fp32"}
            fn = ts._softmax_fwd_kernel
            triton.compile(triton.compiler.ASTSource(fn, sig(fn, ptrs, ints(["x", "mask", "y"], ity),
                                                            ["scale", "softcap"], cs), constexprs=cs), target=target)
            cs = dict(G_MODE=mode, Y_MODE=2, DZ_MODE=0, LOG=log, HAS_GLSE=single, ROWS=rows, BLOCK=64, SINGLE=single,
                      TAIL=0 if single else 128)
            ptrs = {"g_ptr": "*fp32", "g_rows": rows_t, "y_ptr": "*" + dt, "y_rows": "*i64",
                    "dz_ptr": "*" + dt, "dz_rows": "*" + dt, "glse_ptr": "*fp32"}
            fn = ts._softmax_bwd_kernel
            triton.compile(triton.compiler.ASTSource(fn, sig(fn, ptrs, ints(["g", "y", "dz"], ity), [], cs),
                                                     constexprs=cs), target=target)
            n += 2
        # the register-heavy kernels through ptxas (Triton's own, -v), as softmax_forward / softmax_backward launch
        # them: the one-pass 16-bit forward row at MAX_FUSED_BLOCK_16 (32 warps, 64 registers per thread) and the
        # multi-block paths' tails at TAIL_WARPS (128 registers), aligned (unit column stride, C and the row strides
        # multiples of 16: Triton's divisibility specialization) or, with the smaller tails, in any layout (row
        # table, a column stride, odd C, a mask and a soft-cap): on sm_90a and sm_80, at most 32 bytes of spill per
        # thread (a few registers through L1; the sizes refused spilled 56-284)
        import subprocess, tempfile
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
        def spills(fn, s, cs, aligned, warps, arch):
            div = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
            k = triton.compile(triton.compiler.ASTSource(fn, s, constexprs=cs, attrs=div),
                               target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps))
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(k.asm["ptx"])
                f.flush()
                gpu = "sm_90a" if arch == 90 else "sm_80"
                log_ = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}",
                                       f.name, "-o", "/dev/null"], capture_output=True, text=True, check=True).stderr
            st, ld = map(int, re.search(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", log_).groups())
            assert st <= 32 and ld <= 32, (fn.__name__, cs, arch, log_)
            global n
            n += 1
        def fwd(dt, block, tail, warps, log, softcap=False, mask=False, aligned=True, arch=90):
            fn = ts._softmax_fwd_kernel
            cs = dict(X_MODE=0 if aligned else 2, MASK_MODE=0, Y_MODE=0, HAS_MASK=mask, HAS_SOFTCAP=softcap, LOG=log,
                      WRITE_LSE=True, ROWS=1, BLOCK=block, SINGLE=tail == 0, TAIL=tail, mask_cs=1, y_cs=1)
            if aligned:
                cs["x_cs"] = 1
            s = sig(fn, {"x_ptr": "*" + dt, "x_rows": "*i64", "mask_ptr": "*" + dt, "mask_rows": "*" + dt,
                         "y_ptr": "*" + dt, "y_rows": "*" + dt, "lse_ptr": "*fp32"},
                    {k: v for k, v in ints(["x", "mask", "y"], "i32").items() if k not in cs}, ["scale", "softcap"], cs)
            spills(fn, s, cs, ("x_ptr", "y_ptr", "x_s0", "y_s0", "C") if aligned else (), warps, arch)
        def bwd(dt, tail, log, glse, aligned=True, arch=90):
            fn = ts._softmax_bwd_kernel
            cs = dict(G_MODE=0, Y_MODE=0, DZ_MODE=0, LOG=log, HAS_GLSE=glse, ROWS=1, BLOCK=ts.LOOP_BLOCK,
                      SINGLE=False, TAIL=tail, y_cs=1, dz_cs=1)
            if aligned:
                cs["g_cs"] = 1
            s = sig(fn, {"g_ptr": "*" + dt, "g_rows": "*" + dt, "y_ptr": "*" + dt, "y_rows": "*" + dt,
                         "dz_ptr": "*" + dt, "dz_rows": "*" + dt, "glse_ptr": "*fp32"},
                    {k: v for k, v in ints(["g", "y", "dz"], "i32").items() if k not in cs}, [], cs)
            spills(fn, s, cs, ("g_ptr", "y_ptr", "dz_ptr", "g_s0", "y_s0", "dz_s0", "C") if aligned else (),
                   ts.TAIL_WARPS, arch)
        for arch in (90, 80):
            for log in (False, True):
                fwd("bf16", ts.MAX_FUSED_BLOCK_16, 0, 32, log, softcap=log, arch=arch)
                for dt, size in (("bf16", 2), ("fp32", 4)):
                    for tail in (ts.TAIL_BLOCK_WIDE, ts.TAIL_BLOCK):
                        fwd(dt, ts.LOOP_BLOCK, tail, ts.TAIL_WARPS, log, arch=arch)
                    fwd(dt, ts.LOOP_BLOCK, ts.TAIL_BLOCK_ANY, ts.TAIL_WARPS, log, softcap=True, mask=True,
                        aligned=False, arch=arch)
                    for glse in (False, True):  # the tails softmax_backward picks for g and y of this dtype
                        bwd(dt, ts.BWD_TAIL_BYTES // (2 * size), log, glse, arch=arch)
                        bwd(dt, min(ts.BWD_TAIL_BYTES // (2 * size), ts.TAIL_BLOCK_ANY), log, glse, aligned=False,
                            arch=arch)
        print("compiled", n)
        """,
        compiled=68,
    )

"""Tests of the quantized-softmax Triton kernel (smxcompile.kernels.quant_softmax.triton_kernels).

On a machine without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before triton is imported) on CPU tensors; on a CUDA machine (TRITON_INTERPRET unset) the same tests run the
compiled kernel on the GPU (inputs are made on the CPU and moved).

Criterion: the codes equal the CPU path's (``quant_softmax_decomposed``, itself bit for bit torch's
``quantize_per_tensor(torch.softmax(x, dim), ...)``) except by exactly one level where the code is not
robust to a relative change of the probability by ``2**-16`` -- i.e. where ``t = y * (1 / scale)`` lies
within ~0.004 levels (at ``scale = 1/255``) of a ``k + 0.5`` boundary, or where the fp16 / bf16 rounding
of ``prob_dtype`` is itself at a tie that moves ``t`` across one. Rows of NaN probabilities give
``zero_point`` in both. Rows built to put ``t`` on ``k + 0.5`` (``_tie_rows``) make such differences
actually occur.

Rows longer than the block take the two-sweep path; tests force it on short rows with a small
``block_size`` (the interpreter is slow: shapes are kept small).
"""

import inspect

import pytest
import torch
from kernels_testing import DEVICE, TRITON_MARKS, compile_for_sm90, require_triton

require_triton()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from smxcompile.kernels import triton_helpers  # noqa: E402
from smxcompile.kernels.quant_softmax import quant_softmax, quant_softmax_decomposed  # noqa: E402
from smxcompile.kernels.quant_softmax import triton_kernels as tq  # noqa: E402
from smxcompile.kernels.quant_softmax.triton_kernels import quant_softmax_forward  # noqa: E402

pytestmark = TRITON_MARKS + [
    # numpy (the interpreter) also warns on NaN casts, which the kernel relies on.
    pytest.mark.filterwarnings("ignore:.*invalid value:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning"),
]

INF = float("inf")
NAN = float("nan")
U8, I8 = torch.uint8, torch.int8
RANGES = {U8: (0, 255), I8: (-128, 127)}


def _randn(*shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _tie_rows(n, scale=1 / 255, levels=255):
    """fp32 rows of n columns whose first probability is ``(k + 0.5) * scale``, k = 0..levels-1 (the others
    share the rest): ``t`` sits on a rounding boundary up to the last bits of the softmax."""
    k = torch.arange(levels, dtype=torch.float64)
    y = (k + 0.5) * scale
    x = torch.zeros(levels, n, dtype=torch.float64)
    x[:, 0] = torch.log(y * (n - 1) / (1 - y))
    return x.float()


def _unstable(x, dim, logit_scale, scale, zp, qmin, qmax, prob_dtype=None, rel=2.0**-16):
    """Where the code changes when the probability moves by ``rel`` (relative). False on NaN rows."""
    z = x.float()
    if logit_scale != 1.0:
        z = z * logit_scale
    y = torch.softmax(z.double(), dim)

    def codes(p):
        p = p.float()
        if prob_dtype is not None:
            p = p.to(prob_dtype).float()
        return torch.clamp(torch.round(p * (1.0 / scale)) + zp, qmin, qmax)

    return (codes(y * (1 - rel)) != codes(y * (1 + rel))) & ~y.isnan()


def check(x, dim=-1, *, scale=1 / 255, zero_point=0, dtype=U8, quant_min=None, quant_max=None, logit_scale=1.0,
          prob_dtype=None, block_size=None):
    """Run the kernel on x (moved to DEVICE) and compare with the CPU path; returns the codes (CPU)."""
    qmin = RANGES[dtype][0] if quant_min is None else quant_min
    qmax = RANGES[dtype][1] if quant_max is None else quant_max
    xd = x.to(DEVICE)
    q = quant_softmax_forward(xd, dim, scale=scale, zero_point=zero_point, dtype=dtype, quant_min=quant_min,
                              quant_max=quant_max, logit_scale=logit_scale, prob_dtype=prob_dtype,
                              block_size=block_size)
    assert q.dtype == dtype and q.shape == x.shape and q.device == xd.device and q.is_contiguous()
    q = q.cpu()
    ref = quant_softmax_decomposed(x, dim, logit_scale, scale, zero_point, qmin, qmax, dtype, prob_dtype)
    diff = (q.int() - ref.int()).abs()
    if diff.numel():
        assert diff.max().item() <= 1, "codes differ by more than one level"
    bad = (diff != 0) & ~_unstable(x, dim, logit_scale, scale, zero_point, qmin, qmax, prob_dtype)
    assert not bad.any(), f"{bad.sum().item()} codes differ away from rounding ties"
    return q


# ----------------------------------------------------------------------------- row lengths and paths

COLUMNS = [1, 2, 3, 7, 16, 100, 257, 1000, 2048, 4097, 5000]


@pytest.mark.parametrize("n", COLUMNS)
def test_columns_single_tile(n):
    """Every row in one block (several rows per program for short rows)."""
    rows = 5 if n <= 1000 else 2
    check(_randn(rows, n, seed=n))
    check(_randn(rows, n, seed=n + 1, scale=8.0), scale=1 / 256, zero_point=-128, dtype=I8)


@pytest.mark.parametrize("n,block", [(100, 16), (257, 64), (1000, 128), (5000, 1024), (33, 32)])
def test_columns_two_sweeps(n, block):
    """The online (m, d) sweep over tiles, then the quantizing sweep (rows longer than the block)."""
    check(_randn(3, n, seed=n), block_size=block)
    check(_randn(3, n, seed=n + 1, scale=8.0), scale=1 / 256, zero_point=-128, dtype=I8, block_size=block)


@pytest.mark.parametrize("n,block", [(2, None), (3, None), (50, None), (50, 16)])
def test_rounding_ties(n, block):
    """Rows that put t on k + 0.5: differences occur, and only there, by one level."""
    x = _tie_rows(n)
    q = check(x, block_size=block)
    ref = quant_softmax_decomposed(x, -1, 1.0, 1 / 255, 0, 0, 255, U8)
    if n == 2:  # both entries sit on ties: at least some codes differ from ATen's (measured: ~60 of 510)
        assert (q != ref).any() or DEVICE == "cuda"
    x = _tie_rows(n, scale=1 / 256, levels=256)
    check(x, scale=1 / 256, zero_point=-128, dtype=I8, block_size=block)


# ----------------------------------------------------------------------------- dtypes and quant params


@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("prob_dtype", [None, torch.float16, torch.bfloat16, torch.float32])
def test_dtypes(xdtype, prob_dtype):
    x = _randn(4, 300, dtype=xdtype, seed=3)
    check(x, prob_dtype=prob_dtype)
    check(x, scale=1 / 256, zero_point=-128, dtype=I8, prob_dtype=prob_dtype, logit_scale=0.7)
    check(x, scale=2e-4, zero_point=0, prob_dtype=prob_dtype, block_size=64)


def test_prob_dtype_ties():
    """t on a rounding boundary after the fp16 / bf16 rounding of the probabilities."""
    for prob_dtype in (torch.float16, torch.bfloat16):
        check(_tie_rows(3), prob_dtype=prob_dtype)


@pytest.mark.parametrize("dtype", [U8, I8])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_bits(bits, dtype):
    qmin, qmax = (0, 2**bits - 1) if dtype == U8 else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    x = _randn(4, 60, seed=bits, scale=2.0)
    for zp in (qmin, qmax, (qmin + qmax) // 2):
        q = check(x, scale=1.0 / (2**bits - 1), zero_point=zp, dtype=dtype, quant_min=qmin, quant_max=qmax)
        assert q.int().min() >= qmin and q.int().max() <= qmax
    q = check(x, scale=1e-3, zero_point=qmin, dtype=dtype, quant_min=qmin, quant_max=qmax)
    assert (q.int() == qmax).any()  # clamped


@pytest.mark.parametrize("scale", [1e-30, 1e-6, 0.3, 2.0, 1e30])
def test_extreme_scales(scale):
    x = _randn(3, 40, seed=4)
    x[0, 3] = -INF
    check(x, scale=scale, zero_point=7)
    check(x, scale=scale, zero_point=-3, dtype=I8, block_size=16)


# ----------------------------------------------------------------------------- special values


@pytest.mark.parametrize("block", [None, 8])
def test_special_rows(block):
    """NaN probabilities (a NaN or +inf logit, all -inf) give zero_point; masked entries 0 probability.
    With block 8 the special entries fall in different tiles of the online sweep."""
    x = _randn(9, 40, seed=6)
    x[1] = -INF
    x[2, 5] = NAN
    x[3, 33] = INF
    x[4] = NAN
    x[5, :30] = -INF  # an all -inf prefix (d == 0 over several tiles), then finite entries
    x[6, 1:] = -INF  # one finite entry: probability 1
    x[7, 39] = NAN  # NaN in the last tile only
    x[8, ::3] = -INF
    for zp, dtype in ((0, U8), (-128, I8), (200, U8), (-5, I8)):
        for prob_dtype in (None, torch.bfloat16):
            q = check(x, zero_point=zp, dtype=dtype, prob_dtype=prob_dtype, block_size=block)
            assert (q[[1, 2, 3, 4, 7]] == zp).all()
            assert (q[5, :30] == zp).all() and (q[8, ::3] == zp).all()
            assert q[6, 0].item() == min(zp + 255, RANGES[dtype][1]) and (q[6, 1:] == zp).all()


def test_masks():
    g = torch.Generator().manual_seed(1)
    x = _randn(8, 130, seed=12)
    x[torch.rand(x.shape, generator=g) < 0.7] = -INF
    causal = torch.triu(torch.full((20, 20), -INF), 1) + _randn(20, 20, seed=2)
    for t in (x, causal):
        check(t)
        check(t, scale=1 / 256, zero_point=-128, dtype=I8, block_size=16)


def test_empty_and_scalar():
    for shape, dim in (((0,), 0), ((0, 5), -1), ((3, 0), -1), ((3, 0), 0), ((2, 0, 4), 1)):
        q = quant_softmax_forward(torch.empty(shape, device=DEVICE), dim, scale=0.1)
        assert q.shape == shape and q.dtype == U8
    for v, code in ((1.5, 255), (-INF, 0), (NAN, 0), (INF, 0)):
        q = quant_softmax_forward(torch.tensor(v, device=DEVICE), scale=1 / 255)
        assert q.shape == () and q.item() == code
    q = quant_softmax_forward(torch.tensor(2.0, device=DEVICE), 0, scale=1 / 256, zero_point=-128, dtype=I8)
    assert q.item() == 127


# ----------------------------------------------------------------------------- layouts


LAYOUTS = {
    "contiguous": lambda b: b,
    "permute": lambda b: b.permute(2, 0, 1),
    "slice": lambda b: b[:, ::2, 1::3],
    "offset": lambda b: b[1:, 2:, 3:],
    "expand": lambda b: b[:1, :, :1].expand(3, 6, 4),
    "table": lambda b: b.unsqueeze(1).expand(4, 2, 6, 20).permute(3, 1, 0, 2)[::2],  # row table (mode 2)
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_and_dims(layout):
    """Any dim of permuted / sliced / expanded inputs, without a copy (row offsets from the strides)."""
    x = LAYOUTS[layout](_randn(4, 6, 20, seed=9))
    for dim in range(-x.dim(), x.dim()):
        q = check(x, dim, zero_point=3, block_size=4 if dim % 2 else None)
        assert torch.equal(q, check(x.contiguous(), dim, zero_point=3))


def test_row_layout_modes():
    """The layouts above cover the three row-offset modes of the kernel."""
    modes = {triton_helpers.row_layout(LAYOUTS[k](torch.empty(4, 6, 20)), d)[5] for k in LAYOUTS for d in range(3)}
    assert modes == {0, 1, 2}


def test_int64_offsets():
    """Offsets past 2**31 cannot be allocated here. They are int64 by construction: every row index
    starts as ``program_id(0).to(tl.int64)`` / an int64 arange, the row offsets of the layouts are int64
    (``test_row_layout_int64_offsets`` in test_triton_softmax.py checks them on meta tensors with strides
    past 2**31), and ``test_kernel_compiles_for_cuda`` checks in the TTIR that every pointer offset is i64."""
    src = inspect.getsource(tq)
    assert src.count("tl.program_id(0).to(tl.int64)") == 1
    assert src.count("tl.arange(0, BLOCK).to(tl.int64)") == 3
    assert "tl.arange(0, ROWS).to(tl.int64)" in src
    assert "return off.to(tl.int64)" in inspect.getsource(triton_helpers.row_offset.fn)   # shared with softmax
    x = torch.empty(0, device="meta").as_strided((3, 4, 8), (2**33, 2**31 + 7, 1))
    assert triton_helpers.row_layout(x, 2)[1:5] == (2**33, 4, 2**31 + 7, 1)


# ----------------------------------------------------------------------------- rounding


if triton is not None:

    @triton.jit
    def _quantize_test_kernel(y_ptr, q_ptr, n, inv_scale, zp, qmin, qmax, PROB: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        y = tl.load(y_ptr + offs, mask=ok, other=0.0)
        tl.store(q_ptr + offs, tq._quantize(y, inv_scale, zp, qmin, qmax, PROB), mask=ok)


def _run_quantize(y, inv_scale, zp, qmin, qmax, prob):
    yd = y.to(DEVICE)
    q = torch.empty_like(yd)
    block = triton.next_power_of_2(y.numel())
    _quantize_test_kernel[(1,)](yd, q, y.numel(), inv_scale, float(zp), float(qmin), float(qmax),
                                PROB=prob, BLOCK=block, enable_fp_fusion=False)
    return q.cpu()


def _torch_codes(y, inv_scale, zp, qmin, qmax, prob_dtype):
    if prob_dtype is not None:
        y = y.to(prob_dtype).float()
    t = y * inv_scale
    q = torch.clamp(torch.round(t) + zp, qmin, qmax)
    return torch.where(t.isnan(), float(zp), q)


def test_round_half_to_even():
    """The epilogue's rounding is torch.round's (half to even) on the rounded product, exactly: ties,
    values next to ties, integers past 2**23, infinities and NaN."""
    k = torch.arange(-140, 141, dtype=torch.float32)
    ties = torch.cat([k + 0.5, k, k + 0.25])
    near = torch.cat([torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    big = torch.tensor([2.0**22 + 0.5, 2.0**23 - 0.5, 2.0**23 + 1, 2.0**24 + 2, 3e38, -3e38, INF, -INF, NAN, -0.0,
                        0.49999997, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5])
    y = torch.cat([ties, near, big])
    for zp, qmin, qmax in ((0, -128, 127), (3, -100, 100), (-128, -128, 127)):
        assert torch.equal(_run_quantize(y, 1.0, zp, qmin, qmax, 0), _torch_codes(y, 1.0, zp, qmin, qmax, None))
    # the product is rounded to fp32 first, as ATen does
    y = torch.rand(4000, generator=torch.Generator().manual_seed(0))
    inv = float(torch.tensor(1 / 0.003, dtype=torch.float32))
    assert torch.equal(_run_quantize(y, inv, 0, 0, 255, 0), _torch_codes(y, inv, 0, 0, 255, None))


@pytest.mark.parametrize("prob_dtype", [torch.float16, torch.bfloat16])
def test_prob_dtype_rounding(prob_dtype):
    """fp32 -> fp16 / bf16 rounding of the probabilities is torch's (nearest, ties to even), ties and
    subnormals included (the interpreter's own bf16 cast truncates)."""
    g = torch.Generator().manual_seed(1)
    y = torch.rand(3000, generator=g) ** 4
    bits = y.view(torch.int32)
    low = 16 if prob_dtype == torch.bfloat16 else 13
    half = 1 << (low - 1)
    ties = ((bits >> low) << low) | half  # exactly halfway between two representable values
    sub = torch.tensor([1e-8, 3e-8, 6e-8, 1e-39, 2.0**-25, 2.0**-24 * 1.5, 0.0, 1.0, NAN])
    y = torch.cat([y, ties.view(torch.float32), sub])
    code = 1 if prob_dtype == torch.float16 else 2
    for inv in (255.0, 2.0**30, 2.0**100):
        assert torch.equal(_run_quantize(y, inv, 0, 0, 255, code), _torch_codes(y, inv, 0, 0, 255, prob_dtype))


# ----------------------------------------------------------------------------- the op routes here


def test_op_routes_to_triton(triton_spy):
    """With config.force_triton (CPU, interpreter) or on CUDA the public function runs this kernel."""
    triton_spy(tq, "quant_softmax_forward")
    calls = triton_spy.args  # (name, x) of every call
    x = _randn(3, 4, 50, seed=8).to(DEVICE)
    q = quant_softmax(x, 1, scale=1 / 256, zero_point=-128, dtype=I8, temperature=0.8)
    assert [x.dtype for _, x in calls] == [torch.float32]
    assert q.is_contiguous() and q.dtype == I8 and q.device == x.device
    ref = quant_softmax_decomposed(x.cpu(), 1, 1 / 0.8, 1 / 256, -128, -128, 127, I8)
    diff = (q.cpu().int() - ref.int()).abs()
    assert diff.max() <= 1 and not ((diff != 0) & ~_unstable(x.cpu(), 1, 1 / 0.8, 1 / 256, -128, -128, 127)).any()
    xh = x.half().permute(2, 0, 1)
    q = quant_softmax(xh, 2, scale=1 / 255, prob_dtype=torch.float16, bits=6)
    assert calls[-1][1].dtype == torch.float16 and q.shape == xh.shape and q.is_contiguous()
    # fp64 takes the torch path
    quant_softmax(x.double(), scale=0.1)
    assert len(calls) == 2
    torch.library.opcheck(torch.ops.smx.quant_softmax.default, (x, 2, 0.5, 1 / 255, 4, 0, 255, U8, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------------------------- errors


def test_errors(monkeypatch):
    x = _randn(3, 10).to(DEVICE)
    with pytest.raises(TypeError, match="float16"):
        quant_softmax_forward(x.double(), scale=0.1)
    with pytest.raises(TypeError, match="float16"):
        quant_softmax_forward(x.long(), scale=0.1)
    with pytest.raises(TypeError, match="dtype"):
        quant_softmax_forward(x, scale=0.1, dtype=torch.int16)
    with pytest.raises(TypeError, match="prob_dtype"):
        quant_softmax_forward(x, scale=0.1, prob_dtype=torch.int8)
    with pytest.raises(IndexError):
        quant_softmax_forward(x, 2, scale=0.1)
    with pytest.raises(ValueError, match="quant range"):
        quant_softmax_forward(x, scale=0.1, quant_min=-1)
    with pytest.raises(ValueError, match="quant range"):
        quant_softmax_forward(x, scale=0.1, dtype=I8, quant_min=5, quant_max=5, zero_point=5)
    with pytest.raises(ValueError, match="zero_point"):
        quant_softmax_forward(x, scale=0.1, zero_point=-1)
    for s in (0.0, -1.0, INF, NAN, 1e-45):
        with pytest.raises(ValueError, match="scale"):
            quant_softmax_forward(x, scale=s)
    for s in (0.0, INF, NAN, 1e39):
        with pytest.raises(ValueError, match="logit_scale"):
            quant_softmax_forward(x, scale=0.1, logit_scale=s)
    with pytest.raises(ValueError, match="block_size"):
        quant_softmax_forward(x, scale=0.1, block_size=12)
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="CUDA or TRITON_INTERPRET=1"):
            quant_softmax_forward(x, scale=0.1)


def test_module_imports_without_triton(import_without_triton):
    """Loading the module with triton unavailable works; the launcher then raises clearly."""
    mod = import_without_triton("smxcompile.kernels.quant_softmax.triton_kernels")
    assert mod.triton is None
    with pytest.raises(RuntimeError, match="need triton"):
        mod.quant_softmax_forward(torch.zeros(2, 3), scale=0.1)


def test_kernel_compiles_for_cuda():
    """Compile the kernel for sm_90 (no GPU needed): the interpreter is lax about types. Check in the TTIR
    that every pointer offset is i64; in the PTX that no fp32 add / sub / mul may be contracted into an
    fma (all ``.rn``: products rounded as ATen rounds them, which the tie-breaking relies on) and that
    no register spills."""
    compile_for_sm90(
        """
        from smxcompile.kernels.quant_softmax import triton_kernels as m
        fn = m._quant_softmax_kernel
        n = 0
        for single, mode, ity, xt, qt, prob, rows, block, warps in [
                (True, 0, "i32", "fp16", "u8", 1, 4, 1024, 8), (False, 2, "i64", "bf16", "i8", 2, 1, 4096, 8),
                (True, 1, "i64", "fp32", "i8", 0, 1, 8192, 8), (False, 1, "i32", "fp32", "u8", 0, 2, 128, 2)]:
            rows_t = "*i64" if mode == 2 else "*" + xt
            cs = dict(X_MODE=mode, Q_MODE=min(mode, 1), HAS_SCALE=not single, PROB=prob, ROWS=rows,
                      BLOCK=block, SINGLE=single)
            sig = {"x_ptr": "*" + xt, "x_rows": rows_t, "q_ptr": "*" + qt, "q_rows": "*" + qt, "R": ity, "C": ity}
            sig.update({p + k: ity for p in ("x", "q") for k in ("_s0", "_n1", "_s1", "_cs")})
            sig.update({k: "fp32" for k in ("logit_scale", "inv_scale", "zero_point", "quant_min", "quant_max")})
            sig.update({k: "constexpr" for k in cs})
            sig = {a: sig[a] for a in fn.arg_names}
            k = triton.compile(triton.compiler.ASTSource(fn, sig, constexprs=cs), target=target,
                               options=dict(num_warps=warps, enable_fp_fusion=False))
            for line in k.asm["ttir"].splitlines():
                mt = re.search(r"tt\\.addptr %[^,]+, %[^ ]+ : [^,]+, ([^ ]+?)(?: loc|$)", line.strip())
                if mt:
                    assert mt.group(1).endswith("i64>") or mt.group(1) == "i64", line
            ptx = k.asm["ptx"]
            assert "mul.rn.f32" in ptx and not re.search(r"\\b(?:add|sub|mul)\\.f32\\b", ptx), "contractible fp32 op"
            assert "cvt.rmi." in ptx  # floor
            assert "ld.local" not in k.asm["ptx"], cs  # no register spills
            n += 1
        print("compiled", n)
        """,
        compiled=4,
    )

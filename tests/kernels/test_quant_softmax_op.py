"""``smx::quant_softmax`` and ``smxcompile.kernels.quant_softmax`` on CPU (the torch path; the Triton kernel
has its own test file, tests/kernels/test_triton_quant_softmax.py).

Criterion: bit for bit equal to torch's own spelling
``quantized_decomposed.quantize_per_tensor(torch.softmax(x, dim), scale, zero_point, quant_min, quant_max,
dtype)`` (``quant_softmax_reference``), except for NaN probabilities, where the op writes ``zero_point``
(torch casts NaN to an integer there: platform-dependent).

Under ``torch.compile`` (Inductor generates its own softmax) codes may differ by one level where
``t = y * (1 / scale)`` lies within a few ulps of a ``k + 0.5`` boundary: ``assert_codes`` checks that
every difference is at most 1 and that each lies where the code is not robust to a relative perturbation
of the probability by ``2**-16`` (about 0.004 levels at ``scale = 1/255``).
"""

from __future__ import annotations

import re

import pytest
import torch

from smxcompile.kernels import quant_softmax as qs
from smxcompile.kernels.quant_softmax import quant_softmax, quant_softmax_decomposed, quant_softmax_reference

INF = float("inf")
NAN = float("nan")
U8, I8 = torch.uint8, torch.int8


# the CPU (torch) path, whatever another test module left in the kernel switches
pytestmark = pytest.mark.usefixtures("torch_path")


def _randn(*shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _full_range(dtype, bits=None):
    if bits is None:
        return qs.QUANT_RANGES[dtype]
    return (0, 2**bits - 1) if dtype == U8 else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def _nan_probs(x, dim, logit_scale=1.0):
    z = x.double()
    return torch.softmax(z * logit_scale, dim).isnan()


def assert_exact(q, x, dim, logit_scale, scale, zp, qmin, qmax, dtype, prob_dtype=None):
    """q equals torch's spelling bit for bit, and zero_point where the probabilities are NaN."""
    assert q.dtype == dtype and q.shape == x.shape
    ref = quant_softmax_reference(x, dim, logit_scale, scale, zp, qmin, qmax, dtype, prob_dtype)
    nan = _nan_probs(x, dim, logit_scale)
    assert torch.equal(q[~nan], ref[~nan]), f"{(q[~nan] != ref[~nan]).sum().item()} codes differ"
    assert (q[nan] == zp).all()


def _unstable(x, dim, logit_scale, scale, zp, qmin, qmax, prob_dtype=None, rel=2.0**-16):
    """Where the code changes when the probability moves by ``rel`` (relative): near a rounding boundary
    of ``t`` (or of the ``prob_dtype`` rounding that feeds it). False on NaN rows."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = x.to(acc)
    if logit_scale != 1.0:
        z = z * logit_scale
    y = torch.softmax(z.double(), dim)

    def codes(p):
        if acc == torch.float32 or prob_dtype is not None:
            p = p.float()
            if prob_dtype is not None:
                p = p.to(prob_dtype).float()
        return torch.clamp(torch.round(p * (1.0 / scale)) + zp, qmin, qmax)

    lo, hi = codes(y * (1 - rel)), codes(y * (1 + rel))
    return (lo != hi) & ~y.isnan()


def assert_codes(q, ref, unstable):
    """q == ref except, by exactly one level, where the code is unstable (a rounding tie)."""
    assert q.shape == ref.shape and q.dtype == ref.dtype
    diff = (q.int() - ref.int()).abs()
    assert not (diff > 1).any(), "codes differ by more than one level"
    bad = (diff != 0) & ~unstable
    assert not bad.any(), f"{bad.sum().item()} codes differ away from rounding ties"


# --------------------------------------------------------------------------- bit-exact against torch's spelling

SHAPES = [(1, 1), (3, 7), (4, 64), (2, 1000), (3, 4097), (2, 3, 33)]
QPARAMS = [  # (scale, zero_point, dtype)
    (1 / 255, 0, U8), (1 / 256, -128, I8), (1 / 127, 0, I8), (0.01, 3, U8), (0.3, 10, U8), (2.0, 0, U8),
    (1e-4, -100, I8), (1 / 255, 255, U8), (0.123456789, -7, I8),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qp", QPARAMS)
def test_matches_torch_fp32(shape, qp):
    scale, zp, dtype = qp
    x = _randn(*shape, seed=len(shape) + shape[-1])
    qmin, qmax = _full_range(dtype)
    q = quant_softmax(x, scale=scale, zero_point=zp, dtype=dtype)
    assert q.is_contiguous()
    assert_exact(q, x, -1, 1.0, scale, zp, qmin, qmax, dtype)
    # the decomposition (what a pass emits on CPU) and the op called directly agree
    assert torch.equal(quant_softmax_decomposed(x, -1, 1.0, scale, zp, qmin, qmax, dtype), q)
    assert torch.equal(torch.ops.smx.quant_softmax(x, len(shape) - 1, 1.0, scale, zp, qmin, qmax, dtype), q)


@pytest.mark.parametrize("dtype", [U8, I8])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_bits(bits, dtype):
    x = _randn(6, 200, seed=bits, scale=2.0)
    qmin, qmax = _full_range(dtype, bits)
    scale = 1.0 / (2**bits - 1)
    for zp in (qmin, 0 if qmin <= 0 <= qmax else qmin, qmax):
        q = quant_softmax(x, scale=scale, zero_point=zp, dtype=dtype, bits=bits)
        assert_exact(q, x, -1, 1.0, scale, zp, qmin, qmax, dtype)
        assert q.int().min() >= qmin and q.int().max() <= qmax
    # small scale: most codes clamp at quant_max
    q = quant_softmax(x, scale=1e-4, zero_point=qmin, dtype=dtype, bits=bits)
    assert_exact(q, x, -1, 1.0, 1e-4, qmin, qmin, qmax, dtype)
    assert (q.int() == qmax).any()


def test_bits_with_explicit_range():
    """bits fills in only the bound that is not given."""
    x = _randn(3, 50)
    q = quant_softmax(x, scale=0.05, bits=4, quant_max=10)
    assert_exact(q, x, -1, 1.0, 0.05, 0, 0, 10, U8)
    q = quant_softmax(x, scale=0.05, zero_point=-3, dtype=I8, bits=3, quant_min=-3)
    assert_exact(q, x, -1, 1.0, 0.05, -3, -3, 3, I8)


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.0, 3.0, 1e-3])
def test_temperature(temperature):
    x = _randn(5, 300, seed=3)
    q = quant_softmax(x, scale=1 / 255, temperature=temperature)
    assert_exact(q, x, -1, 1.0 / temperature, 1 / 255, 0, 0, 255, U8)
    q = quant_softmax(x, 0, scale=1 / 256, zero_point=-128, dtype=I8, temperature=temperature)
    assert_exact(q, x, 0, 1.0 / temperature, 1 / 256, -128, -128, 127, I8)


@pytest.mark.parametrize("xdtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("prob_dtype", ["same", None, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_half_inputs(xdtype, prob_dtype, temperature):
    """fp16 / bf16 logits: with prob_dtype == x.dtype the op is torch's own ``quantize(softmax(x_half))``;
    other prob_dtypes round an fp32 softmax."""
    prob_dtype = xdtype if prob_dtype == "same" else prob_dtype
    x = _randn(4, 3000, dtype=xdtype, seed=7)
    for scale, zp, dtype in ((1 / 255, 0, U8), (1 / 256, -128, I8), (0.001, 0, U8)):
        qmin, qmax = _full_range(dtype)
        q = quant_softmax(x, scale=scale, zero_point=zp, dtype=dtype, temperature=temperature, prob_dtype=prob_dtype)
        assert_exact(q, x, -1, 1.0 / temperature, scale, zp, qmin, qmax, dtype, prob_dtype)


def test_half_prob_dtype_is_atens_half_softmax():
    """prob_dtype == x.dtype (fp16) reproduces ATen's fp16 softmax, which rounds a few entries
    differently from an fp32 softmax cast to fp16: the op follows the model's own spelling. The scale
    puts a ``k + 0.5`` boundary between the two roundings of such an entry."""
    x = _randn(64, 1000, dtype=torch.float16, seed=0)
    aten = torch.softmax(x, -1)
    cast = torch.softmax(x.float(), -1).half()
    differ = aten != cast
    qpt = torch.ops.quantized_decomposed.quantize_per_tensor
    if differ.any():
        scale = (aten[differ][0].item() + cast[differ][0].item()) / 2 / 200.5
        ref = qpt(aten, scale, 0, 0, 255, U8)
        assert not torch.equal(ref, qpt(cast, scale, 0, 0, 255, U8))
    else:
        # ATen's fp16 softmax is the fp32 one rounded on some CPUs (AMD here): nothing to tell apart, the op
        # must still give ATen's codes
        scale = 1 / 255
        ref = qpt(aten, scale, 0, 0, 255, U8)
    assert torch.equal(quant_softmax(x, scale=scale, prob_dtype=torch.float16), ref)
    # with an fp32 prob_dtype the probabilities are those of an fp32 softmax
    assert torch.equal(quant_softmax(x, scale=scale, prob_dtype=torch.float32),
                       qpt(torch.softmax(x.float(), -1), scale, 0, 0, 255, U8))


@pytest.mark.parametrize("prob_dtype", [None, torch.float32, torch.float16])
def test_fp64(prob_dtype):
    """fp64 logits: fp64 math (without prob_dtype), or quantize_per_tensor of the rounded probabilities."""
    x = _randn(3, 500, dtype=torch.float64, seed=5)
    q = quant_softmax(x, scale=1 / 255, temperature=0.9, prob_dtype=prob_dtype)
    assert_exact(q, x, -1, 1 / 0.9, 1 / 255, 0, 0, 255, U8, prob_dtype)


def test_masks():
    """-inf entries (attention masks): probability 0, code zero_point; the rest as torch."""
    x = _randn(8, 257, seed=11)
    g = torch.Generator().manual_seed(1)
    x[torch.rand(x.shape, generator=g) < 0.6] = -INF
    x[0, :-1] = -INF  # a single surviving entry: probability 1
    causal = torch.triu(torch.full((16, 16), -INF), 1) + _randn(16, 16, seed=2)
    for t in (x, causal):
        for zp, dtype in ((0, U8), (-128, I8), (5, U8)):
            qmin, qmax = _full_range(dtype)
            q = quant_softmax(t, scale=1 / 255, zero_point=zp, dtype=dtype)
            assert_exact(q, t, -1, 1.0, 1 / 255, zp, qmin, qmax, dtype)
            assert (q[torch.isneginf(t)] == zp).all()
    assert quant_softmax(x, scale=1 / 255)[0, -1] == 255


@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16, torch.float64])
def test_special_rows(xdtype):
    """Rows whose probabilities are NaN (a NaN or +inf logit, or all -inf) give zero_point."""
    x = _randn(6, 40, seed=4).to(xdtype)
    x[1] = -INF
    x[2, 5] = NAN
    x[3, 0] = INF
    x[4, :] = NAN
    x[5, 3:] = -INF
    for zp, dtype in ((0, U8), (-128, I8), (17, U8), (-5, I8)):
        qmin, qmax = _full_range(dtype)
        q = quant_softmax(x, scale=1 / 255, zero_point=zp, dtype=dtype)
        assert (q[1:5] == zp).all()
        assert_exact(q, x, -1, 1.0, 1 / 255, zp, qmin, qmax, dtype)
        assert torch.equal(quant_softmax_decomposed(x, -1, 1.0, 1 / 255, zp, qmin, qmax, dtype), q)
    # dim 0: each column is a row of the softmax; the NaN ones are the columns with a NaN or all -inf
    q = quant_softmax(x, 0, scale=1 / 255, zero_point=9)
    assert_exact(q, x, 0, 1.0, 1 / 255, 9, 0, 255, U8)


def test_empty_and_scalar():
    for shape, dim in (((0,), 0), ((0, 5), -1), ((3, 0), -1), ((3, 0), 0), ((2, 0, 4), 1)):
        x = torch.empty(shape)
        q = quant_softmax(x, dim, scale=0.1)
        assert q.shape == x.shape and q.dtype == U8 and q.is_contiguous()
        assert q.stride() == torch.empty(shape, dtype=U8).stride()
    for v, code in ((1.5, 255), (-INF, 0), (NAN, 0)):
        q = quant_softmax(torch.tensor(v), scale=1 / 255)
        assert q.shape == () and q.dtype == U8 and q.item() == code
    q = quant_softmax(torch.tensor(2.0), 0, scale=1 / 256, zero_point=-128, dtype=I8)
    assert q.item() == 127


LAYOUTS = {
    "permute": lambda b: b.permute(2, 0, 1),
    "transpose": lambda b: b.transpose(0, 2),
    "slice": lambda b: b[:, ::2, 1::3],
    "offset": lambda b: b[1:, 2:, 3:],
    "expand": lambda b: b[:1, :, :1].expand(3, 6, 4),
    "size1": lambda b: b[:, :1, :],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_and_dims(layout):
    x = LAYOUTS[layout](_randn(4, 6, 20, seed=9))
    for dim in range(-x.dim(), x.dim()):
        q = quant_softmax(x, dim, scale=1 / 255, zero_point=2)
        assert q.is_contiguous() and q.stride() == torch.empty(x.shape, dtype=U8).stride()
        assert_exact(q, x, dim, 1.0, 1 / 255, 2, 0, 255, U8)
        assert torch.equal(q, quant_softmax(x.contiguous(), dim, scale=1 / 255, zero_point=2))


def test_requires_grad_input():
    """No autograd (integer output), but a tensor that requires grad is accepted."""
    x = _randn(3, 10).requires_grad_()
    q = quant_softmax(x, scale=1 / 255)
    assert not q.requires_grad and q.dtype == U8
    assert_exact(q, x.detach(), -1, 1.0, 1 / 255, 0, 0, 255, U8)


def test_dequantized_rows():
    """(q - zero_point) * scale is within scale / 2 of the probability, except where clamped."""
    x = _randn(16, 700, seed=13, scale=4.0)
    y = torch.softmax(x, -1).double()
    for scale, zp, dtype, bits in ((1 / 255, 0, U8, None), (1 / 256, -128, I8, None), (1 / 15, 0, U8, 4),
                                   (0.02, -8, I8, 4)):
        qmin, qmax = _full_range(dtype, bits)
        q = quant_softmax(x, scale=scale, zero_point=zp, dtype=dtype, bits=bits)
        deq = (q.double() - zp) * scale
        inside = (q.int() > qmin) & (q.int() < qmax)
        err = (deq - y).abs()
        assert (err[inside] <= scale / 2 * (1 + 1e-6)).all()
        # clamped at quant_max: the probability is at least half a step above the top level
        top = q.int() == qmax
        assert (y[top] >= (qmax - zp - 0.5) * scale * (1 - 1e-6)).all()
        assert (q.int() >= zp).all()  # probabilities are >= 0
        # the row sum of the dequantized probabilities is biased low (Pandey et al., 2023) but
        # within n * scale / 2 of 1
        assert ((deq.sum(-1) - 1).abs() <= x.shape[-1] * scale / 2 + 1e-9).all()


# --------------------------------------------------------------------------- errors

ERRORS = [
    (dict(dtype=torch.int16), "dtype"),
    (dict(dtype=torch.float32), "dtype"),
    (dict(bits=1), "bits"),
    (dict(bits=9), "bits"),
    (dict(bits=0, dtype=I8), "bits"),
    (dict(quant_min=-1), "quant range"),
    (dict(quant_max=256), "quant range"),
    (dict(dtype=I8, quant_min=-129), "quant range"),
    (dict(dtype=I8, quant_max=128), "quant range"),
    (dict(quant_min=5, quant_max=5, zero_point=5), "quant range"),
    (dict(quant_min=10, quant_max=3), "quant range"),
    (dict(zero_point=-1), "zero_point"),
    (dict(zero_point=256), "zero_point"),
    (dict(zero_point=-128), "zero_point"),
    (dict(dtype=I8, zero_point=128), "zero_point"),
    (dict(bits=4, zero_point=16), "zero_point"),
    (dict(dtype=I8, bits=4, zero_point=-9), "zero_point"),
    (dict(quant_min=10, zero_point=5), "zero_point"),
    (dict(scale=0.0), "scale"),
    (dict(scale=-0.1), "scale"),
    (dict(scale=INF), "scale"),
    (dict(scale=NAN), "scale"),
    (dict(scale=1e-45), "scale"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=INF), "temperature"),
    (dict(temperature=NAN), "temperature"),
    (dict(temperature=1e-320), "temperature"),
    (dict(prob_dtype=torch.int32), "prob_dtype"),
]


@pytest.mark.parametrize("case", range(len(ERRORS)))
def test_value_errors(case):
    kw, match = ERRORS[case]
    kw = dict(dict(scale=1 / 255), **kw)
    with pytest.raises(ValueError, match=match):
        quant_softmax(_randn(2, 5), **kw)


def test_value_errors_x_and_dim():
    x = _randn(2, 5)
    for bad in (x.long(), x.int(), x > 0, torch.zeros(3, dtype=U8)):
        with pytest.raises(ValueError, match="floating-point"):
            quant_softmax(bad, scale=0.1)
    for dim in (2, -3, 5):
        with pytest.raises(ValueError, match="dim"):
            quant_softmax(x, dim, scale=0.1)
    for dim in (1, -2):
        with pytest.raises(ValueError, match="dim"):
            quant_softmax(torch.tensor(1.0), dim, scale=0.1)


def test_type_errors():
    x = _randn(2, 5)
    with pytest.raises(TypeError):
        quant_softmax(x.tolist(), scale=0.1)
    for kw in (dict(bits=4.0), dict(zero_point=1.0), dict(quant_min=0.0), dict(zero_point=True),
               dict(scale="0.1"), dict(scale=True), dict(temperature=None)):
        with pytest.raises(TypeError):
            quant_softmax(x, **dict(dict(scale=0.1), **kw))
    with pytest.raises(TypeError):
        quant_softmax(x, 1.0, scale=0.1)


# --------------------------------------------------------------------------- op registration

def _opcheck_cases():
    return {
        "fp32": (_randn(3, 17), 1, 1.0, 1 / 255, 0, 0, 255, U8, None),
        "int8_dim0": (_randn(5, 4), 0, 0.5, 1 / 256, -128, -128, 127, I8, None),
        "fp16_prob": (_randn(2, 3, 9, dtype=torch.float16), 2, 1.0, 0.01, 3, 0, 15, U8, torch.float16),
        "bf16": (_randn(4, 6, dtype=torch.bfloat16), 1, 1.3, 0.1, -2, -8, 7, I8, torch.float32),
        "fp64": (_randn(3, 8, dtype=torch.float64), 1, 1.0, 1 / 255, 0, 0, 255, U8, None),
        "permuted": (_randn(4, 6, 5).permute(2, 0, 1), 1, 1.0, 1 / 255, 0, 0, 255, U8, None),
        "size1": (_randn(4, 6)[:, :1], 0, 1.0, 1 / 255, 0, 0, 255, U8, None),
        "empty": (torch.empty(0, 7), 1, 1.0, 1 / 255, 0, 0, 255, U8, None),
        "scalar": (torch.tensor(0.3), 0, 1.0, 1 / 255, 0, 0, 255, U8, None),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    torch.library.opcheck(torch.ops.smx.quant_softmax.default, _opcheck_cases()[case])


def test_schema_and_export():
    schema = str(torch.ops.smx.quant_softmax.default._schema)
    assert schema.startswith("smx::quant_softmax(Tensor x, SymInt dim, float logit_scale, float scale, "
                             "SymInt zero_point, SymInt quant_min, SymInt quant_max, ScalarType dtype, "
                             "ScalarType? prob_dtype=None) -> Tensor")
    import smxcompile

    assert smxcompile.quant_softmax is quant_softmax


def test_fake_matches_real_layout():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = _randn(4, 6, 5).permute(2, 0, 1)[:, :, :1]
    real = torch.ops.smx.quant_softmax(x, 0, 1.0, 0.1, 0, 0, 255, U8)
    with FakeTensorMode() as mode:
        fake = torch.ops.smx.quant_softmax(mode.from_tensor(x), 0, 1.0, 0.1, 0, 0, 255, U8)
    assert fake.shape == real.shape and fake.stride() == real.stride() and fake.dtype == real.dtype


# --------------------------------------------------------------------------- torch.compile (default Inductor)


def test_compile_public_function():
    """The public function compiles in one graph; its codes equal eager's up to rounding ties."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: quant_softmax(x, 1, scale=1 / 256, zero_point=-128, dtype=I8, temperature=0.8),
                       fullgraph=True)
    for seed in range(3):
        x = _randn(6, 500, 3, seed=seed)
        q = fn(x)
        ref = quant_softmax(x, 1, scale=1 / 256, zero_point=-128, dtype=I8, temperature=0.8)
        assert_codes(q, ref, _unstable(x, 1, 1 / 0.8, 1 / 256, -128, -128, 127))


def test_compile_decomposed_fuses():
    """What a graph pass emits on CPU: Inductor compiles it into one fused kernel that stores only the
    codes (no float buffer of x's size), equal to eager up to rounding ties; NaN rows give zero_point."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fn = torch.compile(quant_softmax_decomposed, fullgraph=True)
    x = _randn(16, 1000, seed=21)
    x[3] = NAN
    x[4] = -INF
    x[5, ::2] = -INF
    args = (-1, 0.7, 1 / 255, 0, 0, 255, U8)
    q, code = run_and_get_code(fn, x, *args)
    kernels = set(re.findall(r"\b(cpp_fused_\w+)\s*=", " ".join(code)))
    assert len(kernels) == 1, kernels
    full = [ln for ln in "\n".join(code).splitlines() if "empty_strided" in ln and "(16, 1000)" in ln]
    assert full and all("torch.uint8" in ln for ln in full), full
    ref = quant_softmax(x, scale=1 / 255, temperature=1 / 0.7)
    assert (q[3:5] == 0).all()
    assert_codes(q, ref, _unstable(x, -1, 0.7, 1 / 255, 0, 0, 255))


def test_compile_decomposed_half_dim0():
    torch._dynamo.reset()
    fn = torch.compile(quant_softmax_decomposed, fullgraph=True)
    x = _randn(300, 8, dtype=torch.float16, seed=5)
    args = (0, 1.0, 1 / 256, -128, -128, 127, I8, torch.float16)
    q = fn(x, *args)
    ref = quant_softmax(x, 0, scale=1 / 256, zero_point=-128, dtype=I8, prob_dtype=torch.float16)
    assert_codes(q, ref, _unstable(x, 0, 1.0, 1 / 256, -128, -128, 127, torch.float16))

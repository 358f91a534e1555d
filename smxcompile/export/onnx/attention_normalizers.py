"""ONNX forms of ``smx::attention``'s normalizers, row by row over the scores (onnxscript ops), for
:mod:`.attention`'s decomposition of the op.

Each form takes the scaled (and soft-capped, mask-added) scores ``s`` (B, Hq, L, S), ``keep`` (bool,
broadcastable to ``s``; None: every key), ``n`` the number of keys per row (``(B, Hq, L, 1)``, ``(L, 1)`` or
``(1, 1)``) and ``param`` the normalizer's parameter per (B, Hq) as (B, Hq, 1, 1) or None, in the math dtype
(fp32, fp64 for fp64), and returns the weights (B, Hq, L, S): masked keys exactly 0, as the reference functions
of :data:`smxcompile.kernels.attention.NORMALIZERS`.

The normalizers: softmax (Vaswani et al. 2017, "Attention Is All You Need"), softmax1 (Miller 2023,
"Attention Is Off By One"), sigmoid (Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid
Self-Attention"), relu (Wortsman et al. 2023, "Replacing softmax with ReLU in Vision Transformers"), softpick
(Zuhri, Fuadi & Aji 2025, "Softpick: No Attention Sink, No Massive Activations with Rectified Softmax"), ssmax
(Nakanishi 2025, "Scalable-Softmax Is Superior for Attention"), softplus (Gao & Spratling 2025, "Softplus
Attention with Re-weighting Boosts Length Extrapolation in Large Language Models"), sparsemax (Martins &
Astudillo 2016, "From Softmax to Sparsemax") and 1.5-entmax (Peters, Niculae & Martins 2019, "Sparse
Sequence-to-Sequence Models") by their exact sort-based thresholds, the sort a full-length ``TopK`` (ONNX has
no Sort op) and the prefix sums ``CumSum``. ONNX has no ``expm1`` / ``log1p``: softpick's ``expm1`` and
softplus's ``log1p`` use Kahan's forms (``expm1(x) = (u - 1) x / log u``, ``u = exp x``;
``log1p(y) = log(u) y / (u - 1)``, ``u = 1 + y``), accurate to a few ulps where ``exp(x) - 1`` loses every
digit.

Source: the reference functions in :mod:`smxcompile.kernels.attention` (peer file), which these follow op for op.
"""

from __future__ import annotations

NEG_INF = float("-inf")


def normalizer_forms(op, const, ints, axes_last, scalar) -> dict:
    """``{normalizer name: form(s, keep, n, param)}`` built with :mod:`.attention`'s builders.

    Args:
        op: the onnxscript opset (``onnxscript.opset18``). const: ``const(value, like)``, a 0-d constant of
            ``like``'s (math) dtype. ints: ``ints(*v)``, a 1-D int64 constant. axes_last: the axes ``[-1]``.
            scalar: a 1-element 1-D tensor squeezed to 0-d.

    Raises:
        ImportError: onnx not installed.
    """
    import onnx

    def keep_where(t, keep, fill: float):
        return t if keep is None else op.Where(keep, t, const(fill, t))

    def row_max(z):
        """Row max of z (masked -inf), 0 where it is not finite (``_row_max``)."""
        m = op.ReduceMax(z, axes_last(), keepdims=1)
        finite = op.Not(op.Or(op.IsInf(m), op.IsNaN(m)))
        return op.Where(finite, m, const(0.0, m))

    def row_sum(x):
        return op.ReduceSum(x, axes_last(), keepdims=1)

    def normalize(e):
        d = row_sum(e)
        return op.Div(e, op.Where(op.Equal(d, const(0.0, d)), const(1.0, d), d))

    def expm1(x):
        """``exp(x) - 1`` for x <= 0 without cancellation (Kahan): ``(u - 1) * x / log(u)``, u = exp(x)."""
        u = op.Exp(x)
        um1 = op.Sub(u, const(1.0, x))
        r = op.Div(op.Mul(um1, x), op.Log(u))
        r = op.Where(op.Equal(u, const(1.0, x)), x, r)
        return op.Where(op.Equal(u, const(0.0, x)), const(-1.0, x), r)

    def softplus(x):
        """``F.softplus`` (beta 1, threshold 20): x above 20, else ``log1p(exp(x))`` with Kahan's log1p."""
        e = op.Exp(op.Neg(op.Abs(x)))               # in (0, 1]
        u = op.Add(e, const(1.0, x))
        log1p = op.Where(op.Equal(u, const(1.0, x)), e, op.Div(op.Mul(op.Log(u), e), op.Sub(u, const(1.0, x))))
        sp = op.Add(op.Relu(x), log1p)
        return op.Where(op.Greater(x, const(20.0, x)), x, sp)

    def nz_softmax(s, keep, n, param):
        z = keep_where(s, keep, NEG_INF)
        return normalize(op.Exp(op.Sub(z, row_max(z))))

    def nz_softmax1(s, keep, n, param):
        z = keep_where(s, keep, NEG_INF)
        m = op.Max(row_max(z), const(0.0, s))
        e = op.Exp(op.Sub(z, m))
        return op.Div(e, op.Add(op.Exp(op.Neg(m)), row_sum(e)))

    def nz_sigmoid(s, keep, n, param):
        b = op.Neg(op.Log(n)) if param is None else param
        return keep_where(op.Sigmoid(op.Add(keep_where(s, keep, 0.0), b)), keep, 0.0)

    def nz_relu(s, keep, n, param):
        c = op.Reciprocal(n) if param is None else param
        return keep_where(op.Mul(op.Relu(keep_where(s, keep, 0.0)), c), keep, 0.0)

    def nz_softpick(s, keep, n, param):
        eps = const(1e-6, s) if param is None else param
        z = keep_where(s, keep, 0.0)
        m = op.Max(row_max(keep_where(s, keep, NEG_INF)), const(0.0, s))
        zero = const(0.0, s)
        zp, zn = op.Max(z, zero), op.Min(z, zero)
        u = op.Where(op.Greater(z, zero), op.Neg(op.Mul(op.Exp(op.Sub(zp, m)), expm1(op.Neg(zp)))),
                     op.Mul(op.Exp(op.Neg(m)), expm1(zn)))
        u = keep_where(u, keep, 0.0)
        den = op.Add(row_sum(op.Abs(u)), op.Mul(eps, op.Exp(op.Neg(m))))
        return op.Div(op.Relu(u), op.Where(op.Equal(den, zero), const(1.0, s), den))

    def nz_ssmax(s, keep, n, param):
        hi = row_max(keep_where(s, keep, NEG_INF))
        if param is None:
            p, m = const(1.0, s), hi
        else:
            p = param
            lo = op.Neg(row_max(keep_where(op.Neg(s), keep, NEG_INF)))
            m = op.Where(op.GreaterOrEqual(p, const(0.0, s)), hi, lo)
        x = keep_where(op.Sub(s, m), keep, 0.0)
        return nz_softmax(op.Mul(x, op.Mul(p, op.Log(n))), keep, n, None)

    def nz_softplus(s, keep, n, param):
        c = op.Log(op.Max(n, const(2.0, n))) if param is None else param
        return normalize(keep_where(softplus(op.Mul(keep_where(s, keep, 0.0), c)), keep, 0.0))

    def sorted_keep(s, keep, half: bool):
        z = keep_where(s, keep, NEG_INF)
        if half:
            z = op.Mul(z, const(0.5, s))
        m = row_max(z)
        x = op.Sub(z, m)
        xs, _ = op.TopK(x, op.Shape(x, start=-1), axis=-1, largest=1, sorted=1)   # a full descending sort
        valid = op.Greater(xs, const(NEG_INF, s))
        xf = keep_where(s, keep, 0.0)
        if half:
            xf = op.Mul(xf, const(0.5, s))
        return op.Sub(xf, m), op.Where(valid, xs, const(0.0, s)), valid

    def ranks_1_to_S(xs):
        S = scalar(op.Shape(xs, start=-1))
        one = scalar(ints(1))
        return op.CastLike(op.Range(one, op.Add(S, one), one), xs)

    def gather_at(t, support):
        """``t.gather(-1, support - 1)`` with support a float count >= 1."""
        idx = op.Cast(op.Sub(support, const(1.0, support)), to=onnx.TensorProto.INT64)
        return op.GatherElements(t, idx, axis=-1)

    def count(cond, like):
        return op.Max(row_sum(op.CastLike(cond, like)), const(1.0, like))

    def nz_sparsemax(s, keep, n, param):
        xf, xs, valid = sorted_keep(s, keep, half=False)
        cs = op.CumSum(xs, ints(-1))
        k = ranks_1_to_S(xs)
        support = count(op.And(valid, op.Greater(op.Add(const(1.0, s), op.Mul(k, xs)), cs)), s)
        tau = op.Div(op.Sub(gather_at(cs, support), const(1.0, s)), support)
        return keep_where(op.Relu(op.Sub(xf, tau)), keep, 0.0)

    def nz_entmax15(s, keep, n, param):
        xf, xs, valid = sorted_keep(s, keep, half=True)
        k = ranks_1_to_S(xs)
        cs, cs2 = op.CumSum(xs, ints(-1)), op.CumSum(op.Mul(xs, xs), ints(-1))
        mean, mean_sq = op.Div(cs, k), op.Div(cs2, k)
        one, zero = const(1.0, s), const(0.0, s)
        delta = op.Div(op.Sub(one, op.Mul(k, op.Sub(mean_sq, op.Mul(mean, mean)))), k)
        tau_k = op.Sub(mean, op.Sqrt(op.Max(delta, zero)))
        support = count(op.And(valid, op.LessOrEqual(tau_k, xs)), s)
        mean = op.Div(gather_at(cs, support), support)
        mean_sq = op.Div(gather_at(cs2, support), support)
        tau = op.Sub(mean, op.Sqrt(op.Max(op.Div(op.Sub(one, op.Mul(support, op.Sub(mean_sq, op.Mul(mean, mean)))),
                                                  support), zero)))
        y = op.Relu(op.Sub(xf, tau))
        return keep_where(op.Mul(y, y), keep, 0.0)

    return {"softmax": nz_softmax, "softmax1": nz_softmax1, "sigmoid": nz_sigmoid, "relu": nz_relu,
            "softpick": nz_softpick, "ssmax": nz_ssmax, "softplus": nz_softplus,
            "sparsemax": nz_sparsemax, "entmax15": nz_entmax15}


__all__ = ["NEG_INF", "normalizer_forms"]

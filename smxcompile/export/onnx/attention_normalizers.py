"""ONNX forms of ``smx::attention``'s normalizers, row by row over the scores (onnxscript ops), op for op as the
reference functions of :data:`smxcompile.kernels.attention.NORMALIZERS`.

Each form takes the scaled (soft-capped, mask-added) scores ``s`` (B, Hq, L, S), ``keep`` (bool, broadcastable
to ``s``; None: every key), ``n`` the keys per row ((B, Hq, L, 1), (L, 1) or (1, 1)) and ``param`` per (B, Hq)
as (B, Hq, 1, 1) or None, in the math dtype, and returns the weights (B, Hq, L, S), masked keys exactly 0.

Each form follows its entry's paper (``NORMALIZERS[name].paper``); sparsemax and 1.5-entmax by their sort-based
thresholds (``TopK`` as the sort). ``expm1`` / ``log1p`` use Kahan's forms (ONNX has neither).
"""

from __future__ import annotations

from ...kernels.attention.reference import NORMALIZERS

NEG_INF = float("-inf")

#: The normalizers with an ONNX form (the keys of :func:`normalizer_forms`): every name of the registry.
NORMALIZER_NAMES = tuple(NORMALIZERS)


class NormalizerForms:
    """The forms as methods named after their normalizer, one per key of :data:`NORMALIZERS`, built with
    :mod:`.attention`'s builders (see :func:`normalizer_forms`)."""

    def __init__(self, op, const, ints, axes_last, scalar):
        import onnx

        self.op, self.const, self.ints, self.axes_last, self.scalar = op, const, ints, axes_last, scalar
        self.int64 = onnx.TensorProto.INT64

    # ---------------------------------------------------------------- row helpers

    def keep_where(self, t, keep, fill: float):
        return t if keep is None else self.op.Where(keep, t, self.const(fill, t))

    def row_max(self, z):
        """Row max of z (masked -inf), 0 where it is not finite (the reference's ``_row_max``)."""
        op = self.op
        m = op.ReduceMax(z, self.axes_last(), keepdims=1)
        finite = op.Not(op.Or(op.IsInf(m), op.IsNaN(m)))
        return op.Where(finite, m, self.const(0.0, m))

    def row_sum(self, x):
        return self.op.ReduceSum(x, self.axes_last(), keepdims=1)

    def normalize(self, e):
        total = self.row_sum(e)
        return self.op.Div(e, self.op.Where(self.op.Equal(total, self.const(0.0, total)), self.const(1.0, total),
                                            total))

    def expm1(self, x):
        """``exp(x) - 1`` for x <= 0 without cancellation (Kahan): ``(u - 1) * x / log(u)``, u = exp(x)."""
        op, const = self.op, self.const
        u = op.Exp(x)
        kahan = op.Div(op.Mul(op.Sub(u, const(1.0, x)), x), op.Log(u))
        kahan = op.Where(op.Equal(u, const(1.0, x)), x, kahan)
        return op.Where(op.Equal(u, const(0.0, x)), const(-1.0, x), kahan)

    def torch_softplus(self, x):
        """``F.softplus`` (beta 1, threshold 20): x above 20, else ``log1p(exp(x))`` with Kahan's log1p."""
        op, const = self.op, self.const
        e = op.Exp(op.Neg(op.Abs(x)))               # in (0, 1]
        u = op.Add(e, const(1.0, x))
        log1p = op.Where(op.Equal(u, const(1.0, x)), e, op.Div(op.Mul(op.Log(u), e), op.Sub(u, const(1.0, x))))
        return op.Where(op.Greater(x, const(20.0, x)), x, op.Add(op.Relu(x), log1p))

    def sorted_keep(self, s, keep, half: bool):
        """(the kept scores minus the row max, the row sorted descending with masked keys 0, which are valid)."""
        op, const = self.op, self.const
        z = self.keep_where(s, keep, NEG_INF)
        if half:
            z = op.Mul(z, const(0.5, s))
        m = self.row_max(z)
        x = op.Sub(z, m)
        xs, _ = op.TopK(x, op.Shape(x, start=-1), axis=-1, largest=1, sorted=1)   # a full descending sort
        valid = op.Greater(xs, const(NEG_INF, s))
        kept = self.keep_where(s, keep, 0.0)
        if half:
            kept = op.Mul(kept, const(0.5, s))
        return op.Sub(kept, m), op.Where(valid, xs, const(0.0, s)), valid

    def ranks(self, xs):
        """1, 2, ..., S in ``xs``'s dtype."""
        op = self.op
        length = self.scalar(op.Shape(xs, start=-1))
        one = self.scalar(self.ints(1))
        return op.CastLike(op.Range(one, op.Add(length, one), one), xs)

    def gather_at(self, t, support):
        """``t.gather(-1, support - 1)`` with support a float count >= 1."""
        index = self.op.Cast(self.op.Sub(support, self.const(1.0, support)), to=self.int64)
        return self.op.GatherElements(t, index, axis=-1)

    def count(self, cond, like):
        return self.op.Max(self.row_sum(self.op.CastLike(cond, like)), self.const(1.0, like))

    # ---------------------------------------------------------------- the forms

    def softmax(self, s, keep, n, param):
        z = self.keep_where(s, keep, NEG_INF)
        return self.normalize(self.op.Exp(self.op.Sub(z, self.row_max(z))))

    def softmax1(self, s, keep, n, param):
        op = self.op
        z = self.keep_where(s, keep, NEG_INF)
        m = op.Max(self.row_max(z), self.const(0.0, s))
        e = op.Exp(op.Sub(z, m))
        return op.Div(e, op.Add(op.Exp(op.Neg(m)), self.row_sum(e)))

    def sigmoid(self, s, keep, n, param):
        op = self.op
        bias = op.Neg(op.Log(n)) if param is None else param
        return self.keep_where(op.Sigmoid(op.Add(self.keep_where(s, keep, 0.0), bias)), keep, 0.0)

    def relu(self, s, keep, n, param):
        op = self.op
        factor = op.Reciprocal(n) if param is None else param
        return self.keep_where(op.Mul(op.Relu(self.keep_where(s, keep, 0.0)), factor), keep, 0.0)

    def softpick(self, s, keep, n, param):
        op, const = self.op, self.const
        eps = const(1e-6, s) if param is None else param
        z = self.keep_where(s, keep, 0.0)
        m = op.Max(self.row_max(self.keep_where(s, keep, NEG_INF)), const(0.0, s))
        zero = const(0.0, s)
        positive, negative = op.Max(z, zero), op.Min(z, zero)
        u = op.Where(op.Greater(z, zero), op.Neg(op.Mul(op.Exp(op.Sub(positive, m)), self.expm1(op.Neg(positive)))),
                     op.Mul(op.Exp(op.Neg(m)), self.expm1(negative)))
        u = self.keep_where(u, keep, 0.0)
        denominator = op.Add(self.row_sum(op.Abs(u)), op.Mul(eps, op.Exp(op.Neg(m))))
        return op.Div(op.Relu(u), op.Where(op.Equal(denominator, zero), const(1.0, s), denominator))

    def ssmax(self, s, keep, n, param):
        op = self.op
        high = self.row_max(self.keep_where(s, keep, NEG_INF))
        if param is None:
            p, m = self.const(1.0, s), high
        else:
            p = param
            low = op.Neg(self.row_max(self.keep_where(op.Neg(s), keep, NEG_INF)))
            m = op.Where(op.GreaterOrEqual(p, self.const(0.0, s)), high, low)
        x = self.keep_where(op.Sub(s, m), keep, 0.0)
        return self.softmax(op.Mul(x, op.Mul(p, op.Log(n))), keep, n, None)

    def softplus(self, s, keep, n, param):
        op = self.op
        factor = op.Log(op.Max(n, self.const(2.0, n))) if param is None else param
        weights = self.torch_softplus(op.Mul(self.keep_where(s, keep, 0.0), factor))
        return self.normalize(self.keep_where(weights, keep, 0.0))

    def sparsemax(self, s, keep, n, param):
        op, const = self.op, self.const
        kept, xs, valid = self.sorted_keep(s, keep, half=False)
        cumsum = op.CumSum(xs, self.ints(-1))
        k = self.ranks(xs)
        support = self.count(op.And(valid, op.Greater(op.Add(const(1.0, s), op.Mul(k, xs)), cumsum)), s)
        tau = op.Div(op.Sub(self.gather_at(cumsum, support), const(1.0, s)), support)
        return self.keep_where(op.Relu(op.Sub(kept, tau)), keep, 0.0)

    def entmax15(self, s, keep, n, param):
        op = self.op
        kept, xs, valid = self.sorted_keep(s, keep, half=True)
        k = self.ranks(xs)
        cumsum, cumsum_sq = op.CumSum(xs, self.ints(-1)), op.CumSum(op.Mul(xs, xs), self.ints(-1))
        one, zero = self.const(1.0, s), self.const(0.0, s)

        def threshold(count, total, total_sq):
            mean, mean_sq = op.Div(total, count), op.Div(total_sq, count)
            delta = op.Div(op.Sub(one, op.Mul(count, op.Sub(mean_sq, op.Mul(mean, mean)))), count)
            return op.Sub(mean, op.Sqrt(op.Max(delta, zero)))

        support = self.count(op.And(valid, op.LessOrEqual(threshold(k, cumsum, cumsum_sq), xs)), s)
        tau = threshold(support, self.gather_at(cumsum, support), self.gather_at(cumsum_sq, support))
        y = op.Relu(op.Sub(kept, tau))
        return self.keep_where(op.Mul(y, y), keep, 0.0)


def normalizer_forms(op, const, ints, axes_last, scalar) -> dict:
    """``{normalizer name: form(s, keep, n, param)}`` built with :mod:`.attention`'s builders.

    Args:
        op: the onnxscript opset (``onnxscript.opset18``). const: ``const(value, like)``, a 0-d constant of
            ``like``'s (math) dtype. ints: ``ints(*v)``, a 1-D int64 constant. axes_last: the axes ``[-1]``.
            scalar: a 1-element 1-D tensor squeezed to 0-d.

    Raises:
        ImportError: onnx not installed.
    """
    forms = NormalizerForms(op, const, ints, axes_last, scalar)
    return {name: getattr(forms, name) for name in NORMALIZERS}


__all__ = ["NEG_INF", "NORMALIZER_NAMES", "NormalizerForms", "normalizer_forms"]

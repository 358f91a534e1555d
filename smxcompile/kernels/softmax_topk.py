"""``smx::softmax_topk``: the k largest softmax probabilities of each row, without the full probability vector.

For scores ``x`` and ``z = x * scale`` (``scale = 1 / temperature``) the op returns, along ``dim``::

    indices = topk(z, k).indices                       # == topk(softmax(z), k).indices
    values  = exp(z[indices] - lse(z))                 # == topk(softmax(z), k).values     (renormalize=False)
    values  = softmax(z[indices])                      # == topk(softmax(z)).values / sum  (renormalize=True)

using the identities of ALGORITHMS.md section 2 ("Facts"): softmax is monotone, so the top-k of the
probabilities are the top-k of the logits, and ``topk(softmax(x)).values == exp(topk(x).values - lse(x))``;
renormalizing them is the softmax of the k selected logits (``softmax(topk(x).values)``, the form
Mixtral-style MoE routers use), which needs no pass over the rest of the row at all.

Source: "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018), fused softmax + top-k:
one pass keeps the online ``(max, sum)`` pair and a running top-k; only k probabilities are written.

* CUDA: Triton kernels (:mod:`smxcompile.kernels.triton_softmax_topk`).
* CPU (and what the ``smx`` backend compiles on CPU, where Inductor generates the loops): two passes over
  the row and no write of its size. Pass 1 takes the maximum of each chunk of ``CHUNK`` columns; the k
  chunks with the largest maxima hold a top-k of the row (a chunk outside them has at least k larger
  elements elsewhere), so the top-k is taken over ``k * CHUNK`` candidates only. Pass 2 sums
  ``exp(z - max)``. Short rows (routers: 32-1024 experts) select with k rounds of a max over unique int64
  keys (value bits, then column), which is exact and avoids ATen's per-row top-k; rows of at most 16
  (8-16 experts) with k bubble passes of compare-exchanges between whole columns, elementwise over the
  rows; ``k == 1`` is a max.

Special values follow ``topk(softmax(x))`` in torch: a row with NaN or ``+inf``, or with every entry
``-inf``, has an all-NaN softmax, so its values are NaN (its indices stay valid, distinct columns);
``-inf`` entries have probability 0 and are picked last.

Ties: where logits are exactly equal, any of them may be picked (torch.topk does not specify the order
either; the Triton kernels and the short-row path pick the lowest column first). Where two different
logits round to the same probability in the output dtype, the larger logit is picked (the exact answer);
torch's ``topk(softmax(x))`` may pick either.
"""

from __future__ import annotations

import torch

from . import config

__all__ = ["softmax_topk", "softmax_topk_reference", "softmax_topk_decomposed"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Columns per chunk of the long-row path (measured best at 32K-256K columns, k <= 50; docs/PERFORMANCE.md).
CHUNK = 128
#: The long-row path runs when a row has at least this many columns and ``k * CHUNK * 4 <= n``.
CHUNKED_MIN_COLUMNS = 4096
#: The short-row path (k rounds of an int64-key max) runs for rows up to this many columns and k up to
#: ``KEY_ROUNDS_MAX_K``; beyond that a plain top-k of the logits is used.
KEY_ROUNDS_MAX_COLUMNS = 1024
KEY_ROUNDS_MAX_K = 8
#: Rows up to this many columns (8-16 experts) select with a compare-exchange network across columns.
NETWORK_MAX_COLUMNS = 16


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _sortable_keys(x: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys ordered like ``x`` along the last dim: value bits (NaN largest), then the lower column."""
    b = (x if x.dtype == torch.float32 else x.float()).view(torch.int32)
    o = torch.where(b < 0, b ^ 0x7FFFFFFF, b)           # order-preserving int32 of a float
    o = torch.where(x != x, torch.full_like(o, 0x7FFFFFFF), o)
    col = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    return (o.to(torch.int64) << 32) | (0xFFFFFFFF - col)


def _select_network(x: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k columns of short rows by k bubble passes of compare-exchanges between whole columns.

    Each step is elementwise over the rows (Inductor vectorizes it across rows, one loop for all of
    them), where ATen's top-k and reductions pay a per-row cost on rows of a few columns. A column
    moves forward only past a strictly smaller one (NaN counts as the largest), so exact ties keep
    the lower column first.
    """
    n = x.shape[-1]
    cols = list(x.unbind(-1))
    idx = [torch.full_like(cols[0], j, dtype=torch.int64) for j in range(n)]
    for r in range(k):
        for j in range(n - 1, r, -1):
            a, b = cols[j - 1], cols[j]
            swap = (b > a) | ((b != b) & (a == a))
            cols[j - 1], cols[j] = torch.where(swap, b, a), torch.where(swap, a, b)
            idx[j - 1], idx[j] = torch.where(swap, idx[j], idx[j - 1]), torch.where(swap, idx[j - 1], idx[j])
    return torch.stack(idx[:k], -1)


def _select(x: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the k largest entries of each row of ``x`` (R, n), largest first (int64, (R, k))."""
    n = x.shape[-1]
    static = isinstance(n, int) and isinstance(k, int)
    if k == 1:
        return torch.max(x, -1, keepdim=True).indices
    if static and n <= NETWORK_MAX_COLUMNS and k <= KEY_ROUNDS_MAX_K:
        return _select_network(x, k)
    if static and x.dtype != torch.float64 and n <= KEY_ROUNDS_MAX_COLUMNS and k <= KEY_ROUNDS_MAX_K:
        keys = _sortable_keys(x)
        low = torch.iinfo(torch.int64).min
        picked = []
        for _ in range(k):
            top = keys.amax(-1, keepdim=True)
            picked.append(top)
            keys = torch.where(keys == top, low, keys)
        return 0xFFFFFFFF - (torch.cat(picked, -1) & 0xFFFFFFFF)
    if static and n >= CHUNKED_MIN_COLUMNS and k * CHUNK * 4 <= n:
        rows = x.shape[0]
        c = n // CHUNK
        main = x[:, : c * CHUNK].reshape(rows, c, CHUNK)
        _, chunks = torch.topk(main.amax(-1), k, -1, sorted=False)
        chunks = torch.sort(chunks, -1).values                     # candidates in column order
        cand = torch.gather(main, 1, chunks[..., None].expand(rows, k, CHUNK)).reshape(rows, k * CHUNK)
        cols = (chunks[..., None] * CHUNK + torch.arange(CHUNK, device=x.device)).reshape(rows, k * CHUNK)
        if c * CHUNK < n:   # the tail chunk is always a candidate
            cand = torch.cat([cand, x[:, c * CHUNK:]], -1)
            tail = torch.arange(c * CHUNK, n, device=x.device).expand(rows, n - c * CHUNK)
            cols = torch.cat([cols, tail], -1)
        _, j = torch.topk(cand, k, -1)
        return torch.gather(cols, 1, j)
    return torch.topk(x, k, -1).indices


def softmax_topk_decomposed(x: torch.Tensor, k: int, dim: int = -1, scale: float = 1.0, renormalize: bool = False,
                            dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's math in torch ops: its CPU path, and what the ``smx`` backend puts in a CPU graph (Inductor
    compiles it into two passes over each row; autograd gives the backward).

    Args:
        x: scores, any shape, fp16/bf16/fp32/fp64. k: 0 <= k <= x.shape[dim]. dim: the normalized dim.
        scale: > 0, multiplies x. renormalize: see the module docstring. dtype: values' dtype (default x.dtype).

    Returns:
        ``(values, indices, logd)``: values ``dtype`` and indices int64 of ``x.shape`` with ``dim`` of size k;
        ``logd = log(sum(exp(z - max(z))))``, the log of the softmax normalizer relative to the row maximum
        (fp32, fp64 for fp64 x; the maximum is ``z`` at the first index, so ``lse = z[indices[0]] + logd``
        without the rounding of a large ``lse``), of ``x.shape`` without ``dim``; empty when ``renormalize``
        (not needed), 0 when k == 0.
    """
    out_dtype = dtype or x.dtype
    acc = _acc_dtype(x)
    xl = x.movedim(dim, -1)
    batch = xl.shape[:-1]
    n = xl.shape[-1]
    # (reshape(-1, 0) is ambiguous: rows of no columns need the row count spelled out)
    x2 = xl.reshape(-1, n) if n != 0 else xl.reshape(batch.numel(), 0)
    if k == 0 or x2.numel() == 0:
        values = x2[:, :k].to(out_dtype, copy=True)   # empty, but on x's autograd graph (as topk's values)
        idx = torch.zeros((x2.shape[0], k), dtype=torch.int64, device=x.device)
        logd = x2.new_zeros(x2.shape[0], dtype=acc) if not renormalize else x.new_empty(0, dtype=acc)
    else:
        idx = _select(x2, k)
        zs = torch.gather(x2, 1, idx).to(acc) * scale          # the k selected z, largest first
        top = zs[:, :1].detach()                              # the row max (NaN if the row has NaN)
        if renormalize:
            e = torch.exp(zs - top)
            values = (e / e.sum(-1, keepdim=True)).to(out_dtype)
            logd = x.new_empty(0, dtype=acc)
        else:
            d = torch.exp(x2.to(acc) * scale - top).sum(-1, keepdim=True)
            values = (torch.exp(zs - top) / d).to(out_dtype)
            logd = torch.log(d).squeeze(-1)
    values = values.reshape(*batch, k).movedim(-1, dim)
    idx = idx.reshape(*batch, k).movedim(-1, dim)
    if not renormalize:
        logd = logd.reshape(batch)
    return values, idx, logd


def softmax_topk_reference(x: torch.Tensor, k: int, dim: int = -1, scale: float = 1.0, renormalize: bool = False,
                           dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula the op replaces, in torch: ``topk(softmax(x * scale, dim), k, dim)`` (renormalized:
    divided by its sum), computed in fp32 (fp64 for fp64 input). Tests' oracle."""
    acc = _acc_dtype(x)
    p = torch.softmax(x.to(acc) * scale, dim)
    v, i = torch.topk(p, k, dim)
    if renormalize:
        v = v / v.sum(dim, keepdim=True)
    return v.to(dtype or x.dtype), i


#: Largest k of the Triton kernels (``triton_softmax_topk.MAX_K``); a larger k runs the torch path.
TRITON_MAX_K = 256


def _forward_impl(x, k, dim, scale, renormalize, dtype):
    if config.use_triton(x) and x.dim() > 0 and k <= TRITON_MAX_K:
        from .triton_softmax_topk import softmax_topk_forward

        xl = x.movedim(dim, -1)
        batch, n = xl.shape[:-1], xl.shape[-1]
        x2 = xl.reshape(batch.numel(), n)   # (not -1: ambiguous for rows of no columns)
        if x2.shape[-1] > 1 and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        v, i, logd = softmax_topk_forward(x2, k, scale=scale, renormalize=renormalize, out_dtype=dtype or x.dtype)
        v = v.reshape(*batch, k).movedim(-1, dim).contiguous()
        i = i.reshape(*batch, k).movedim(-1, dim).contiguous()
        logd = logd.reshape(batch) if not renormalize else logd.new_empty(0)
        return v, i, logd
    with torch.no_grad():
        v, i, logd = softmax_topk_decomposed(x, k, dim, scale, renormalize, dtype)
    return v.contiguous(), i.contiguous(), logd.contiguous()


def _backward_impl(grad_values, values, indices, x, logd, dim, scale, renormalize):
    """Gradient w.r.t. ``x`` (x.dtype): see :func:`softmax_topk` for the formula."""
    if config.use_triton(x) and x.dim() > 0 and values.shape[dim] <= TRITON_MAX_K:
        from .triton_softmax_topk import softmax_topk_backward

        xl = x.movedim(dim, -1)
        batch, n = xl.shape[:-1], xl.shape[-1]
        x2 = xl.reshape(batch.numel(), n)   # (not -1: ambiguous for rows of no columns, or k == 0)
        if x2.shape[-1] > 1 and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        kk = values.shape[dim]

        def rows(t):
            return t.movedim(dim, -1).reshape(batch.numel(), kk).contiguous()

        g = softmax_topk_backward(rows(grad_values), rows(values), rows(indices), x2, logd.reshape(-1),
                                  scale=scale, renormalize=renormalize, out_dtype=x.dtype)
        return g.reshape(*batch, n).movedim(-1, dim).contiguous()
    # The probabilities are recomputed from x in the accumulation dtype, relative to the row max: the
    # saved values may be rounded to a narrower ``dtype=`` (bf16 / fp16), and ``exp(z - lse)`` with an
    # fp32 lse loses about |lse| ulps (logits of ~1000: 1e-4 relative); torch's softmax backward has neither.
    acc = _acc_dtype(x)
    g = grad_values.to(acc)
    z = x.to(acc) * scale
    if x.shape[dim] == 0:
        return torch.zeros_like(x)
    if renormalize:
        v = torch.softmax(z.gather(dim, indices), dim)
        gv = g * v
        dz = torch.zeros_like(z).scatter_(dim, indices, gv - v * gv.sum(dim, keepdim=True))
    else:
        e = torch.exp(z - z.amax(dim, keepdim=True))
        p = e / e.sum(dim, keepdim=True)
        gv = g * p.gather(dim, indices)
        dz = (-p * gv.sum(dim, keepdim=True)).scatter_add_(dim, indices, gv)
    return (dz * scale).to(x.dtype).contiguous()


@torch.library.custom_op("smx::softmax_topk", mutates_args=())
def _softmax_topk_op(x: torch.Tensor, k: int, dim: int, scale: float, renormalize: bool,
                     dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(x, k, dim, scale, renormalize, dtype)


@_softmax_topk_op.register_fake
def _(x, k, dim, scale, renormalize, dtype):
    shape = list(x.shape)
    d = dim % x.dim()
    shape[d] = k
    lse_shape = [s for i, s in enumerate(x.shape) if i != d] if not renormalize else [0]
    return (x.new_empty(shape, dtype=dtype or x.dtype), x.new_empty(shape, dtype=torch.int64),
            x.new_empty(lse_shape, dtype=_acc_dtype(x)))


@torch.library.custom_op("smx::softmax_topk_backward", mutates_args=())
def _softmax_topk_backward_op(grad_values: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, x: torch.Tensor,
                              logd: torch.Tensor, dim: int, scale: float, renormalize: bool) -> torch.Tensor:
    return _backward_impl(grad_values, values, indices, x, logd, dim, scale, renormalize)


@_softmax_topk_backward_op.register_fake
def _(grad_values, values, indices, x, logd, dim, scale, renormalize):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, k, dim, scale, renormalize, dtype = inputs
    values, indices, logd = output
    ctx.dim = dim % x.dim()
    ctx.scale, ctx.renormalize = scale, renormalize
    ctx.save_for_backward(values, indices, x, logd)


def _backward(ctx, grad_values, grad_indices, grad_lse):
    values, indices, x, logd = ctx.saved_tensors
    if grad_values is None:
        return None, None, None, None, None, None
    gx = _softmax_topk_backward_op(grad_values, values, indices, x, logd, ctx.dim, ctx.scale, ctx.renormalize)
    return gx, None, None, None, None, None


_softmax_topk_op.register_autograd(_backward, setup_context=_setup_context)


def softmax_topk(x: torch.Tensor, k: int, dim: int = -1, *, renormalize: bool = False, temperature: float = 1.0,
                 dtype: torch.dtype | None = None):
    """The k largest probabilities of ``softmax(x / temperature, dim)`` and their indices, in one pass.

    Equals ``torch.topk(torch.softmax(x / temperature, dim), k, dim)`` (divided by the values' sum when
    ``renormalize``; then it also equals ``torch.softmax(torch.topk(x / temperature, k, dim).values, dim)``),
    without writing the probabilities of the whole row.

    Args:
        x: scores (logits), any shape with at least one dim, fp16/bf16/fp32/fp64, any strides.
        k: how many to keep, ``0 <= k <= x.shape[dim]``.
        dim: the normalized dim (negative counts from the end).
        renormalize: divide the k probabilities by their sum (MoE routers with ``norm_topk_prob``,
            top-k samplers).
        temperature: the logits are divided by it first; a finite number > 0.
        dtype: dtype of the values (default ``x.dtype``); the math is fp32 (fp64 for fp64 input).

    Returns:
        ``torch.return_types.topk(values, indices)``: values (``dtype``) and indices (int64), both of
        ``x.shape`` with ``dim`` of size k, largest first. The gradient reaches every logit (through the
        normalizer) when ``renormalize=False``, the k selected logits when ``renormalize=True``.
        Rows that contain NaN or ``+inf``, or only ``-inf``, give NaN values, as in torch.

    Raises:
        TypeError: ``x`` not a float tensor, ``k`` not an int, a non-float ``dtype``.
        ValueError: ``k`` out of range, ``temperature`` not finite and > 0, a 0-d ``x``.
        IndexError: ``dim`` out of range.

    Source: "Online normalizer calculation for softmax" (Milakov & Gimelshein, 2018), fused softmax + top-k;
    Triton kernels on CUDA, two passes per row without the full probability tensor on CPU.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"softmax_topk needs floating-point scores, got {x.dtype}")
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    if x.dim() == 0:
        raise ValueError("softmax_topk needs a tensor with at least one dim, got a 0-d tensor")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"Dimension out of range (expected to be in range of [{-x.dim()}, {x.dim() - 1}], but got {dim})")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {k!r}")
    n = x.shape[dim]
    if not 0 <= k <= n:
        raise ValueError(f"k={k} out of range: dim {dim} has {n} entries (0 <= k <= {n})")
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not temperature == temperature or temperature <= 0 or temperature == float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    values, indices, _ = _softmax_topk_op(x, k, dim % x.dim(), 1.0 / float(temperature), bool(renormalize), dtype)
    return torch.return_types.topk((values, indices))

"""Softmax + top-k in plain torch: :func:`softmax_topk_decomposed` (the op's CPU path, and what the ``smx``
backend puts in a CPU graph) with its row selections (docs/DESIGN.md, "Softmax + top-k"), and
:func:`softmax_topk_reference` (tests' oracle)."""

from __future__ import annotations

import torch

from ..common import acc_dtype

__all__ = ["softmax_topk_decomposed", "softmax_topk_reference", "CHUNK", "CHUNKED_MIN_COLUMNS",
           "KEY_ROUNDS_MAX_COLUMNS", "KEY_ROUNDS_MAX_K", "NETWORK_MAX_COLUMNS"]

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


def _sortable_keys(x: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys ordered like ``x`` along the last dim: value bits (NaN largest), then the lower column."""
    b = (x if x.dtype == torch.float32 else x.float()).view(torch.int32)
    o = torch.where(b < 0, b ^ 0x7FFFFFFF, b)           # order-preserving int32 of a float
    o = torch.where(x != x, torch.full_like(o, 0x7FFFFFFF), o)
    col = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    return (o.to(torch.int64) << 32) | (0xFFFFFFFF - col)


def _select_network(x: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k columns of short rows by k bubble passes of compare-exchanges between whole columns, elementwise
    over the rows (Inductor vectorizes across them); exact ties keep the lower column first, NaN is largest."""
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
    """The op's math in torch ops: its CPU path, and what the ``smx`` backend puts in a CPU graph (Inductor makes
    two passes over each row of it; autograd gives the backward).

    Args: x (any shape, fp16/bf16/fp32/fp64), k (0 <= k <= x.shape[dim]), dim, scale (> 0), renormalize, and
    dtype (of the values, default x.dtype).

    Returns:
        ``(values, indices, logd)``: values and int64 indices of ``x.shape`` with ``dim`` of size k; ``logd =
        log(sum(exp(z - z[indices[0]])))`` (fp32, fp64 for fp64 x) of ``x.shape`` without ``dim``, empty when
        ``renormalize``, 0 when k == 0.
    """
    out_dtype = dtype or x.dtype
    acc = acc_dtype(x)
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
    """Tests' oracle: ``topk(softmax(x * scale, dim), k, dim)`` (divided by its sum when ``renormalize``), fp32."""
    acc = acc_dtype(x)
    p = torch.softmax(x.to(acc) * scale, dim)
    v, i = torch.topk(p, k, dim)
    if renormalize:
        v = v / v.sum(dim, keepdim=True)
    return v.to(dtype or x.dtype), i

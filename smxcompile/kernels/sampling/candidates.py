"""The sampling step on a few candidates per row: the torch path of ``smx::sample`` (CPU, and the reference
of the kernels).

The filters of ``generate(do_sample=True)`` (transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper``, in that order) keep the largest logits of a row, so the tokens that
can be drawn are among the row's ``c`` largest for some ``c``: ``c = k`` under a top-k; without one, ``c`` grows
(x4 from 64) until the candidates left out are provably filtered (their mass is at most ``1 - top_p``, or the
smallest candidate is below the min-p threshold), up to the whole row. The filters then run on the candidates,
sorted, with the row's normalizer; the token is drawn from the kept candidates' probabilities by inverse CDF at
a uniform number (:func:`draw`): the same distribution as eager's ``torch.multinomial``, without writing the
row's probabilities.

Where a tie straddles the candidates' edge (an entry outside equal to the smallest inside, and finite) the
whole row is the candidate set, so that ties at the k-th value are kept as eager keeps them. Ties at the top-p
boundary or at the ``min_tokens_to_keep``-th value keep as many entries as eager's sort does, the lowest indices
(eager's choice among them follows its unstable sort); the Triton kernel keeps the same ones.
"""

from __future__ import annotations

import math

import torch

__all__ = ["filtered_candidates", "draw", "sample_candidates", "NONFINITE_MESSAGE"]

#: The first candidate count without a top-k (grown x4 while it does not provably hold the kept set).
FIRST_CANDIDATES = 64
#: A candidate set proven sufficient by a mass or threshold comparison is trusted only this far from the edge
#: (fp32 rounding of the sums it compares).
_MARGIN = 1e-5
#: What ``torch.multinomial`` says of such rows (eager's softmax of them is NaN).
NONFINITE_MESSAGE = "probability tensor contains either `inf`, `nan` or element < 0"


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x / temperature`` in x's dtype, as the graph computes it (one rounding), skipped when 1."""
    return x if temperature == 1.0 else x / temperature


def _tie_at_edge(vals: torch.Tensor, c: int) -> bool:
    """The ``(c+1)``-th largest equals the ``c``-th and is finite (the edge would split a tie)."""
    if vals.shape[-1] <= c:
        return False
    edge, nxt = vals[..., c - 1], vals[..., c]
    return bool(((edge == nxt) & torch.isfinite(edge)).any())


def _canonical(vals: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``vals`` descending, ties by ascending index (torch.topk orders ties arbitrarily)."""
    idx, order = idx.sort(dim=-1)
    vals, order = vals.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    return vals, idx.gather(-1, order)


def filtered_candidates(x: torch.Tensor, *, temperature: float, top_k: int, top_p: float, min_p: float,
                        min_tokens_to_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept candidates of each row of logits ``x`` ``(B, V)``: ``(indices (B, c) int64, weights (B, c)
    fp32, fp64 for fp64 logits)``, the weights proportional to the filtered probabilities (0 where filtered).

    Args: ``temperature`` > 0 (the logits are divided by it in their dtype, as eager), ``top_k`` 0 for none
    (else >= 1), ``top_p`` in [0, 1] (1: none), ``min_p`` in [0, 1] (0: none), ``min_tokens_to_keep`` >= 1
    (transformers' argument: each filter keeps at least that many).

    Raises:
        RuntimeError: a row whose softmax is NaN (a NaN, a ``+inf``, or only ``-inf``), as torch.multinomial.
    """
    V = x.shape[-1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    keep_min = min(min_tokens_to_keep, V)
    k = min(max(top_k, keep_min), V) if top_k else 0
    lse = None
    if not k and top_p < 1.0:
        lse = torch.logsumexp(_scaled(x, temperature).to(acc), dim=-1, keepdim=True)
    c = k if k else min(V, max(FIRST_CANDIDATES, keep_min))   # (each filter keeps keep_min: all candidates)
    while True:
        # division by a positive number is monotone: the top of x is the top of x / temperature
        raw, idx = torch.topk(x, min(c + 1, V), dim=-1, largest=True, sorted=True)
        vals = _scaled(raw, temperature)
        if c >= V:
            break
        if _tie_at_edge(vals, c):
            c = V
            continue
        if k or _enough(vals[..., :c].to(acc), lse, top_p, min_p):
            break
        c = min(V, 4 * c)
    vals, idx = _canonical(vals[..., :c].to(acc), idx[..., :c])
    m = vals[..., :1]
    if not bool(torch.isfinite(m).all()):   # (torch.topk puts a NaN first)
        raise RuntimeError(NONFINITE_MESSAGE)
    keep = torch.ones_like(vals, dtype=torch.bool)
    if k and k < V and c == V:  # the whole row under a top-k (a tie at the edge): keep s >= the k-th value
        keep = vals >= vals[..., k - 1 : k]
    e = torch.exp(vals - m)
    if top_p < 1.0:
        # transformers' TopPLogitsWarper: ascending cumulative mass of the kept entries, those <= 1 - top_p go
        kept = torch.where(keep, e, 0.0)
        if lse is None:
            p, below = kept / kept.sum(-1, keepdim=True), 0.0
        else:  # the row's normalizer; the candidates left out hold the rest of the mass
            p = kept / torch.exp(lse - m)
            below = 1.0 - p.sum(-1, keepdim=True)
        cum = below + p.flip(-1).cumsum(-1).flip(-1)
        keep = keep & ~(cum <= 1.0 - top_p)
        keep[..., :keep_min] = True
    if min_p > 0.0:
        # transformers' MinPLogitsWarper: probabilities below min_p times the largest go
        q = torch.where(keep, e, 0.0)
        q = q / q.sum(-1, keepdim=True)
        keep = keep & ~(q < min_p * q[..., :1])
        keep[..., :keep_min] = True
    return idx, torch.where(keep, e, 0.0)


def _enough(vals: torch.Tensor, lse: torch.Tensor | None, top_p: float, min_p: float) -> bool:
    """Whether every entry outside the candidates ``vals`` (sorted, descending) is provably filtered."""
    m = vals[..., :1]
    ok = torch.zeros(vals.shape[:-1], dtype=torch.bool, device=vals.device)
    if lse is not None:
        inside = torch.exp(vals - lse).sum(-1)
        ok |= (1.0 - inside) < (1.0 - top_p) - _MARGIN
    if min_p > 0.0:
        ok |= vals[..., -1] - m[..., 0] < math.log(min_p) - _MARGIN
    return bool(ok.all())


def draw(indices: torch.Tensor, weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over each row's kept candidates in vocabulary order: the first column whose cumulative
    weight exceeds ``uniform * total`` (``uniform`` (B,) in [0, 1)); ``(B, 1)`` int64. A column of weight 0 is
    never drawn. The Triton kernel draws the same way, so that both give the same token for the same ``u``."""
    order = indices.argsort(dim=-1)
    idx, w = indices.gather(-1, order), weights.gather(-1, order)
    cum = w.double().cumsum(-1)
    pos = torch.searchsorted(cum, (uniform.double()[:, None] * cum[:, -1:]).contiguous(), right=True)
    last = torch.where(w > 0, torch.arange(w.shape[-1], device=w.device), -1).amax(-1, keepdim=True)
    return idx.gather(-1, torch.minimum(pos, last))


def sample_candidates(x: torch.Tensor, *, temperature: float, top_k: int, top_p: float, min_p: float,
                      min_tokens_to_keep: int, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of logits ``x`` ``(B, V)``: ``(B, 1)`` int64, drawn from
    ``softmax(filters(x / temperature))`` (see the module docstring) at the uniforms ``uniform`` (B,)."""
    idx, w = filtered_candidates(x, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                 min_tokens_to_keep=min_tokens_to_keep)
    return draw(idx, w, uniform)

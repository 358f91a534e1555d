"""The public :func:`attention`: argument checks, the route (``F.scaled_dot_product_attention`` for plain
softmax, else ``smx::attention``) and the flattening of the batch dims."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import config
from ..common import FLOAT_DTYPES, acc_dtype, autocast_off, autocast_on
from .ops import AttentionError, attention_op
from .reference import NORMALIZERS
from .torch_path import torch_forward

__all__ = ["attention"]

#: An eager CPU call that needs gradients and whose scores (all heads, the accumulation dtype) fit in this
#: many bytes runs the torch path under torch's autograd, which keeps each block's intermediates as the
#: written-out attention does (2.4x the scores for ssmax, 3.4x soft-capped softmax, up to 8.7x softpick /
#: entmax15: at most ~280 MB here): faster in training than the op's backward, which recomputes them to keep
#: only q, k, v and the output (``python benchmarks/bench_eager_ops.py --ops attention``). Larger calls keep
#: the op, whose memory is O(L x block).
EAGER_AUTOGRAD_MAX_SCORE_BYTES = 32 * 2**20


def _is_real(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, normalizer, norm_param):
    """Validate :func:`attention`'s arguments; returns the broadcast batch shape."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if query.dim() < 3 or key.dim() < 3 or value.dim() < 3:
        raise AttentionError(
            "query, key and value must have at least 3 dims (..., heads, length, head_dim), got "
            f"query.dim() = {query.dim()}, key.dim() = {key.dim()}, value.dim() = {value.dim()}")
    if not (query.dtype == key.dtype == value.dtype):
        raise AttentionError(f"query, key and value must have the same dtype, got query.dtype: {query.dtype}, "
                             f"key.dtype: {key.dtype}, value.dtype: {value.dtype}")
    if query.dtype not in FLOAT_DTYPES:
        raise AttentionError(f"query, key and value must be fp16, bf16, fp32 or fp64, got {query.dtype}")
    if not (query.device == key.device == value.device):
        raise AttentionError(f"query, key and value must be on one device, got {query.device}, {key.device}, "
                             f"{value.device}")
    (Hq, L, E), (Hkv, S, Ek), (Hv, Sv, _) = query.shape[-3:], key.shape[-3:], value.shape[-3:]
    if Ek != E:
        raise AttentionError(f"key's last dim ({Ek}) must equal query's ({E})")
    if (Hv, Sv) != (Hkv, S):
        raise AttentionError(f"value (..., {Hv}, {Sv}, Ev) must have key's heads and length (..., {Hkv}, {S}, E)")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {enable_gqa!r}")
    if enable_gqa:
        if (Hkv == 0 and Hq != 0) or (Hkv and Hq % Hkv):
            raise AttentionError(f"enable_gqa: the number of query heads ({Hq}) must be a multiple of the "
                                 f"number of key/value heads ({Hkv})")
    elif Hq != Hkv:
        raise AttentionError(f"query has {Hq} heads and key/value {Hkv}; pass enable_gqa=True for grouped-query "
                             "attention")
    try:
        batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    except RuntimeError as e:
        raise AttentionError(f"the batch dims of query {tuple(query.shape[:-3])}, key {tuple(key.shape[:-3])} and "
                             f"value {tuple(value.shape[:-3])} do not broadcast") from e
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
            raise AttentionError(f"attn_mask must be bool, float32 or query's dtype ({query.dtype}), got "
                                 f"{attn_mask.dtype}")
        if attn_mask.device != query.device:
            raise AttentionError(f"attn_mask is on {attn_mask.device}, query on {query.device}")
        full = (*batch, Hq, L, S)
        try:
            shape = torch.broadcast_shapes(attn_mask.shape, full)
        except RuntimeError as e:
            raise AttentionError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the scores "
                                 f"{full}") from e
        if tuple(shape) != full:
            raise AttentionError(f"attn_mask of shape {tuple(attn_mask.shape)} would broadcast the scores {full} "
                                 "to a larger shape")
    if not _is_real(dropout_p) or not 0.0 <= dropout_p < 1.0:
        raise AttentionError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if scale is not None and not _is_real(scale):
        raise AttentionError(f"scale must be a finite real number or None, got {scale!r}")
    if softcap is not None and (not _is_real(softcap) or softcap <= 0):
        raise AttentionError(f"softcap must be a positive number or None, got {softcap!r}")
    if not isinstance(normalizer, str) or normalizer not in NORMALIZERS:
        raise AttentionError(f"unknown normalizer {normalizer!r}; known: {', '.join(NORMALIZERS)}")
    if norm_param is not None:
        if not NORMALIZERS[normalizer].takes_param:
            raise AttentionError(f"normalizer {normalizer!r} takes no norm_param; these do: "
                                 f"{', '.join(n for n, z in NORMALIZERS.items() if z.takes_param)}")
        if isinstance(norm_param, torch.Tensor):
            if not norm_param.is_floating_point():
                raise AttentionError(f"norm_param must be a floating-point tensor, got {norm_param.dtype}")
            if norm_param.device != query.device:
                raise AttentionError(f"norm_param is on {norm_param.device}, query on {query.device}")
            heads = (*batch, Hq)
            try:
                shape = torch.broadcast_shapes(norm_param.shape, heads)
            except RuntimeError:
                shape = None
            if shape is None or tuple(shape) != heads:
                raise AttentionError(f"norm_param of shape {tuple(norm_param.shape)} must broadcast to "
                                     f"(batch..., heads) = {heads} (one value per query head)")
        elif not _is_real(norm_param):
            raise AttentionError(f"norm_param must be None, a finite number or a tensor, got {norm_param!r}")
    return tuple(batch)


def _flat(t: torch.Tensor, batch: tuple, B: int) -> torch.Tensor:
    """(*t_batch, H, N, D) -> (B, H, N, D) contiguous (a copy only if needed)."""
    return t.expand(*batch, *t.shape[-3:]).reshape(B, *t.shape[-3:]).contiguous()


def _flat_mask(mask: torch.Tensor, batch: tuple, B: int, Hq: int, L: int, S: int) -> torch.Tensor:
    """The mask as a (B, Hq, L, S) view; its head/row/key broadcasting stays stride 0, only the batch
    dims are copied when they cannot be merged in place."""
    nd = len(batch) + 3
    m = mask.reshape((1,) * (nd - mask.dim()) + tuple(mask.shape))
    tail = tuple(m.shape[-3:])
    m = m.expand(*batch, *tail)
    try:
        m = m.view(B, *tail)
    except RuntimeError:
        m = m.contiguous().view(B, *tail)
    return m.expand(B, Hq, L, S)


#: Normalizers whose formula or default parameter uses n, the number of keys a row may see.
_N_DEPENDENT = frozenset({"ssmax", "sigmoid", "relu", "softplus"})


def _draw_seed() -> torch.Tensor:
    """A dropout seed from torch's default generator (``torch.manual_seed`` makes runs reproducible), as an
    int64 0-d CPU tensor: under ``torch.compile`` it stays a random op of the graph (a fresh seed every
    call) instead of a constant baked in at trace time."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    softcap: float | None = None,
    normalizer: str = "softmax",
    norm_param: float | torch.Tensor | None = None,
    skip_threshold: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with soft-capping and a choice of normalizer.

    The first eight arguments are those of ``F.scaled_dot_product_attention`` (same order, names
    and meaning). Per query row ``i``: ``s = (q_i @ k^T) * scale``; ``s = softcap * tanh(s / softcap)``
    if ``softcap``; then the mask; ``w = normalizer(s)`` over the keys; dropout on ``w``;
    ``out_i = w @ v``. Math in fp32 for fp16/bf16 inputs, fp64 for fp64.

    Args:
        query: (..., Hq, L, E); fp16, bf16, fp32 or fp64; any strides.
        key: (..., Hkv, S, E), query's dtype and device.
        value: (..., Hkv, S, Ev), query's dtype and device. The batch dims ``...`` of the three
            broadcast against each other (as in SDPA; a broadcast key/value is copied).
        attn_mask: None, bool (True = may attend) or float (added to the scores; ``-inf`` masks),
            float32 or query's dtype, broadcastable to (..., Hq, L, S). Masked keys get weight exactly
            0 under every normalizer. Only ``-inf`` masks: a finite value such as ``finfo.min`` is a
            (very negative) score, which matters for softpick (it joins the denominator). No gradient
            flows to a float mask (an error is raised if it requires grad, except on the SDPA route).
        dropout_p: dropout probability on the weights, in [0, 1); applied whenever > 0 (pass 0.0 in
            eval, as with SDPA); kept weights are scaled by ``1/(1 - dropout_p)``.
        is_causal: top-left aligned causal mask (key j allowed iff ``j <= i``), as SDPA; together
            with ``attn_mask`` both apply (as SDPA in torch 2.13).
        scale: multiplies the scores; default ``1/sqrt(E)`` (1.0 when E = 0).
        enable_gqa: grouped-query attention: Hq a multiple of Hkv; query head h uses kv head
            ``h // (Hq // Hkv)`` (SDPA's repeat_interleave semantics; K and V are never repeated).
        softcap: soft-capping ``c * tanh(s / c)`` (Gemma 2) before the mask, or None; > 0.
        normalizer: a name in :data:`NORMALIZERS`: ``softmax``, ``softmax1`` (Miller 2023),
            ``sigmoid`` (Ramapuram et al. 2024), ``relu`` (Wortsman et al. 2023), ``softpick``
            (Zuhri et al. 2025), ``ssmax`` (Nakanishi 2025), ``softplus`` (Gao & Spratling 2025),
            ``sparsemax`` (Martins & Astudillo 2016), ``entmax15`` (Peters et al. 2019).
        norm_param: the normalizer's parameter (sigmoid's bias, relu's scale, softpick's eps,
            ssmax's p, softplus's scale): None for its default (see ``NORMALIZERS[name].param_doc``),
            a number, or a tensor broadcastable to (..., Hq) — one value per head — that receives a
            gradient when it requires one. ``n`` (ssmax's ``log n``, and the defaults of sigmoid,
            relu and softplus) is the number of keys the row may see: S, or ``min(i + 1, S)`` under
            ``is_causal``, or with ``attn_mask`` the keys it leaves (bool True / float not ``-inf``),
            at least 1 — so a causal or padding mask gives the same ``n`` as a tensor as it does
            through ``is_causal``.
        skip_threshold: BLASST skip-softmax sparse attention: a lambda in (0, 1);
            the CUDA kernel skips a K/V tile when ``tile_max - running_max < ln(lambda)`` for every row
            of its query block — an approximation (weights below lambda of the running max are
            dropped), training-free. None (default): exact. Softmax only, forward only (gradients
            are those of exact attention), CUDA Triton kernel only (an error elsewhere).

    Returns:
        (..., Hq, L, Ev) in query's dtype. A row with every key masked, or S = 0, gives 0 (zero
        gradients).

    Raises:
        TypeError: query/key/value/attn_mask not tensors; non-bool ``is_causal``/``enable_gqa``.
        AttentionError (a ValueError and a RuntimeError): rank < 3; dtype or device mismatch;
            non-float dtype; mismatched E, S or heads; Hq != Hkv without ``enable_gqa`` or Hq not a
            multiple of Hkv with it; batch dims that do not broadcast; attn_mask of
            a wrong dtype or shape; dropout_p outside [0, 1); non-finite scale; softcap <= 0;
            an unknown normalizer (the message lists the names); norm_param for a normalizer without
            one, or of a shape that does not broadcast to (..., Hq); a float attn_mask requiring
            grad off the SDPA route.

    Routing: ``normalizer="softmax"`` without ``softcap`` calls ``F.scaled_dot_product_attention``
    (torch's fused kernels, identical semantics). Everything else runs ``torch.ops.smx.attention``:
    Triton kernels on CUDA (FlashAttention-style tiling, Dao et al. 2022, with the online softmax of
    Milakov & Gimelshein 2018), blocks of query rows in torch on CPU and for fp64. Dropout masks on
    that route come from a seed drawn from torch's default generator (``torch.manual_seed`` makes
    them reproducible) and depend on the block layout, so they differ between CPU and CUDA.
    Under CPU/CUDA autocast, fp32 query/key/value are cast to the autocast dtype, as SDPA is.
    """
    batch = _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, normalizer,
                   norm_param)
    if skip_threshold is not None:
        if normalizer != "softmax":
            raise AttentionError(f"skip_threshold is defined for the softmax normalizer only, got {normalizer!r}")
        if isinstance(skip_threshold, bool) or not isinstance(skip_threshold, (int, float)) \
                or not 0.0 < skip_threshold < 1.0:
            raise AttentionError(f"skip_threshold must be None or a number in (0, 1), got {skip_threshold!r}")
        if not config.use_triton(query):
            raise AttentionError("skip_threshold (BLASST tile skipping) runs in the CUDA Triton kernel only")
    elif normalizer == "softmax" and softcap is None:
        # (SDPA itself combines attn_mask with is_causal)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and is_causal:
        # both, as SDPA allows: the causal triangle (top-left) folded into the mask
        L_, S_ = query.shape[-2], key.shape[-2]
        tri = torch.ones(L_, S_, dtype=torch.bool, device=query.device).tril()
        attn_mask = attn_mask & tri if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~tri, float("-inf"))
        is_causal = False
    if (attn_mask is not None and attn_mask.requires_grad and attn_mask.is_floating_point()
        and torch.is_grad_enabled()):
        raise AttentionError(f"attn_mask requires grad, but normalizer={normalizer!r} (or softcap) gives the "
                             "mask no gradient; detach it")
    if autocast_on(query.device) and query.dtype == torch.float32:
        dt = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    Hq, L, E = query.shape[-3:]
    Hkv, S, Ev = value.shape[-3:]
    B = math.prod(batch)
    acc = acc_dtype(query)
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E else 1.0
    q, k, v = _flat(query, batch, B), _flat(key, batch, B), _flat(value, batch, B)
    mask = None if attn_mask is None else _flat_mask(attn_mask, batch, B, Hq, L, S)
    param = None
    if isinstance(norm_param, torch.Tensor):
        param = norm_param.to(acc).expand(*batch, Hq).reshape(B, Hq).contiguous()
    elif norm_param is not None:
        param = torch.full((B, Hq), float(norm_param), dtype=acc, device=query.device)
    seed = _draw_seed() if dropout_p > 0 else None
    n_keys = None
    if mask is not None and normalizer in _N_DEPENDENT:
        # n = the keys the mask leaves each row (not its position): the same n whether a causal or
        # padding mask arrives as a tensor or as is_causal
        keep = mask if mask.dtype == torch.bool else mask != float("-inf")
        n_keys = keep.sum(-1, dtype=torch.float32)
        if keep.shape[-1] == 1 and S != 1:
            n_keys = n_keys * S
        n_keys = n_keys.expand(B, Hq, L).contiguous()
    cap = None if softcap is None else float(softcap)
    if (config.eager_aten(q) and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                                               or (param is not None and param.requires_grad))
            and 0 < B * Hq * L * S * (torch.finfo(acc).bits // 8) <= EAGER_AUTOGRAD_MAX_SCORE_BYTES and Ev):
        out = autocast_off(torch_forward)(q, k, v, mask, is_causal, float(scale), cap, normalizer, param,
                                          float(dropout_p), 0 if seed is None else int(seed.item()), n_keys)
        return out.view(*batch, Hq, L, Ev)
    out, _ = attention_op(q, k, v, mask, is_causal, float(scale), cap, normalizer, param, float(dropout_p), seed,
                          None if skip_threshold is None else float(skip_threshold), n_keys)
    return out.view(*batch, Hq, L, Ev)

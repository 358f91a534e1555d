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

#: An eager CPU call needing gradients whose scores fit in this many bytes runs the torch path under torch's
#: autograd, measured faster than the op's recomputing backward (docs/PERFORMANCE.md, "Attention called eagerly").
EAGER_AUTOGRAD_MAX_SCORE_BYTES = 32 * 2**20


def _is_real(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, normalizer, norm_param):
    """Validate :func:`attention`'s arguments (the one check of ``normalizer``: the op and its kernels trust it);
    returns the broadcast batch shape."""
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


def _draw_seed() -> torch.Tensor:
    """A dropout seed from torch's default generator, as an int64 0-d CPU tensor: under ``torch.compile`` it stays
    a random op of the graph (a fresh seed every call), not a constant baked in at trace time."""
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

    The first eight arguments are those of ``F.scaled_dot_product_attention`` (same order, names and meaning).
    Per query row ``i``: ``s = (q_i @ k^T) * scale``; ``s = softcap * tanh(s / softcap)`` if ``softcap``; the
    mask; ``w = normalizer(s)`` over the keys; dropout on ``w``; ``out_i = w @ v``. Math in fp32 for fp16/bf16
    inputs, fp64 for fp64.

    Args:
        query: (..., Hq, L, E); fp16, bf16, fp32 or fp64; any strides.
        key: (..., Hkv, S, E); value: (..., Hkv, S, Ev); query's dtype and device. The batch dims of the
            three broadcast against each other (as in SDPA; a broadcast key/value is copied).
        attn_mask: None, bool (True = may attend) or float (added to the scores; ``-inf`` masks), float32 or
            query's dtype, broadcastable to (..., Hq, L, S). Masked keys get weight exactly 0 under every
            normalizer; a finite value such as ``finfo.min`` is a score (softpick counts it in its
            denominator). No gradient flows to a float mask.
        dropout_p: dropout on the weights, in [0, 1), applied whenever > 0 (kept weights scaled up).
        is_causal: top-left aligned causal mask (key j allowed iff ``j <= i``); with ``attn_mask`` both apply.
        scale: multiplies the scores; default ``1/sqrt(E)`` (1.0 when E = 0).
        enable_gqa: Hq a multiple of Hkv; query head h uses kv head ``h // (Hq // Hkv)`` (never repeated).
        softcap: soft-capping ``c * tanh(s / c)`` (Gemma 2) before the mask, > 0, or None.
        normalizer: a name in :data:`NORMALIZERS` (each with its paper): ``softmax``, ``softmax1``, ``sigmoid``,
            ``relu``, ``softpick``, ``ssmax``, ``softplus``, ``sparsemax``, ``entmax15``.
        norm_param: the normalizer's parameter (``NORMALIZERS[name].param_doc``): None for its default, a
            number, or a tensor broadcastable to (..., Hq) that receives a gradient. ``n`` (in ssmax and the
            defaults of sigmoid, relu, softplus) is the number of keys the row may see: S, ``min(i + 1, S)``
            under ``is_causal``, or the keys ``attn_mask`` leaves, at least 1.
        skip_threshold: BLASST skip-softmax sparse attention, a lambda in (0, 1): the CUDA kernel skips a
            K/V tile when ``tile_max - running_max < ln(lambda)`` for every row of its query block (an
            approximation). None: exact. Softmax only, forward only, CUDA Triton kernel only.

    Returns:
        (..., Hq, L, Ev) in query's dtype. A row with every key masked, or S = 0, gives 0 (zero gradients).

    Raises:
        TypeError: query/key/value/attn_mask not tensors; non-bool ``is_causal``/``enable_gqa``.
        AttentionError (a ValueError and a RuntimeError): any other bad argument (shapes, dtypes, devices, heads,
            values out of range, an unknown normalizer, a float attn_mask requiring grad off the SDPA route).

    ``normalizer="softmax"`` without ``softcap`` calls ``F.scaled_dot_product_attention``; everything else
    runs ``torch.ops.smx.attention`` (docs/DESIGN.md, "Attention op: paths"), whose dropout masks come from a
    seed drawn from torch's default generator. Under autocast, fp32 inputs are cast as SDPA casts them.
    """
    batch = _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, normalizer,
                   norm_param)
    _check_skip_threshold(skip_threshold, normalizer, query)
    if skip_threshold is None and normalizer == "softmax" and softcap is None:
        # SDPA itself combines attn_mask with is_causal
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return _run_op(query, key, value, batch, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                   scale=scale, softcap=softcap, normalizer=normalizer, norm_param=norm_param,
                   skip_threshold=skip_threshold)


def _check_skip_threshold(skip_threshold, normalizer: str, query: torch.Tensor) -> None:
    """Validate :func:`attention`'s ``skip_threshold`` (a softmax-only option of the Triton kernel)."""
    if skip_threshold is None:
        return
    if normalizer != "softmax":
        raise AttentionError(f"skip_threshold is defined for the softmax normalizer only, got {normalizer!r}")
    if isinstance(skip_threshold, bool) or not isinstance(skip_threshold, (int, float)) \
            or not 0.0 < skip_threshold < 1.0:
        raise AttentionError(f"skip_threshold must be None or a number in (0, 1), got {skip_threshold!r}")
    if not config.use_triton(query):
        raise AttentionError("skip_threshold (BLASST tile skipping) runs in the CUDA Triton kernel only")


def _fold_causal(query, key, attn_mask, is_causal):
    """``(attn_mask, is_causal)`` with a causal triangle (top-left) folded into a given mask, as SDPA allows."""
    if attn_mask is None or not is_causal:
        return attn_mask, is_causal
    tri = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    if attn_mask.dtype == torch.bool:
        return attn_mask & tri, False
    return attn_mask.masked_fill(~tri, float("-inf")), False


def _mask_key_counts(mask, normalizer: str, B: int, Hq: int, L: int, S: int):
    """Per-row counts (B, Hq, L) of the keys ``mask`` leaves, for a normalizer that reads ``n``; else None."""
    if mask is None or not NORMALIZERS[normalizer].reads_n:
        return None
    # the keys the mask leaves, not the row's position: a causal mask as a tensor gives is_causal's n
    keep = mask if mask.dtype == torch.bool else mask != float("-inf")
    n_keys = keep.sum(-1, dtype=torch.float32)
    if keep.shape[-1] == 1 and S != 1:
        n_keys = n_keys * S
    return n_keys.expand(B, Hq, L).contiguous()


def _run_op(query, key, value, batch, *, attn_mask, dropout_p, is_causal, scale, softcap, normalizer, norm_param,
            skip_threshold):
    """:func:`attention` off the SDPA route: flatten the batch dims, then ``smx::attention`` or, for small eager
    CPU calls needing gradients, the torch path under torch's autograd."""
    attn_mask, is_causal = _fold_causal(query, key, attn_mask, is_causal)
    if (attn_mask is not None and attn_mask.requires_grad and attn_mask.is_floating_point()
            and torch.is_grad_enabled()):
        raise AttentionError(f"attn_mask requires grad, but normalizer={normalizer!r} (or softcap) gives the "
                             "mask no gradient; detach it")
    if autocast_on(query.device) and query.dtype == torch.float32:
        autocast_dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(autocast_dtype), key.to(autocast_dtype), value.to(autocast_dtype)
    Hq, L, E = query.shape[-3:]
    S, Ev = value.shape[-2:]
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
    n_keys = _mask_key_counts(mask, normalizer, B, Hq, L, S)
    cap = None if softcap is None else float(softcap)
    needs_grad = any(t is not None and t.requires_grad for t in (q, k, v, param))
    score_bytes = B * Hq * L * S * (torch.finfo(acc).bits // 8)
    if (config.eager_aten(q) and torch.is_grad_enabled() and needs_grad
            and 0 < score_bytes <= EAGER_AUTOGRAD_MAX_SCORE_BYTES and Ev):
        out = autocast_off(torch_forward)(q, k, v, mask, is_causal, float(scale), cap, normalizer, param,
                                          float(dropout_p), 0 if seed is None else int(seed.item()), n_keys)
        return out.view(*batch, Hq, L, Ev)
    out, _ = attention_op(q, k, v, mask, is_causal, float(scale), cap, normalizer, param, float(dropout_p), seed,
                          None if skip_threshold is None else float(skip_threshold), n_keys)
    return out.view(*batch, Hq, L, Ev)

"""Vocabulary-parallel cut cross-entropy: the classifier sharded by vocabulary rows across a process group.

Each rank runs the single-device statistics op on its rows ``[s_r, s_r + V_r)`` of the classifier, with the same
(replicated) embeddings and targets; the partial rows (lse, target logit, other mass, weighted sum) merge as
online-softmax states in three collectives of O(N) numbers (:func:`_exchange`, :func:`_merge`), and the loss is
composed from them as on one device. The backward runs the single-device backward op on each shard with the
global lse and other mass (the unsharded, collapse-safe formula); grad_input is summed over the group. See
docs/DESIGN.md, "Cross-entropy: vocabulary parallelism, the three collectives".

Method: cut cross-entropy (Wijmans et al., 2024) per shard, merged with the online-softmax rule (Milakov &
Gimelshein, 2018), in the layout of Megatron-LM's vocabulary-parallel cross-entropy (Shoeybi et al., 2019),
which shards the logits; here no rank holds any.
"""

from __future__ import annotations

import torch

from .. import config
from ..common import acc_dtype, autocast_off
from .chunked import rows_per_chunk
from .fused import MIN_CHUNK_ROWS, saved_grad_dtype, scalar_coefs
from .loss import (check_linear, check_options, check_range, compose_loss, finish_output, fp32_logit_operands,
                   is_dtensor, linear_loss_dtype, needs_grad, resolve_filter_eps, row_count, split_targets)
from .ops import coefs, linear_ce_backward, linear_ce_stats

__all__ = ["vocab_parallel_linear_cross_entropy", "VocabShard"]

def _dist():
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("vocabulary-parallel cross-entropy needs torch.distributed, which this torch build lacks")
    return dist


class VocabShard:
    """Where this rank's vocabulary rows sit: ``start``, ``size`` (this rank), ``vocab_size`` (all ranks)."""

    __slots__ = ("start", "size", "vocab_size", "sizes")

    def __init__(self, sizes: list[int], rank: int):
        self.sizes = sizes
        self.start = sum(sizes[:rank])
        self.size = sizes[rank]
        self.vocab_size = sum(sizes)

    def __repr__(self) -> str:
        return f"VocabShard(start={self.start}, size={self.size}, vocab_size={self.vocab_size}, sizes={self.sizes})"


def _weights(n: int, seed: int, device) -> torch.Tensor:
    """Fixed pseudo-random weights in [1, 2) (the same on every rank) for the replication checksums."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g, dtype=torch.float64) + 1.0).to(device)


def _checksum(t: torch.Tensor | None, seed: int) -> torch.Tensor:
    """A deterministic fingerprint of a tensor's values and positions (float64; NaN/inf mapped to numbers).

    Floats: ``pos . (t @ r)`` with fixed random ``pos``/``r`` (a row permutation or values moved between
    columns change it); integers: the same with exact int64 weights. One pass over ``t``."""
    if t is None:
        return torch.zeros((), dtype=torch.float64)
    t2 = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(-1, 1)
    n, d = t2.shape
    if n * d == 0:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    if not t2.dtype.is_floating_point:
        pos = torch.arange(n, device=t.device, dtype=torch.int64) % 1_000_003 + 1
        return (t2[:, 0].long() * pos).sum().to(torch.float64) + n
    r = _weights(d, seed, t.device).to(t2.dtype)
    rows = (t2 @ r).to(torch.float64)
    return torch.nan_to_num((rows * _weights(n, seed + 1, t.device)).sum(), nan=-1.0, posinf=1e300, neginf=-1e300)


def _fingerprint(options: tuple) -> float:
    """The call's options as a float64-exact 48-bit hash (ranks that disagree would pair up mismatched
    collectives: a crash or a hang instead of an error)."""
    import hashlib

    h = hashlib.blake2b(repr(options).encode(), digest_size=6).digest()
    return float(int.from_bytes(h, "little"))


_HINT = ("every rank of the group must pass the same (replicated) input rows, targets and options and hold its "
         "own slice of the classifier. Data-parallel ranks (different batches) belong to another group; an FSDP2 "
         "parameter (a DTensor sharded on dim 0 over the data-parallel mesh) used outside its module's forward "
         "is not a vocabulary shard: call the loss inside the module, where FSDP has gathered it")


def _exchange(group, v_loc: int, x2, tgt, class_weight, token_weight, options: tuple, error) -> VocabShard:
    """Collective 1 (an all_gather of 9 numbers per rank): the shard sizes, and the checks that every rank
    passed the same targets, embeddings, weights and options and that no rank rejected its arguments. Runs
    on every rank even when this rank's own argument checks failed (``error``), so that every rank raises
    instead of the others waiting forever in the next collective."""
    dist = _dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = x2.device if isinstance(x2, torch.Tensor) else torch.device("cpu")
    if error is None:
        scale = _checksum(x2.abs(), 7) if x2.numel() else torch.zeros((), dtype=torch.float64, device=device)
        mine = torch.stack([torch.tensor(float(v_loc), dtype=torch.float64, device=device), _checksum(tgt, 3),
                            _checksum(x2, 5), scale.to(device), _checksum(class_weight, 11).to(device),
                            _checksum(token_weight, 13).to(device),
                            torch.tensor(_fingerprint(options), dtype=torch.float64, device=device),
                            torch.tensor(float(class_weight.numel()) if class_weight is not None else -1.0,
                                         dtype=torch.float64, device=device),
                            torch.tensor(float(token_weight.numel()) if token_weight is not None else -1.0,
                                         dtype=torch.float64, device=device)])
    else:
        mine = torch.full((9,), float("nan"), dtype=torch.float64, device=device)
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        mine = mine.cuda()
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()
    failed = [r for r in range(world) if bool(table[r].isnan().all())]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"vocabulary-parallel cross-entropy: rank(s) {failed} of the group rejected their "
                           "arguments (their own error says why); this rank stops too")
    same = lambda col: torch.equal(table[:, col], table[:1, col].expand(world))  # noqa: E731
    v = int(table[:, 0].sum())
    cw_sizes = [int(c) for c in table[:, 7].tolist()]
    if any(c not in (-1, v) for c in cw_sizes) or not same(7):
        raise ValueError(f"class_weight must be the full ({v},) per-class weights on every rank (the vocabulary of "
                         f"all shards, replicated), got sizes {cw_sizes} on ranks 0..{world - 1} (-1: none)")
    if not same(8):
        raise ValueError(f"token_weight differs in size between the ranks ({[int(c) for c in table[:, 8].tolist()]}); "
                         f"{_HINT}")
    if not same(6):
        raise ValueError("vocabulary-parallel cross-entropy: the options (reduction, ignore_index, label_smoothing, "
                         "scale, softcap, lse_square_scale, chunk_bytes, dtype, shapes, whether a gradient is needed, "
                         f"...) differ between the ranks; {_HINT}")
    if not same(1):
        raise ValueError(f"vocabulary-parallel cross-entropy: the targets differ between the ranks; {_HINT}")
    if not same(4) or not same(5):
        raise ValueError("vocabulary-parallel cross-entropy: class_weight or token_weight differ between the "
                         f"ranks; {_HINT}")
    tol = 1e-6 * float(table[:, 3].abs().max()) + 1e-30
    if float(table[:, 2].max() - table[:, 2].min()) > tol:
        raise ValueError(f"vocabulary-parallel cross-entropy: the embeddings (input) differ between the ranks; {_HINT}")
    return VocabShard([int(v) for v in table[:, 0].tolist()], rank)


def _stats_local(x2, weight, bias, tgt_local, cw_local, scale, softcap, need_ws, chunk_bytes):
    n = x2.shape[0]
    acc = acc_dtype(x2)
    if weight.shape[0] == 0:  # an empty shard: exp(lse_r) = 0 adds nothing
        z = torch.zeros(n, dtype=acc, device=x2.device)
        return torch.full_like(z, float("-inf")), z, z, z
    lse, tl, om, ws, _ = linear_ce_stats(x2, weight, bias, tgt_local, None, class_weight=cw_local, ignore_index=-1,
                                         scale=scale, softcap=softcap, need_weighted_sum=need_ws, return_logits=False,
                                         logits_dtype=None, chunk_bytes=chunk_bytes)
    return lse, tl, om, (ws if need_ws else torch.zeros_like(lse))


class _VocabParallelStats(torch.autograd.Function):
    """(embeddings, shard of W, shard of bias) -> global (lse, target_logit, weighted_sum); see the module docstring."""

    @staticmethod
    def forward(ctx, x2, weight, bias, tgt_local, owned, cw_local, group, scale, softcap, need_ws, chunk_bytes,
                grad_options, reduce_input_grad):
        lse_r, tl_r, om_r, ws_r = _stats_local(x2, weight, bias, tgt_local, cw_local, scale, softcap, need_ws,
                                               chunk_bytes)
        lse, tl, other_mass, ws, _ = _merge(lse_r, tl_r, om_r, ws_r if need_ws else None, owned, group)
        ws = ws if need_ws else lse.new_empty(0)
        ctx.save_for_backward(x2, weight, bias, tgt_local, cw_local, lse, other_mass)
        ctx.args = (group, scale, softcap, chunk_bytes, grad_options, reduce_input_grad)
        ctx.has_bias = bias is not None
        if not need_ws:
            ctx.mark_non_differentiable(ws)
        return lse, tl, ws

    @staticmethod
    def backward(ctx, grad_lse, grad_tl, grad_ws):
        if torch.is_grad_enabled():
            raise RuntimeError("double backward (create_graph=True) through vocabulary-parallel cross-entropy is not "
                               "supported; use F.cross_entropy(F.linear(...)) for higher-order gradients")
        x2, weight, bias, tgt_local, cw_local, lse, other_mass = ctx.saved_tensors
        group, scale, softcap, chunk_bytes, (filter_eps, precise_grad), reduce_input_grad = ctx.args
        a, b, c = coefs(lse, grad_lse, grad_tl, grad_ws)
        need_in, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        if weight.shape[0]:
            gi, gw, gb = linear_ce_backward(
                x2, weight, bias, tgt_local, None, class_weight=cw_local, lse=lse, other_mass=other_mass, coef_a=a,
                coef_b=b, coef_c=c, ignore_index=-1, scale=scale, softcap=softcap, logits=None, grad_logits=None,
                filter_eps=filter_eps, need_input_grad=need_in, need_weight_grad=need_w, need_bias_grad=need_b,
                chunk_bytes=chunk_bytes, precise_grad=precise_grad)
        else:
            gi, gw, gb = torch.zeros_like(x2), torch.zeros_like(weight), (torch.zeros_like(bias) if need_b else None)
        if need_in and reduce_input_grad:
            dist = _dist()
            dist.all_reduce(gi, op=dist.ReduceOp.SUM, group=group)
        return (gi if need_in else None, gw if need_w else None, gb if need_b else None) + (None,) * 10


def _merge(lse_r, tl_r, om_r, ws_r, owned, group):
    """Collectives 2 and 3: the ranks' (lse_r, tl_r, om_r[, ws_r]) rows -> global (lse, tl, other_mass[, ws])."""
    dist = _dist()
    m = lse_r.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    m = torch.where(torch.isfinite(m), m, 0.0)  # all -inf rows: lse = log(0) = -inf; +inf: lse = +inf
    e = torch.exp(lse_r - m)
    parts = [e, torch.where(owned, om_r, 1.0) * e, tl_r] + ([ws_r] if ws_r is not None else [])
    s = torch.stack(parts)
    dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
    return m + torch.log(s[0]), s[2], s[1] / s[0], (s[3] if ws_r is not None else None), e / s[0]


class _VocabParallelFused(torch.autograd.Function):
    """CPU, reduction mean/sum, no soft-cap / smoothing, a gradient needed: the gradients in the forward.

    :func:`~.fused.fused_forward` with the merge collectives run per row chunk: ``G = (a * f) P_r`` (the shard's
    softmax, ``f = exp(lse_r - lse)``) plus ``t = -a * other_mass + (a - b)`` at the target on the owning rank.
    Every rank runs the same chunks (non-ignored rows, height from the largest shard), so the collectives pair up."""

    @staticmethod
    @autocast_off
    def forward(ctx, x2, weight, bias, tgt, tgt_local, owned, class_weight, token_weight, v, ignore_index,
                reduction, z_scale, scale, group, step, reduce_input_grad):
        dist = _dist()
        n, d, v_loc = x2.shape[0], x2.shape[1], weight.shape[0]
        acc = acc_dtype(x2)
        a0, b0, _, zc = scalar_coefs(tgt, v, class_weight, token_weight, ignore_index, reduction, 0.0, z_scale, acc)
        lse = torch.zeros(n, dtype=acc, device=x2.device)
        tl = torch.zeros(n, dtype=acc, device=x2.device)
        gdt = saved_grad_dtype(x2.dtype)
        w_gi = weight if weight.dtype == gdt else weight.to(gdt)
        need_in = x2.requires_grad
        gi = torch.zeros((n, d) if need_in else (0, d), dtype=gdt, device=x2.device)
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        gb = torch.zeros(v_loc, dtype=acc, device=weight.device) if bias is not None else None
        rows = (tgt != ignore_index).nonzero().squeeze(1)  # only rows that contribute; the same on every rank
        for r0 in range(0, rows.numel(), step):
            sel = rows[r0:r0 + step]
            e = x2[sel]
            ef = e if e.dtype == acc else e.to(acc)
            own = owned[sel]
            idx = torch.where(own, tgt_local[sel], 0).unsqueeze(1)
            if v_loc:
                z = (torch.addmm(bias, e, weight.t()) if bias is not None else e @ weight.t()).to(acc)
                if scale != 1.0:
                    z.mul_(scale)
                tl_r = torch.where(own, z.gather(1, idx).squeeze(1), 0.0)
                m, am = z.max(1)
                torch.ops.aten._softmax.out(z, 1, False, out=z)  # in place: P_r
                lse_r = m - torch.log(z.gather(1, am.unsqueeze(1)).squeeze(1))  # m - log(p_max) = m + log sum
                lse_r = torch.where(m == float("-inf"), m, lse_r)  # a row this shard masks out entirely
                p_y = z.gather(1, idx).squeeze(1)
                z.scatter_(1, idx, torch.where(own, 0.0, p_y).unsqueeze(1))  # the target entry leaves P_r
                om_r = torch.where(own, z.sum(1), 0.0)
            else:  # an empty shard
                z = ef.new_zeros((sel.numel(), 0))
                tl_r = om_r = ef.new_zeros(sel.numel())
                lse_r = torch.full_like(tl_r, float("-inf"))
            l, t_logit, om, _, f = _merge(lse_r, tl_r, om_r, None, own, group)
            lse[sel], tl[sel] = l, t_logit
            a = a0[sel] if zc is None else a0[sel] + zc[sel] * l
            # rows this shard cannot see (f == 0: all its logits -inf) contribute nothing, not 0 * NaN
            dead = f == 0
            if v_loc and bool(dead.any()):
                z.masked_fill_(dead.unsqueeze(1), 0.0)
            row = (a * f * scale).unsqueeze(1)
            t = torch.where(own, (-a * om + (a - b0[sel])) * scale, 0.0)
            has_t = bool(own.any())
            if need_in:
                g = (z @ w_gi.to(acc)) if w_gi.dtype != acc else z @ w_gi
                g.mul_(row)
                if has_t:
                    g.add_(w_gi.index_select(0, idx.squeeze(1)).to(acc) * t.unsqueeze(1))
                gi[sel] = g.to(gdt)
            gw.addmm_(z.t(), ef * row)
            if has_t:
                gw.index_add_(0, idx.squeeze(1), ef * t.unsqueeze(1))
            if gb is not None:
                gb.add_(z.t() @ row.squeeze(1))
                if has_t:
                    gb.index_add_(0, idx.squeeze(1), t)
        if reduce_input_grad and need_in:
            dist.all_reduce(gi, op=dist.ReduceOp.SUM, group=group)
        loss, zl = compose_loss(lse, tl, None, target=tgt, probs=None, v=v, class_weight=class_weight,
                                token_weight=token_weight, ignore_index=ignore_index, reduction=reduction,
                                label_smoothing=0.0, lse_square_scale=z_scale)
        ctx.save_for_backward(gi, gw, gb)
        ctx.dtypes = (x2.dtype, weight.dtype, bias.dtype if bias is not None else None)
        zl = zl if zl is not None else loss.new_zeros(())
        ctx.mark_non_differentiable(zl)
        return loss, zl

    @staticmethod
    def backward(ctx, grad_loss, _grad_zl):
        if torch.is_grad_enabled():
            raise RuntimeError("double backward (create_graph=True) through vocabulary-parallel cross-entropy is not "
                               "supported; use F.cross_entropy(F.linear(...)) for higher-order gradients")
        gi, gw, gb = ctx.saved_tensors
        dx, dw, db = ctx.dtypes
        acc = gw.dtype
        gl = grad_loss.reshape(()).to(acc)
        gx = (gi.to(acc) * gl).to(dx) if ctx.needs_input_grad[0] else None
        return (gx, (gw * gl).to(dw), (gb * gl).to(db) if gb is not None else None) + (None,) * 13


def _local(t, what: str, want_shard: bool):
    """A DTensor argument -> its local tensor (differentiably), checking its placement."""
    if not is_dtensor(t):
        return t, None
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"{what}: a DTensor on a {mesh.ndim}-d device mesh; vocabulary-parallel cross-entropy "
                         "takes a 1-d mesh (pass the vocabulary dimension's sub-mesh, e.g. mesh['tp'])")
    placement = t.placements[0]
    if want_shard and not (isinstance(placement, Shard) and placement.dim == 0):
        raise ValueError(f"{what}: a DTensor sharded by vocabulary rows is expected (placements (Shard(0),)), got "
                         f"{t.placements}")
    if not want_shard and not isinstance(placement, Replicate):
        raise ValueError(f"{what}: a replicated DTensor is expected (placements (Replicate(),)), got {t.placements}")
    return t.to_local(), mesh


# A deliberate graph break (c10d collectives run eagerly; fullgraph=True cannot include it). torch's lazy
# form of torch._dynamo.disable: importing Dynamo here would add ~1 s to ``import smxcompile``.
@torch._disable_dynamo
def vocab_parallel_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    process_group=None,
    bias: torch.Tensor | None = None,
    class_weight: torch.Tensor | None = None,
    token_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    scale: float = 1.0,
    softcap: float | None = None,
    lse_square_scale: float = 0.0,
    return_lse: bool = False,
    return_z_loss: bool = False,
    dtype: torch.dtype | None = None,
    filter_eps: float | str | None = "auto",
    precise_grad: bool = False,
    chunk_bytes: int | None = None,
    reduce_input_grad: bool = True,
):
    """Cut cross-entropy with the classifier sharded by vocabulary rows across ``process_group``.

    Equals :func:`smxcompile.linear_cross_entropy` for the full classifier ``W = cat([weight of rank 0, weight of
    rank 1, ...])``, forward and backward, on every rank; no rank holds logits, not even its own N x V_r slice.
    Communication: forward, one all_gather of 9 numbers per rank and all_reduces of 4N (5N with label smoothing)
    fp32 numbers; backward, one all_reduce of grad_input (N x D).

    Args:
        input: embeddings ``(*, D)``, the same on every rank (a tensor, or a DTensor placed ``(Replicate(),)``).
        weight: this rank's rows ``(V_r, D)`` of the classifier, in group-rank order (shards may differ in size
            or be empty); or a DTensor of the full ``(V, D)`` classifier placed ``(Shard(0),)`` on a 1-d mesh.
        target: class indices ``(*)`` in ``[0, V)`` (global ids), the same on every rank.
        process_group: the group sharding the vocabulary (default: the DTensor's mesh group, else the default).
        bias: this rank's slice ``(V_r,)`` of the bias, or a DTensor sharded like ``weight``.
        class_weight: the full per-class weights ``(V,)``, replicated.
        token_weight, ignore_index, reduction, label_smoothing, scale, softcap, lse_square_scale,
        return_lse, return_z_loss, dtype, filter_eps, precise_grad, chunk_bytes: as in
            :func:`smxcompile.linear_cross_entropy`.
        reduce_input_grad: sum grad_input over the group (default); False leaves each rank its partial
            ``G_r @ W_r`` (to sum yourself, e.g. a reduce-scatter for sequence parallelism).

    Returns:
        As :func:`smxcompile.linear_cross_entropy` (the same on every rank); the shards' grads hold this rank's rows.

    Raises:
        NotImplementedError: probability targets (an N x V target defeats the sharding).
        ValueError: targets, embeddings or options that differ between ranks (checked in the first
            collective), a DTensor with another placement or a 2-d mesh, ``class_weight`` not of the global
            ``(V,)`` shape, and everything :func:`smxcompile.linear_cross_entropy` rejects.
        IndexError: a target outside ``[0, V)`` that is not ``ignore_index`` (CPU).
        RuntimeError: torch.distributed unavailable or not initialised.

    Runs eagerly (a graph break under ``torch.compile``). Source: Wijmans et al. 2024, Milakov & Gimelshein 2018,
    Shoeybi et al. 2019 (Megatron-LM).
    """
    dist = _dist()
    if not dist.is_initialized():
        raise RuntimeError("vocabulary-parallel cross-entropy: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    prep, shard = _checked_on_every_rank(
        input, weight, target, process_group=process_group, bias=bias, class_weight=class_weight,
        token_weight=token_weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        scale=scale, softcap=softcap, lse_square_scale=lse_square_scale, return_lse=return_lse,
        return_z_loss=return_z_loss, dtype=dtype, grad_options=(filter_eps, bool(precise_grad)),
        chunk_bytes=chunk_bytes, reduce_input_grad=reduce_input_grad)
    x2, tgt, weight, bias, class_weight = prep["x2"], prep["tgt"], prep["weight"], prep["bias"], prep["cw"]
    if not config.use_triton(x2):
        x2, weight, bias = fp32_logit_operands(x2, weight, bias)     # fp32 logits, as on one device
    vocab = shard.vocab_size
    start, stop = shard.start, shard.start + shard.size
    owned = (tgt != ignore_index) & (tgt >= start) & (tgt < stop)
    tgt_local = torch.where(owned, tgt - start, -1)
    out_dtype = linear_loss_dtype(dtype, prep["input"])
    # a target outside [0, V) (CUDA: not checked above, to avoid a host sync) is owned by no rank: NaN, as the
    # single-device kernels give, instead of a finite loss with a zero target logit
    bad = (tgt != ignore_index) & ((tgt < 0) | (tgt >= vocab))
    if prep["fused"]:
        loss, zl = _fused_loss(x2, weight, bias, tgt, tgt_local, owned, class_weight, prep=prep, shard=shard,
                               ignore_index=ignore_index, reduction=reduction, lse_square_scale=lse_square_scale,
                               scale=scale, chunk_bytes=chunk_bytes, reduce_input_grad=reduce_input_grad)
        loss = torch.where(bad.any(), float("nan"), loss)
        return finish_output(loss, zl if lse_square_scale else None, None, lead_shape=prep["lead"],
                             reduction=reduction, out_dtype=out_dtype, return_lse=False, return_z_loss=return_z_loss)
    eps = float(label_smoothing)
    lse, tl, ws = _VocabParallelStats.apply(
        x2, weight, bias, tgt_local=tgt_local, owned=owned,
        cw_local=class_weight[start:stop] if class_weight is not None else None, group=prep["group"],
        scale=float(scale), softcap=None if softcap is None else float(softcap), need_ws=bool(eps),
        chunk_bytes=int(chunk_bytes or 0), grad_options=prep["grad_options"],
        reduce_input_grad=bool(reduce_input_grad))
    tl = torch.where(bad, float("nan"), tl)
    loss, zl = compose_loss(lse, tl, ws if eps else None, target=tgt, probs=None, v=vocab, class_weight=class_weight,
                            token_weight=prep["tw"], ignore_index=int(ignore_index), reduction=reduction,
                            label_smoothing=eps, lse_square_scale=float(lse_square_scale))
    return finish_output(loss, zl, lse, lead_shape=prep["lead"], reduction=reduction, out_dtype=out_dtype,
                         return_lse=return_lse, return_z_loss=return_z_loss)


def _checked_on_every_rank(input, weight, target, *, process_group, **options) -> tuple[dict, VocabShard]:
    """This rank's argument checks (:func:`_prepare`), then collective 1 (:func:`_exchange`), which every rank
    joins whatever its checks found, so that a rank that rejects its arguments makes every rank raise instead
    of leaving the others waiting; then the checks of the replicated values. -> (``_prepare``'s dict, shard)."""
    try:
        prep = _prepare(input, weight, target, process_group=process_group, **options)
    except Exception as error:  # re-raised by _exchange, after the collective
        if is_dtensor(weight):
            process_group = weight.device_mesh.get_group() if process_group is None else process_group
        _exchange(process_group, 0, None, None, None, None, (), error)  # raises on every rank
        raise  # (not reached)
    shard = _exchange(prep["group"], prep["weight"].shape[0], prep["x2"].detach(), prep["tgt"], prep["cw"],
                      prep["tw"], prep["options"], None)
    # from here on every check sees the same values on every rank (verified above): all raise alike
    vocab, tgt = shard.vocab_size, prep["tgt"]
    if prep["vocab_size"] is not None and prep["vocab_size"] != vocab:
        raise ValueError(f"weight's DTensor shape says V = {prep['vocab_size']} but the shards hold {vocab} rows")
    check_options(tgt, tgt.shape[0], vocab, class_weight=prep["cw"], token_weight=prep["tw"],
                  ignore_index=options["ignore_index"], reduction=options["reduction"],
                  label_smoothing=options["label_smoothing"], softcap=options["softcap"], scale=options["scale"],
                  lse_square_scale=options["lse_square_scale"], what="input", device=prep["x2"].device,
                  dtype=options["dtype"])
    check_range(tgt, options["ignore_index"], vocab)
    return prep, shard


def _fused_loss(x2, weight, bias, tgt, tgt_local, owned, class_weight, *, prep, shard, ignore_index, reduction,
                lse_square_scale, scale, chunk_bytes, reduce_input_grad):
    """(loss, z_loss) of the fused path (:class:`_VocabParallelFused`), rows per chunk from the largest shard so
    that every rank runs the same chunks."""
    cb = int(chunk_bytes or 0)
    step = max(rows_per_chunk(max(shard.sizes), cb, acc_dtype(x2)), MIN_CHUNK_ROWS if not cb else 1)
    # positional: apply binds keywords by forward's own signature, which autocast_off's wrapper hides
    return _VocabParallelFused.apply(x2, weight, bias, tgt, tgt_local, owned, class_weight, prep["tw"],
                                     shard.vocab_size, int(ignore_index), reduction, float(lse_square_scale),
                                     float(scale), prep["group"], step, bool(reduce_input_grad))


def _prepare(input, weight, target, *, process_group, bias, class_weight, token_weight, ignore_index, reduction,
             label_smoothing, scale, softcap, lse_square_scale, return_lse, return_z_loss, dtype, grad_options,
             chunk_bytes, reduce_input_grad) -> dict:
    """This rank's argument checks (no communication) -> the flattened, local tensors and the options;
    ``grad_options`` ``(filter_eps, precise_grad)`` of the backward."""
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    vocab_size = weight.shape[0] if is_dtensor(weight) else None
    weight, mesh = _local(weight, "weight", True)
    bias, bmesh = _local(bias, "bias", True) if bias is not None else (None, None)
    input, _ = _local(input, "input", False)
    target, _ = _local(target, "target", False)
    class_weight, _ = _local(class_weight, "class_weight", False) if class_weight is not None else (None, None)
    if mesh is not None:
        mgroup = mesh.get_group()
        if process_group is not None and process_group != mgroup:
            raise ValueError("process_group differs from the group of weight's device mesh")
        process_group = mgroup
    if bias is not None and (bmesh is None) != (mesh is None):
        raise TypeError("weight and bias must both be DTensors or both plain tensors")
    input, weight, bias = check_linear(input, weight, bias, rows="V_r")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a Tensor, got {type(target).__name__}")
    if target.dtype.is_floating_point:
        raise NotImplementedError("vocabulary-parallel cross-entropy takes class-index targets; probability "
                                  "targets (N x V) would defeat the sharding")
    if class_weight is not None and not isinstance(class_weight, torch.Tensor):
        raise ValueError(f"class_weight must be a tensor of shape (V,), got {type(class_weight).__name__}")
    if token_weight is not None and not isinstance(token_weight, torch.Tensor):
        raise ValueError(f"token_weight must be a tensor, got {type(token_weight).__name__}")
    lead = tuple(input.shape[:-1])
    x2 = input.reshape(row_count(lead), input.shape[-1])
    tgt, _ = split_targets(target, lead, weight.shape[0], "input")
    tw = None if token_weight is None else token_weight.reshape(-1)
    fused = bool(softcap is None and not label_smoothing and reduction != "none"
                 and not return_lse and not config.use_triton(x2) and needs_grad(x2, weight, bias)
                 and not needs_grad(tw))
    options = (reduction, int(ignore_index) if isinstance(ignore_index, int) else repr(ignore_index),
               repr(label_smoothing), repr(scale), repr(softcap), repr(lse_square_scale), repr(chunk_bytes),
               bool(return_lse), bool(return_z_loss), repr(dtype), repr(grad_options), bool(reduce_input_grad),
               str(x2.dtype), tuple(lead), int(x2.shape[1]), fused, bias is None,
               needs_grad(x2), needs_grad(weight, bias), needs_grad(tw), x2.device.type)
    grad_options = (resolve_filter_eps(grad_options[0], x2.dtype), grad_options[1])
    return {"group": process_group, "x2": x2, "tgt": tgt, "weight": weight, "bias": bias, "cw": class_weight,
            "tw": tw, "lead": lead, "fused": fused, "options": options, "vocab_size": vocab_size, "input": input,
            "grad_options": grad_options}

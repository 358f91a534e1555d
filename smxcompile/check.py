"""The ``check`` option: run each planned rewrite on the real example inputs and compare with eager."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.fx

from .options import SmxOptions

log = logging.getLogger("smxcompile")


def _capture(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], wanted: set[str]) -> dict[str, Any] | None:
    """Run ``gm`` on clones of the example inputs, keeping the values of the ``wanted`` nodes."""
    if any(not isinstance(x, torch.Tensor) and not isinstance(x, (int, float, bool)) for x in example_inputs):
        return None
    if any(isinstance(x, torch.Tensor) and isinstance(x, torch._subclasses.FakeTensor) for x in example_inputs):
        return None
    values: dict[str, Any] = {}

    class Keep(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.name in wanted:
                values[n.name] = out
            return out

    args = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with torch.no_grad():
        Keep(gm).run(*args)
    return values


def check_sites(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: SmxOptions) -> frozenset[str]:
    """Names of anchor nodes whose rewrite disagrees with eager on ``example_inputs``.

    Each rewritten site is re-run through its smx op on the captured input values and compared
    with the original subgraph's output (``torch.allclose`` with the options' tolerances, fp32;
    NaNs must sit in the same places).
    """
    from .passes.cross_entropy import claimed_nodes, find_ce_sites, input_nodes, run_site
    from .passes.framework import subgraphs
    from .passes.softmax import find_softmax_sites

    from .passes.attention import claimed_nodes as attention_claimed, find_attention_sites
    from .passes.attention import input_nodes as attention_inputs, run_site as run_attention
    from .passes.softmax_topk import claimed_nodes as topk_claimed, find_softmax_topk_sites
    from .passes.softmax_topk import run_site as run_topk

    ce = [m for m in find_ce_sites(gm.graph, options) if m.action == "rewritten"]
    at = find_attention_sites(gm.graph, options, exclude=claimed_nodes(ce))
    tk = find_softmax_topk_sites(gm.graph, options, exclude=claimed_nodes(ce) | attention_claimed(at))
    tk_matches = {m.key: m for m in tk if m.action == "rewritten"}
    matches = {m.key: m for m in find_softmax_sites(gm.graph, options, exclude=claimed_nodes(ce) | attention_claimed(at)
                                                    | topk_claimed(tk, kept=True))
               if m.action == "rewritten"}
    ce_matches = {m.key: m for m in ce}
    # a requested normalizer changes the math on purpose: only softmax sites can be checked against eager
    at_matches = {m.key: m for m in at if m.action == "rewritten" and m.normalizer == "softmax"}
    # sites inside higher-order-op bodies (checkpoint, cond) cannot be captured by the interpreter: keep them
    unverifiable = {m.key for prefix, g, _ in subgraphs(gm.graph)[1:]
                    for m in [*find_softmax_sites(g, options, prefix=prefix), *find_ce_sites(g, options, prefix=prefix),
                              *find_attention_sites(g, options, prefix=prefix),
                              *find_softmax_topk_sites(g, options, prefix=prefix)]
                    if m.action == "rewritten"}
    if unverifiable:
        log.warning("smx check: %d site(s) inside subgraphs cannot be checked; they are kept", len(unverifiable))
    wanted = set(matches) | set(ce_matches) | set(at_matches) | set(tk_matches)
    for m in tk_matches.values():
        wanted.update(n.name for n in [m.x, m.values_out, *m.indices_out] if n is not None)
    for m in ce_matches.values():
        wanted.update(n.name for n in input_nodes(m))
    for m in at_matches.values():
        wanted.update(n.name for n in attention_inputs(m))
    for m in matches.values():
        wanted.add(m.x.name)
        if m.mask is not None:
            wanted.add(m.mask.name)
    try:
        values = _capture(gm, example_inputs, wanted)
    except Exception as e:  # the graph could not run eagerly here: keep every site, say why
        log.warning("smx check: could not run the graph on the example inputs (%s); sites are kept", e)
        return frozenset(matches) | frozenset(ce_matches) | frozenset(at_matches) | frozenset(tk_matches) | unverifiable
    if values is None:
        log.warning("smx check: example inputs are not real tensors; sites are kept")
        return frozenset(matches) | frozenset(ce_matches) | frozenset(at_matches) | frozenset(tk_matches) | unverifiable
    bad = set(unverifiable)
    for name, m in ce_matches.items():
        try:
            with torch.no_grad():
                ours = run_site(m, values)
        except Exception as e:  # e.g. a target out of range: torch's error, the original is kept
            log.warning("smx check: site %s (%s) failed on the example inputs (%s); the original is kept",
                        name, m.kind, e)
            bad.add(name)
            continue
        if not _close(ours, values[name], options):
            log.warning("smx check: site %s (%s) disagrees with eager; the original is kept", name, m.kind)
            bad.add(name)
    for name, m in at_matches.items():
        try:
            with torch.no_grad():
                ours = run_attention(m, values)
        except Exception as e:
            log.warning("smx check: site %s (attention) failed on the example inputs (%s); the original is kept", name, e)
            bad.add(name)
            continue
        if not _close(ours, values[name], options):
            log.warning("smx check: site %s (attention) disagrees with eager; the original is kept", name)
            bad.add(name)
    for name, m in tk_matches.items():
        with torch.no_grad():
            vals, idx = run_topk(m, values)
        ok = True
        if m.values_out is not None and vals is not None:
            ok = _close(vals, values[m.values_out.name], options)
        if ok and m.indices_out:
            # ties may pick other columns: compare the logits the indices point at
            p = values[m.x.name]
            ref_idx = values[m.indices_out[0].name]
            if m.form == "argmax(softmax)" and not m.keepdim:
                idx, ref_idx = idx.unsqueeze(m.dim), ref_idx.unsqueeze(m.dim)
            ok = idx.shape == ref_idx.shape and _close(p.gather(m.dim, idx), p.gather(m.dim, ref_idx), options)
        if not ok:
            log.warning("smx check: site %s (softmax_topk) disagrees with eager; the original is kept", name)
            bad.add(name)
    for name, m in matches.items():
        x = values[m.x.name]
        if m.pre_cast is not None:
            x = x.to(m.pre_cast)
        op = torch.ops.smx.softmax.default if m.kind == "softmax" else torch.ops.smx.log_softmax.default
        with torch.no_grad():
            ours = op(x, m.dim, float(m.scale), m.softcap, values.get(m.mask.name) if m.mask is not None else None,
                      m.out_dtype, False)[0]
        if not _close(ours, values[name], options):
            log.warning("smx check: site %s (%s) disagrees with eager; the original is kept", name, m.kind)
            bad.add(name)
    return frozenset(bad)


def _close(ours: torch.Tensor, ref: torch.Tensor, options: SmxOptions) -> bool:
    return ours.shape == ref.shape and torch.equal(ours.isnan(), ref.isnan()) and torch.allclose(
        ours.float().nan_to_num(), ref.float().nan_to_num(), rtol=options.check_rtol, atol=options.check_atol
    )

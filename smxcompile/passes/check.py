"""The ``check`` option: run each planned rewrite on the real example inputs and compare with eager.

Every rewrite kind of :data:`~smxcompile.passes.manager.PASSES` is covered through the pass protocol
(:meth:`~smxcompile.passes.protocol.RewritePass.run_site` and ``agrees``), over the same sites the rewrite will
take (swapped regions and claimed nodes excluded the same way).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.fx

from ..options import SmxOptions
from .manager import find_all, subgraphs
from .naming import swapped_regions
from .patterns.graph import functorch_op
from .protocol import PassContext

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


def _rewritten(graph, options: SmxOptions, prefix: str = "", skip: frozenset[str] = frozenset()) -> list:
    """``(pass, match)`` of every site of ``graph`` the rewrite would take (``skip``: keys of sites kept)."""
    swapped, _ = swapped_regions(graph, "", set())
    ctx = PassContext(options, skip=skip, prefix=prefix, functorch=functorch_op(graph))
    return [(p, m) for p, m in find_all(graph, ctx, swapped) if m.action == "rewritten"]


def check_sites(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: SmxOptions,
                skip: frozenset[str] = frozenset(), checked: frozenset[str] = frozenset()) -> frozenset[str]:
    """Keys of the sites whose rewrite disagrees with eager on ``example_inputs`` (the backend keeps them).

    ``skip``: keys of sites already kept (the analysis then offers what they leave to later passes);
    ``checked``: keys already found to agree (not run again).

    Each rewritten site is re-run through its replacement on the captured input values and compared with the
    original subgraph's output (``torch.allclose`` with the options' tolerances, in fp32; NaNs must sit in the
    same places). Sites inside higher-order-op bodies (checkpoint, cond) cannot be captured: they are kept, as
    are all sites when the graph cannot run eagerly on the inputs.
    """
    todo = [(p, m) for p, m in _rewritten(gm.graph, options, skip=skip) if p.checkable(m) and m.key not in checked]
    unverifiable = {m.key for prefix, g, _ in subgraphs(gm.graph)[1:]
                    for _, m in _rewritten(g, options, prefix, skip)} - checked
    if unverifiable:
        log.warning("smx check: %d site(s) inside subgraphs cannot be checked; they are kept", len(unverifiable))
    if not todo and not unverifiable:
        return frozenset()
    wanted = {n.name for p, m in todo for n in [*p.check_inputs(m), *p.check_nodes(m)]}
    everything = frozenset(m.key for _, m in todo) | unverifiable
    try:
        values = _capture(gm, example_inputs, wanted)
    except Exception as e:  # the graph could not run eagerly here: keep every site, say why
        log.warning("smx check: could not run the graph on the example inputs (%s); sites are kept", e)
        return everything
    if values is None:
        log.warning("smx check: the example inputs are not all real tensors and numbers (symbolic sizes under "
                    "dynamic shapes, or fake tensors): the graph cannot be run here; sites are kept")
        return everything
    bad = set(unverifiable)

    for p, m in todo:
        # never tighter than two units in the last place of the coarsest dtype the site computes in (bf16
        # inputs: eager's own result is only that exact, whatever dtype it is cast to afterwards)
        ins = [values[n.name] for n in p.check_inputs(m)]
        eps = max([torch.finfo(t.dtype).eps for t in ins if isinstance(t, torch.Tensor) and t.is_floating_point()],
                  default=0.0)
        rtol = max(options.check_rtol, 2 * eps)

        def close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = rtol) -> bool:
            return ours.shape == ref.shape and torch.equal(ours.isnan(), ref.isnan()) and torch.allclose(
                ours.float().nan_to_num(), ref.float().nan_to_num(), rtol=rtol, atol=options.check_atol)

        try:
            with torch.no_grad():
                ours = p.run_site(m, values)
            ok = p.agrees(m, ours, values, close)
        except Exception as e:  # e.g. a target out of range: torch's error, the original is kept
            log.warning("smx check: site %s (%s) failed on the example inputs (%s); the original is kept",
                        m.key, m.kind, e)
            bad.add(m.key)
            continue
        if not ok:
            log.warning("smx check: site %s (%s) disagrees with eager; the original is kept", m.key, m.kind)
            bad.add(m.key)
    return frozenset(bad)


__all__ = ["check_sites"]

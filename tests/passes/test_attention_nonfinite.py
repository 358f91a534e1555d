"""NaN and inf in q or k under rewritten attention: eager's values where a mask selects them away.

Eager ``masked_fill`` / ``where`` replaces a masked score whatever it was; torch's fused kernels add a bool mask
as -inf, so an inf or NaN score at a masked key would turn a row NaN that eager leaves finite (and a causal
call selects inside the kernel, so a NaN key must not poison the rows before it). The rewritten graph must
give eager's NaN pattern and values. One case differs on purpose (the docstring of
``graph_attention``'s non-finite guard says why): a row that *sees* a key holding an inf is NaN, where eager
gives the row without that key when every such score happens to be -inf.
"""

from __future__ import annotations

import pytest
import torch

from pass_helpers import rewrite

L = 8


def pad_fill(q, k, v, keep):                 # DistilBERT: a bool padding mask, masked_fill(-inf)
    s = q @ k.transpose(-2, -1) / 2
    return s.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1) @ v


def pad_min(q, k, v, keep):
    s = q @ k.transpose(-2, -1) / 2
    return s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min).softmax(-1) @ v


def runtime_causal(q, k, v, keep):           # a causal bool mask that is a run-time input: a row per query
    s = q @ k.transpose(-2, -1) / 2
    return torch.where(keep, s, torch.finfo(s.dtype).min).softmax(-1) @ v


def const_causal(q, k, v, keep):             # a constant causal mask: becomes is_causal=True
    s = q @ k.transpose(-2, -1) / 2
    c = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~c, float("-inf")).softmax(-1) @ v


def no_mask(q, k, v, keep):
    return (q @ k.transpose(-2, -1) / 2).softmax(-1) @ v


def _inputs(fn, value, at):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, L, 4, generator=g) for _ in range(3))
    if at == "padded key":
        k[1, :, 1, 2] = value          # batch 1's first 3 keys are padding
    elif at == "key 5":
        k[0, :, 5, 2] = value
    else:
        q[0, 1, 3, 0] = value
    if fn in (pad_fill, pad_min):
        keep = torch.ones(2, L, dtype=torch.bool)
        keep[1, :3] = False
    else:
        keep = torch.ones(L, L, dtype=torch.bool).tril()
    return q, k, v, keep


def _outputs(fn, args):
    r = rewrite(fn, *args, check_values=False)
    assert [s.action for s in r.report if s.kind == "attention"] == ["rewritten"], str(r.report)
    got = r.gm(*r.inputs)
    return (got[0] if isinstance(got, (tuple, list)) else got), fn(*args)


def _differs_on_purpose(fn, value, at) -> bool:
    """An inf (not NaN) that some rows see through a selection mask: those rows are NaN here, where eager's
    value depends on the sign of each infinite score (``test_inf_key_seen_by_some_rows``)."""
    if value == value and fn is runtime_causal:
        return at != "query" or value > 0     # a query's +inf: eager may average the masked keys instead
    return value == value and fn in (pad_fill, pad_min) and at == "key 5"


EXACT = [(fn, value, at) for fn in (pad_fill, pad_min, runtime_causal, const_causal, no_mask)
         for value in (float("nan"), float("inf"), -float("inf")) for at in ("padded key", "key 5", "query")
         if not _differs_on_purpose(fn, value, at)]


@pytest.mark.parametrize("fn,value,at", EXACT, ids=lambda x: getattr(x, "__name__", str(x)))
def test_nonfinite_inputs_give_eagers_values(fn, value, at):
    got, want = _outputs(fn, _inputs(fn, value, at))
    assert torch.equal(got.isnan(), want.isnan()), (got.isnan().sum(), want.isnan().sum())
    torch.testing.assert_close(got.nan_to_num(0), want.nan_to_num(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [pad_fill, runtime_causal], ids=lambda f: f.__name__)
def test_inf_key_seen_by_some_rows(fn):
    """Rows that do not see the inf key are eager's; rows that see it are NaN (eager's NaN rows among them)."""
    args = _inputs(fn, float("inf"), "key 5")
    got, want = _outputs(fn, args)
    keep = args[3]
    seen = (keep[:, None, None, :] if fn is pad_fill else keep)[..., 5].expand(2, 2, L).clone()
    seen[1:] = False                   # the inf is in batch 0's key 5
    assert bool(got[seen].isnan().all()) and bool(want.isnan().any(-1)[~seen].logical_not().all())
    assert bool(want.isnan().any(-1)[seen].sum() < seen.sum())      # eager leaves some of them finite
    torch.testing.assert_close(got[~seen], want[~seen], rtol=1e-5, atol=1e-6)

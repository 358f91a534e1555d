"""Attention with a sink: the scores extended along the key index by one column of logits that q and k do not
reach (a learned logit per head), normalized with them, that column's weights dropped before the value
contraction. gpt-oss (transformers' eager attention: the sink last, a row shift, a padding mask, GQA) and
x-transformers' ``attn_sink`` (the sink first) are spelled here in our own words. Each is rewritten and its
forward and gradients (q, k, v and the sink) pass ``|ours - gold| <= |torch - gold| + tol`` against an fp64
gold; a column computed from the scores, or a slice dropping a key, is not a sink."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pass_helpers import check_against_gold, rewrite

B, H, HKV, L, E = 2, 4, 2, 6, 8
MIN = torch.finfo(torch.float32).min


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def gpt_oss(q, k, v, sinks, mask):          # K and V repeated to q's heads, the sink last, the row max subtracted
    k, v = (t.repeat_interleave(H // HKV, dim=1) for t in (k, v))
    s = q @ k.transpose(2, 3) * E ** -0.5 + mask
    x = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)], dim=-1)
    x = x - x.max(dim=-1, keepdim=True).values
    return F.softmax(x, dim=-1, dtype=x.dtype)[..., :-1] @ v


def sink_first(q, k, v, sinks):             # the sink first, dropped with [..., 1:]
    s = torch.einsum("bhid,bhjd->bhij", q, k) * E ** -0.5
    c = sinks[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
    return torch.einsum("bhij,bhjd->bhid", torch.cat((c, s), dim=-1).softmax(-1)[..., 1:], v)


def causal_sink(q, k, v, sinks):            # a causal fill before the sink column
    s = (q @ k.mT * E ** -0.5).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    x = torch.cat([s, sinks.view(H, 1, 1).expand(B, H, L, 1)], -1)
    return x.softmax(-1)[..., :L] @ v


def column_from_scores(q, k, v, sinks):     # a column computed from the scores: no sink
    s = q @ k.mT
    return torch.cat([s, s.mean(-1, keepdim=True)], -1).softmax(-1)[..., :-1] @ v


def slice_drops_a_key(q, k, v, sinks):      # the last key's weight dropped: rows no longer sum to 1
    return (q @ k.mT).softmax(-1)[..., :-1] @ v[..., :-1, :]


def sink_kept_other_end(q, k, v, sinks):    # the sink appended last, a key dropped at the front
    x = torch.cat([q @ k.mT, sinks.view(H, 1, 1).expand(B, H, L, 1)], -1)
    return x.softmax(-1)[..., 1:] @ torch.cat([v[..., 1:, :], v[..., :1, :]], -2)


def _padding():
    keep = torch.arange(L).expand(B, L) >= torch.tensor([[0], [3]])        # batch 1 left-padded
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return torch.where(keep[:, None, None, :] & causal, 0.0, MIN)


CASES = {
    "gpt_oss": (gpt_oss, lambda: (_randn(B, H, L, E, seed=0), _randn(B, HKV, L, E, seed=1),
                                  _randn(B, HKV, L, E, seed=2), _randn(H, seed=3), _padding())),
    "sink_first": (sink_first, lambda: (*(_randn(B, H, L, E, seed=i) for i in range(3)), _randn(H, seed=3))),
    "causal_sink": (causal_sink, lambda: (*(_randn(B, H, L, E, seed=i) for i in range(3)), _randn(H, seed=3))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sink_is_rewritten_and_exact(name):
    fn, make = CASES[name]
    args = make()
    r = rewrite(fn, *args)
    att = [s for s in r.report if s.kind == "attention"]
    assert [s.action for s in att] == ["rewritten"] and "sink column" in att[0].detail, str(r.report)
    check_against_gold(r, fn, args, _randn(B, H, L, E, seed=11).double(), tol=1e-5)


@pytest.mark.parametrize("fn", [column_from_scores, slice_drops_a_key, sink_kept_other_end])
def test_near_misses_are_not_sinks(fn):
    q, k, v = (_randn(B, H, L, E, seed=i) for i in range(3))
    r = rewrite(fn, q, k, v, _randn(H, seed=3))
    assert [s.action for s in r.report if s.kind == "attention"] != ["rewritten"], str(r.report)


def test_a_row_every_key_masks_weighs_the_sink_only():
    """Batch 1's first query rows see no key (all masked at finfo.min): eager's weights fall on the sink alone,
    an output of 0, and so do the fused call's (checked against eager)."""
    fn, make = CASES["gpt_oss"]
    q, k, v, sinks, mask = make()
    mask[1, :, :2] = MIN
    r = rewrite(fn, q, k, v, sinks, mask)
    assert [s.action for s in r.report if s.kind == "attention"] == ["rewritten"], str(r.report)
    check_against_gold(r, fn, (q, k, v, sinks, mask), _randn(B, H, L, E, seed=11).double(), tol=1e-5)


def test_sink_exports_to_onnx(tmp_path):
    """The rewritten site exports as the augmented call and onnxruntime gives eager's output."""
    ort = pytest.importorskip("onnxruntime")
    import smxcompile

    class Sinks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(_randn(H, seed=3))

        def forward(self, q, k, v, mask):
            return gpt_oss(q, k, v, self.sinks, mask)

    model, args = Sinks().eval(), CASES["gpt_oss"][1]()
    args = (*args[:3], args[4])
    out = smxcompile.export_onnx(model, args, str(tmp_path / "sink.onnx"))
    assert [s.action for s in out.report if s.kind == "attention"] == ["rewritten"], str(out.report)
    sess = ort.InferenceSession(str(tmp_path / "sink.onnx"))
    got = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})[0]
    torch.testing.assert_close(torch.from_numpy(got), model(*args).detach(), rtol=1e-5, atol=1e-6)


def test_infinite_sinks_and_a_non_finite_key_keep_eagers_values():
    """A sink of -inf weighs nothing (plain attention), one of +inf makes its rows NaN (eager's inf - inf); with a
    causal mask, an inf key makes NaN only the rows that see it, as in eager."""
    fn, make = CASES["causal_sink"]
    q, k, v, sinks = make()
    sinks[0], sinks[1] = float("-inf"), float("inf")
    r = rewrite(fn, q, k, v, sinks)
    assert [s.action for s in r.report if s.kind == "attention"] == ["rewritten"], str(r.report)
    bad = k.clone()
    bad[0, 2, -1] = float("inf")
    got, want = r.gm(*[bad if a is k else a for a in r.inputs])[0], fn(q, bad, v, sinks)
    assert want.isnan().any() and not want.isnan().all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


def floored_sink(q, k, v, sinks, mask):      # a floor after the masks lifts a row masked whole: eager then weighs
    s = torch.clamp(q @ k.mT + mask, min=MIN)   # its keys uniformly against the sink
    x = torch.cat([s, sinks.view(H, 1, 1).expand(B, H, L, 1)], -1)
    return x.softmax(-1)[..., :-1] @ v


def fill_beside_sink(q, k, v, sinks, keep):  # a finite fill below the sink
    s = torch.where(keep, q @ k.mT, -1e4)
    return torch.cat([s, sinks.view(H, 1, 1).expand(B, H, L, 1)], -1).softmax(-1)[..., :-1] @ v


@pytest.mark.parametrize("fn", [floored_sink, fill_beside_sink])
def test_sinks_beside_a_floor_or_a_finite_fill_are_left_as_written(fn):
    q, k, v = (_randn(B, H, L, E, seed=i) for i in range(3))
    pad = torch.ones(B, 1, 1, L, dtype=torch.bool)
    pad[1] = False
    extra = torch.where(pad, 0.0, float("-inf")) if fn is floored_sink else pad
    r = rewrite(fn, q, k, v, _randn(H, seed=3) - 20, extra)
    assert [s.action for s in r.report if s.kind == "attention"] == ["skipped"], str(r.report)


def test_sink_is_rewritten_under_dynamic_shapes():
    """Symbolic sequence lengths (Dynamo's recompile for a second length): ``[..., :-1]`` drops the sink whatever
    the width."""
    import smxcompile

    fn, make = CASES["sink_first"]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="smx", options={"cpu": "rewrite"})
    for length in (L, L + 3):
        args = [*(_randn(B, H, length, E, seed=i) for i in range(3)), _randn(H, seed=3)]
        torch.testing.assert_close(compiled(*args), fn(*args), rtol=1e-5, atol=1e-6)
    report = smxcompile.last_report()
    assert [s.action for s in report if s.kind == "attention"] == ["rewritten"], str(report)

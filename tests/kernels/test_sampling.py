"""``smxcompile.sample`` (``smx::sample``'s torch path): eager's support and distribution, edge cases, errors.

Eager is transformers' warpers written out (temperature, top-k, top-p, min-p, softmax, multinomial); a draw is in
eager's support when eager's filtered probability of it is positive."""

import math

import pytest
import torch
import torch.nn.functional as F

import smxcompile
from smxcompile.kernels.sampling.candidates import FIRST_CANDIDATES, NONFINITE_MESSAGE


def eager_probs(x, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, keep=1):
    s = x / temperature if temperature != 1.0 else x
    if top_k:
        k = min(max(top_k, keep), s.shape[-1])
        s = s.masked_fill(s < torch.topk(s, k)[0][..., -1, None], -math.inf)
    if top_p < 1.0:
        sl, si = torch.sort(s, descending=False)
        remove = sl.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[..., -keep:] = 0
        s = s.masked_fill(remove.scatter(1, si, remove), -math.inf)
    if min_p > 0.0:
        p = torch.softmax(s, -1)
        remove = p < min_p * p.amax(-1, keepdim=True)
        remove.scatter_(-1, torch.topk(p, keep, dim=-1).indices, False)
        s = s.masked_fill(remove, -math.inf)
    return torch.softmax(s.float(), -1)


CASES = {
    "top_k": dict(top_k=20),
    "temperature+top_k": dict(temperature=0.6, top_k=30),
    "top_p": dict(top_p=0.9),
    "min_p": dict(min_p=0.05),
    "all, keep 3": dict(temperature=0.8, top_k=40, top_p=0.7, min_p=0.02, min_tokens_to_keep=3),
    "top_p past the first candidates": dict(top_p=0.999),
}


@pytest.mark.parametrize("name", CASES)
def test_support_and_distribution(name):
    o = dict(CASES[name])
    x = torch.randn(3, 700, generator=torch.Generator().manual_seed(1)) * 3
    want = eager_probs(x, o.get("temperature", 1.0), o.get("top_k", 0), o.get("top_p", 1.0), o.get("min_p", 0.0),
                       o.get("min_tokens_to_keep", 1))
    if name.startswith("top_p past"):
        assert bool(((want > 0).sum(-1) > FIRST_CANDIDATES).all())   # the candidates had to grow
    g = torch.Generator().manual_seed(2)
    draws = torch.cat([smxcompile.sample(x, generator=g, **o) for _ in range(2048)], 1)
    assert bool((want.gather(1, draws) > 0).all())
    for r in range(3):
        hist = torch.bincount(draws[r], minlength=700).double() / 2048
        assert 0.5 * (hist - want[r].double()).abs().sum() <= 0.1


def test_ties_at_the_kth_value_are_all_kept():
    x = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0] * 1, [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    drawn = torch.cat([smxcompile.sample(x, top_k=2, temperature=0.5, generator=g) for _ in range(600)], 1)
    assert set(drawn[0].tolist()) == {0, 1, 2, 3} and set(drawn[1].tolist()) == set(range(6))


def test_ties_at_top_p_and_keep_min_keep_eagers_count():
    """Four tied maxima: top-p 0.5 keeps three (eager's cumulative sum), min_tokens_to_keep=2 under top-p 0 keeps
    two; both the lowest token ids among the tied."""
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    for opts, kept in ((dict(top_p=0.5), 3), (dict(top_p=0.0, min_tokens_to_keep=2), 2)):
        assert int((eager_probs(x, top_p=opts["top_p"], keep=opts.get("min_tokens_to_keep", 1)) > 0).sum()) == kept
        drawn = torch.cat([smxcompile.sample(x, generator=g, **opts) for _ in range(300)], 1)
        assert set(drawn[0].tolist()) == set(range(kept))


def test_generator_is_honoured_and_shapes_follow_multinomial():
    x = torch.randn(4, 50)
    a = smxcompile.sample(x, top_k=10, generator=torch.Generator().manual_seed(7))
    b = smxcompile.sample(x, top_k=10, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and a.shape == (4, 1) and a.dtype == torch.int64
    assert smxcompile.sample(x[0], top_p=0.5).shape == (1,)
    assert smxcompile.sample(torch.empty(0, 50)).shape == (0, 1)
    assert smxcompile.sample(x.bfloat16(), top_k=3).shape == (4, 1)


def test_edge_cases_match_eager():
    x = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    # k >= V and top_p = 1 filter nothing: every token can come
    drawn = torch.cat([smxcompile.sample(x * 0, top_k=100, top_p=1.0, generator=g) for _ in range(400)], 1)
    assert len(set(drawn.flatten().tolist())) == 30
    one = torch.full((1, 30), -math.inf)
    one[0, 17] = 2.0
    assert smxcompile.sample(one, top_k=5, top_p=0.5, min_p=0.3).item() == 17
    # top_p = 0 keeps the largest entry (transformers' TopPLogitsWarper(0.0) too)
    assert (smxcompile.sample(x, top_p=0.0) == x.argmax(-1, keepdim=True)).all()


@pytest.mark.parametrize("bad", [float("nan"), math.inf], ids=["nan", "inf"])
def test_nonfinite_rows_raise_as_multinomial(bad):
    x = torch.randn(2, 30)
    x[1, 4] = bad
    with pytest.raises(RuntimeError):   # eager: multinomial of a NaN softmax
        torch.multinomial(F.softmax(x, -1), 1)
    for kw in (dict(top_k=5), dict(top_p=0.9), dict()):
        with pytest.raises(RuntimeError, match="probability tensor"):
            smxcompile.sample(x, **kw)
    with pytest.raises(RuntimeError, match=NONFINITE_MESSAGE.split("`")[0]):
        smxcompile.sample(torch.full((1, 8), -math.inf))


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=0.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_p=-0.1), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"), (dict(min_tokens_to_keep=0), "min_tokens_to_keep"),
])
def test_bad_options_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        smxcompile.sample(torch.randn(2, 10), **kw)


def test_bad_logits_are_refused():
    with pytest.raises(TypeError, match="floating-point"):
        smxcompile.sample(torch.ones(2, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="V >= 1"):
        smxcompile.sample(torch.randn(2, 0))
    with pytest.raises(ValueError, match="shape"):
        smxcompile.sample(torch.randn(2, 3, 4))

"""An in-place write between a site's first node and its last, to a tensor the site reads, keeps the site: the
fused op would read the tensor after the write, the original read it before. Every way a graph spells a write
counts: a method or function with a trailing underscore or an in-place dunder (``__imul__``), an ATen
overload or packet whose schema mutates, a true ``inplace`` by keyword or position, an ``nn.Module`` built with
``inplace=True``, batch norm's running statistics. For a top-1 read, the range runs from a gather index's own
argmax to the last read. Compiled values equal eager's whatever the pass decides."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pass_helpers import rewrite

_RELU = nn.ReLU(inplace=True)

WRITES = {
    "aten overload": lambda t: torch.ops.aten.relu_.default(t),
    "aten packet": lambda t: torch.ops.aten.relu_(t),
    "inplace keyword": lambda t: F.relu(t, inplace=True),
    "inplace positional": lambda t: F.relu(t, True),
    "module built inplace": _RELU,
    "dropout inplace positional": lambda t: F.dropout(t, 0.0, False, True),
    "inplace flag truthy, not True": lambda t: F.relu(t, 1),
    "in-place dunder method": lambda t: t.__imul__(-1.0),
    "batch norm running statistics": lambda t: F.batch_norm(t.new_full((2, t.numel()), 3.0), t.view(-1),
                                                            t.new_ones(t.numel()), training=True, momentum=1.0),
    "aten packet with a writing overload": lambda t: torch.ops.aten._native_batch_norm_legit(
        t.new_full((2, t.numel()), 3.0), None, None, t.view(-1), t.new_ones(t.numel()), True, 1.0, 1e-5),
}


def _attention_writing_k(write):
    def attention(q, k, v):
        s = q @ k.transpose(-2, -1) * 0.5
        write(k)                     # k changes after the scores read it
        return torch.softmax(s, -1) @ v, k
    return attention


def _top1_writing_logits(write):
    def top1(x):
        p = torch.softmax(x, -1)
        write(x)                     # the logits change after the softmax read them
        return p.argmax(-1), p.max(-1).values
    return top1


@pytest.mark.parametrize("spelling", list(WRITES))
@pytest.mark.parametrize("site", ["attention", "softmax_topk"])
def test_write_between_keeps_the_site(site, spelling):
    gen = torch.Generator().manual_seed(0)
    if site == "attention":
        fn = _attention_writing_k(WRITES[spelling])
        args = [torch.randn(2, 3, 6, 8, generator=gen) for _ in range(3)]
    else:
        fn = _top1_writing_logits(WRITES[spelling])
        args = [torch.randn(4, 16, generator=gen)]
    traced = [a.clone() for a in args]
    r = rewrite(fn, *traced, check_values=False)
    assert site in [s.kind for s in r.report.sites]
    assert all(s.action != "rewritten" for s in r.report.sites if s.kind == site), str(r.report)
    # the graph's placeholders are in Dynamo's order (first use); the written tensor is returned by Dynamo itself
    order = [next(i for i, a in enumerate(traced) if a is x) for x in r.inputs]
    fresh = [a.clone() for a in args]
    got = r.gm(*[fresh[i] for i in order])
    want = fn(*[a.clone() for a in args])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_writes_elsewhere_do_not_keep_the_site():
    """A write to a tensor the site never reads, after it: the site is still rewritten."""
    def attention(q, k, v, other):
        out = torch.softmax(q @ k.transpose(-2, -1) * 0.5, -1) @ v
        F.relu(other, inplace=True)
        return out + other.sum()

    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 3, 6, 8, generator=gen) for _ in range(4)]
    r = rewrite(attention, *args)
    assert [s.action for s in r.report.sites if s.kind == "attention"] == ["rewritten"]


def gather_at_an_earlier_argmax(x):
    i = x.argmax(-1, keepdim=True)          # the index is taken before the logits change
    x.mul_(-1)
    return torch.softmax(x, -1).gather(-1, i)


def index_written_before_gather(x):
    p = torch.softmax(x, -1)
    i = p.argmax(-1, keepdim=True)
    i.clamp_(max=2)                          # the gather no longer reads the row maximum
    return p.gather(-1, i)


@pytest.mark.parametrize("fn", [gather_at_an_earlier_argmax, index_written_before_gather])
def test_top1_range_covers_the_gather_index(fn):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    r = rewrite(fn, x.clone(), check_values=False)
    assert not r.report.count(kind="softmax_topk", action="rewritten"), str(r.report)
    torch.testing.assert_close(r.gm(x.clone())[0], fn(x.clone()))


def bias_built_in_place(q, k, v, table):      # DeBERTa: the bias is summed in place before the scores read it
    s = q @ k.transpose(-2, -1)
    bias = table / 2.0
    bias += table.transpose(-2, -1) / 2.0
    return torch.softmax(s + bias, -1) @ v


def index_built_in_place(q, k, v, table):     # Data2Vec-Vision: a bias index table shifted through a view
    s = q @ k.transpose(-2, -1)
    coords = torch.arange(q.shape[-2])[:, None] - torch.arange(k.shape[-2])[None, :]
    coords = coords.contiguous()
    coords[:, :] += k.shape[-2] - 1
    return torch.softmax(s + table[coords], -1) @ v


def bias_mlp_in_place(q, k, v, table):        # Swin-v2: nn.ReLU(inplace=True) on the bias MLP's fresh linear
    s = q @ k.transpose(-2, -1)
    bias = F.linear(F.relu(F.linear(table, table), inplace=True), table)
    return torch.softmax(s + bias, -1) @ v


def bias_written_after_its_read(q, k, v, table):   # the scores read the bias, then it changes: kept
    bias = table * 2.0
    s = q @ k.transpose(-2, -1) + bias
    bias += 1.0
    return torch.softmax(s, -1) @ v, bias


def view_written_after_its_read(q, k, v, table):
    bias = table * 2.0
    s = q @ k.transpose(-2, -1) + bias[0]
    bias[0].mul_(3.0)
    return torch.softmax(s, -1) @ v, bias


@pytest.mark.parametrize("fn,rewritten", [(bias_built_in_place, True), (index_built_in_place, True),
                                          (bias_mlp_in_place, True),
                                          (bias_written_after_its_read, False),
                                          (view_written_after_its_read, False)])
def test_writes_to_fresh_tensors(fn, rewritten):
    """A write to a tensor the graph allocated keeps the site only if the site read (an alias of) it before."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=gen) for _ in range(3))
    shape = {index_built_in_place: (11,)}.get(fn, (6, 6))
    table = torch.randn(*shape, generator=gen)
    r = rewrite(fn, q, k, v, table)
    assert [s.action for s in r.report.sites if s.kind == "attention"] == ["rewritten" if rewritten else "skipped"], \
        str(r.report)


def constant_mask_written(q, k, v):           # the mask's factory value is not what the scores read
    mask = torch.zeros(6, 6)
    mask[:, 3:] = float("-inf")
    return torch.softmax(q @ k.transpose(-2, -1) + mask, -1) @ v


def repeated_v_written(q, k, v):              # the op would read v un-repeated, after the write
    v = v * 1.0
    v2 = v.repeat_interleave(3, dim=1)
    s = q @ k.repeat_interleave(3, dim=1).transpose(-2, -1)
    v.mul_(2.0)
    return torch.softmax(s, -1) @ v2


def storage_shared_by_set(q, k, v):           # c comes to share k's storage
    c = torch.zeros(0)
    c.set_(k)
    s = q @ k.transpose(-2, -1)
    c.mul_(2.0)
    return torch.softmax(s, -1) @ v


def view_by_keywords(q, k, v):                # a view called with keywords only
    s = q @ k.transpose(-2, -1)
    t = torch.transpose(input=k, dim0=-2, dim1=-1)
    t.mul_(2.0)
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("fn", [constant_mask_written, repeated_v_written, storage_shared_by_set, view_by_keywords])
def test_aliasing_corner_cases_give_eager_values(fn):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3 if fn is not repeated_v_written else 6, 6, 8, generator=gen)
    k, v = (torch.randn(2, 3 if fn is not repeated_v_written else 2, 6, 8, generator=gen) for _ in range(2))
    r = rewrite(fn, q.clone(), k.clone(), v.clone(), check_values=False)
    want = fn(q.clone(), k.clone(), v.clone())
    args = {"L_q_": q.clone(), "L_k_": k.clone(), "L_v_": v.clone()}   # the graph's placeholders, by name
    got = r.gm(*[args[n.target] for n in r.gm.graph.nodes if n.op == "placeholder"])
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)

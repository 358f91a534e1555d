"""The sampling pass: ``multinomial(softmax(filters(x / T)))`` -> ``smx::sample``.

Sites as transformers' ``generate(do_sample=True)`` builds them (its own ``LogitsProcessorList`` from a
``GenerationConfig`` on a small Llama) and as nanoGPT writes them (in place). A rewritten site must draw only
tokens eager could draw (ties at the k-th value included) and follow eager's distribution: over 2048 draws per
row the histogram is within total variation 0.1 of eager's filtered probabilities."""

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import rewrite

pytest.importorskip("transformers")
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

DRAWS = 2048


@pytest.fixture(scope="module")
def llama():
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval()


def _processors(model, **config):
    """The logits processors ``generate`` builds for ``GenerationConfig(do_sample=True, **config)``."""
    cfg = GenerationConfig(do_sample=True, **config)
    cfg.top_k = config.get("top_k", 0)   # (generate's default top_k=50 is a config of its own below)
    return model._get_logits_processor(generation_config=cfg, input_ids_seq_length=4, device="cpu")


def _sampler(procs):
    def step(input_ids, logits):
        scores = procs(input_ids, logits)
        probs = F.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    return step


def _eager_probs(procs, ids, logits):
    return F.softmax(procs(ids, logits.clone()), dim=-1)


def _histogram_matches(gm, inputs, probs):
    """Every drawn token has eager probability > 0; the histogram is within TV 0.1 of ``probs``."""
    torch.manual_seed(1)
    draws = torch.stack([gm(*inputs)[0].reshape(-1) for _ in range(DRAWS)], 1)
    assert bool((probs.gather(1, draws) > 0).all()), "a token outside eager's support"
    for row in range(probs.shape[0]):
        hist = torch.bincount(draws[row], minlength=probs.shape[1]).double() / DRAWS
        tv = 0.5 * (hist - probs[row].double()).abs().sum().item()
        assert tv <= 0.1, (row, tv)


CONFIGS = {
    "top_k": dict(top_k=50),
    "temperature+top_k": dict(temperature=0.7, top_k=20),
    "top_p": dict(top_p=0.9),
    "min_p": dict(min_p=0.1),
    "top_p+min_p": dict(top_p=0.8, min_p=0.05),
    "all": dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_generate_chains_fuse_and_keep_eager_distribution(llama, name):
    procs = _processors(llama, **CONFIGS[name])
    ids = torch.zeros(3, 4, dtype=torch.long)
    with torch.no_grad():
        logits = llama(torch.randint(0, 96, (3, 4), generator=torch.Generator().manual_seed(0))).logits[:, -1]
    logits = logits * 30  # a random-weight model's logits are flat: make the filters bite
    r = rewrite(_sampler(procs), ids, logits, check_values=False, located=())
    sites = [s for s in r.report if s.kind == "sample"]
    assert [s.action for s in sites] == ["rewritten"], [(s.action, s.reason) for s in r.report]
    assert "multinomial" not in r.after and "sort" not in r.after and "topk" not in r.after
    _histogram_matches(r.gm, r.inputs, _eager_probs(procs, ids, logits))


def _nanogpt(logits, temperature=0.8, top_k=5):
    logits = logits / temperature
    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
    logits[logits < v[:, [-1]]] = -float("Inf")
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1)


def _nanogpt_no_temperature(logits, top_k=3):
    v, _ = torch.topk(logits, top_k)
    logits[logits < v[:, [-1]]] = -float("Inf")
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


def test_nanogpt_sampler_and_ties_at_the_kth_value():
    logits = torch.tensor([[4.0, 3.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    r = rewrite(_nanogpt, logits.clone(), check_values=False)
    assert [s.action for s in r.report] == ["rewritten"] and "topk" not in r.after
    eager = F.softmax(torch.where(logits / 0.8 >= (logits / 0.8).topk(5).values[:, -1:], logits / 0.8,
                                  -float("inf")), -1)
    assert (eager > 0).sum(1).tolist() == [5, 5]
    _histogram_matches(r.gm, (logits.clone(),), eager)
    # the k-th value tied (2.0 three times at k=3): every tied token is drawn, as eager keeps them all
    r = rewrite(_nanogpt_no_temperature, logits.clone(), check_values=False)
    assert [s.action for s in r.report] == ["rewritten"]
    x = logits.clone()
    torch.manual_seed(0)
    drawn = {int(t) for _ in range(400) for t in r.gm(x)[0][:1].reshape(-1)}
    assert drawn == {0, 1, 2, 3, 4}
    # the caller's tensor is still filtered in place, as eager does it
    want = logits.clone()
    _nanogpt_no_temperature(want)
    assert torch.equal(x, want)


def test_returned_probabilities_stay_eagers():
    def step(logits):
        s = logits.masked_fill(logits < torch.topk(logits, 3)[0][..., -1, None], -float("inf"))
        probs = F.softmax(s, dim=-1)
        return torch.multinomial(probs, 1), probs

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    r = rewrite(step, logits, check_values=False)
    assert [s.action for s in r.report if s.kind == "sample"] == ["rewritten"]
    tokens, probs = r.gm(logits)
    torch.testing.assert_close(probs, step(logits)[1])
    assert bool((probs.gather(1, tokens) > 0).all())


def _top_p_descending(logits):
    s, i = torch.sort(logits, descending=True)
    remove = torch.cumsum(F.softmax(s, -1), -1) > 0.9
    return torch.multinomial(F.softmax(logits.masked_fill(remove.scatter(1, i, remove), -float("inf")), -1), 1)


def _kth_removed(logits):   # <= removes the k-th largest itself: not a top-k
    return torch.multinomial(F.softmax(logits.masked_fill(logits <= torch.topk(logits, 3)[0][..., -1:],
                                                          -float("inf")), -1), 1)


def _finite_fill(logits):
    return torch.multinomial(F.softmax(logits.masked_fill(logits < torch.topk(logits, 3)[0][..., -1:], -1e4), -1), 1)


def _temperature_after_min_p(logits):
    p = F.softmax(logits, -1)
    s = logits.masked_fill(p < 0.1 * p.amax(-1, keepdim=True), -float("inf"))
    return torch.multinomial(F.softmax(s / 0.5, -1), 1)


def _two_samples(logits):
    return torch.multinomial(F.softmax(logits, -1), 2)


def _probs_edited(logits):
    p = F.softmax(logits, -1)
    p[p < 0.05] = 0
    return torch.multinomial(p, 1)


def _scaled_edited_through_view(logits):
    y = logits / 0.5
    y.view(-1)[:20] = -float("inf")
    return torch.multinomial(F.softmax(y.masked_fill(y < torch.topk(y, 3)[0][..., -1:], -float("inf")), -1), 1)


def _mask_before_in_place_filter(logits):
    y = logits / 1.0
    v = torch.topk(y, 10)[0][..., -1:]
    s, i = torch.sort(y)
    sm = torch.cumsum(F.softmax(s, -1), -1) <= 0.5
    sm[..., -1:] = 0
    mask_p = sm.scatter(1, i, sm)   # computed on y before the top-k below writes it
    y[y < v] = -float("inf")
    return torch.multinomial(F.softmax(y.masked_fill(mask_p, -float("inf")), -1), 1)


def _first_row_threshold(logits):
    return torch.multinomial(F.softmax(logits.masked_fill(logits < torch.topk(logits, 3)[0][:1, -1:],
                                                          -float("inf")), -1), 1)


def _bf16_top_p(logits):
    x = logits.bfloat16()
    s, i = torch.sort(x)
    sm = torch.cumsum(F.softmax(s, -1), -1) <= 0.5
    sm[..., -1:] = 0
    return torch.multinomial(F.softmax(x.masked_fill(sm.scatter(1, i, sm), -float("inf")), -1), 1)


def _sample_sites(fn, seed):
    """The report's sampling sites of ``fn`` compiled on (2, 40) random logits."""
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(seed))
    return [s for s in rewrite(fn, logits, check_values=False).report if s.kind == "sample"]


@pytest.mark.parametrize("fn, reason", [
    (_top_p_descending, "not a top-k, top-p or min-p"),
    (_kth_removed, "not a top-k, top-p or min-p"),
    (_temperature_after_min_p, "temperature after a top-p or min-p"),
    (_two_samples, "num_samples=2"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_near_misses_are_not_fused(fn, reason):
    sites = _sample_sites(fn, seed=4)
    assert sites and all(s.action != "rewritten" for s in sites), [(s.action, s.reason) for s in sites]
    assert any(reason in s.reason for s in sites), [s.reason for s in sites]


def test_a_finite_fill_is_not_a_filter():
    """-1e4 leaves those entries a probability: the draw is fused as a plain softmax of the filled logits."""
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(4))
    r = rewrite(_finite_fill, logits, check_values=False)
    assert [(s.action, s.detail) for s in r.report] == [("rewritten", "plain softmax")]
    assert "masked_fill" in r.after and "topk" in r.after


def test_two_draws_from_one_chain_are_both_fused():
    def two(logits):
        p = F.softmax(logits.masked_fill(logits < torch.topk(logits, 4)[0][..., -1:], -float("inf")), -1)
        return torch.multinomial(p, 1), torch.multinomial(p, 1)

    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(5))
    r = rewrite(two, logits, check_values=False)
    assert [s.action for s in r.report if s.kind == "sample"] == ["rewritten", "rewritten"]
    assert "multinomial" not in r.after


def _last_position_kept(logits):   # (B, S, V) -> (B, 1, V) probabilities, squeezed for the draw
    last = logits[:, -1:, :] / 0.7
    last = last.masked_fill(last < torch.topk(last, 4).values[..., -1:], -float("inf"))
    return torch.multinomial(F.softmax(last, dim=-1).squeeze(1), 1)


def _indexed(logits):
    probs = F.softmax(logits[:, -1:, :], dim=-1)
    return torch.multinomial(probs[:, -1], 1)


def _one_row(logits):   # (1, 1, V) -> (V,): multinomial returns (1,)
    probs = F.softmax(logits[:1, -1:, :], dim=-1)
    return torch.multinomial(probs.reshape(-1), 1)


@pytest.mark.parametrize("fn", [_last_position_kept, _indexed, _one_row], ids=lambda f: f.__name__)
def test_draw_through_a_view_that_keeps_rows(fn):
    """Probabilities of shape (B, 1, V) reshaped to (B, V) or (V,) for the draw: the same rows, fused."""
    logits = torch.randn(3, 2, 30, generator=torch.Generator().manual_seed(6)) * 3
    r = rewrite(fn, logits, check_values=False)
    assert [s.action for s in r.report if s.kind == "sample"] == ["rewritten"], [(s.action, s.reason) for s in r.report]
    assert "multinomial" not in r.after
    rows = 1 if fn is _one_row else 3
    assert tuple(r.gm(logits)[0].shape) == tuple(fn(logits).shape)
    last = logits[:rows, -1]
    if fn is _last_position_kept:
        s = last / 0.7
        eager = F.softmax(s.masked_fill(s < s.topk(4).values[:, -1:], -float("inf")), -1)
    else:
        eager = F.softmax(last, -1)
    _histogram_matches(r.gm, (logits,), eager)


def test_a_view_that_regroups_rows_is_not_a_draw_of_them():
    """softmax over 30 columns, drawn from a (.., 15) view: another distribution per row, not fused."""
    def regrouped(logits):
        return torch.multinomial(F.softmax(logits, dim=-1).reshape(-1, 15), 1)

    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(7))
    r = rewrite(regrouped, logits, check_values=False)
    assert not [s for s in r.report if s.kind == "sample" and s.action == "rewritten"]
    assert "multinomial" in r.after


def _min_p_above_one(logits):   # every entry but the kept top one removed: a min-p the op refuses
    p = torch.softmax(logits, -1)
    remove = p < 1.5 * p.amax(-1, keepdim=True)
    remove.scatter_(-1, torch.topk(p, 1)[1], False)
    return torch.multinomial(F.softmax(logits.masked_fill(remove, -float("inf")), -1), 1)


def _part_of_the_rows(logits):
    return torch.multinomial(F.softmax(logits.view(2, 2, 20), -1)[:, -1], 1)


@pytest.mark.parametrize("fn, reason", [
    (_min_p_above_one, "outside the op's range"),
    (_part_of_the_rows, "some of the softmax's rows"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_sites_outside_the_op_are_reported_skipped(fn, reason):
    sites = _sample_sites(fn, seed=8)
    assert [s.action for s in sites] == ["skipped"] and reason in sites[0].reason, [(s.action, s.reason) for s in sites]


def test_float64_logits_are_drawn_in_float64_on_cpu():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 3
    r = rewrite(_nanogpt, logits.clone(), check_values=False)
    assert [s.action for s in r.report if s.kind == "sample"] == ["rewritten"]
    s = logits / 0.8
    eager = F.softmax(torch.where(s >= s.topk(5).values[:, -1:], s, -float("inf")), -1)
    _histogram_matches(r.gm, (logits.clone(),), eager)


def test_dynamic_filter_parameters_are_named_in_the_reason():
    """Under dynamic shapes nanoGPT's min(k, V) is symbolic: skipped, and the reason says so."""
    import smxcompile

    torch._dynamo.reset()
    compiled = torch.compile(_nanogpt_no_temperature, backend="smx", options={"cpu": "rewrite"}, dynamic=True)
    compiled(torch.randn(3, 40))
    sites = [s for s in smxcompile.last_report() if s.kind == "sample"]
    assert sites and sites[0].action == "skipped" and "symbolic" in sites[0].reason, sites

"""Vocabulary-parallel cut cross-entropy on 2 gloo processes (CPU) against the unsharded op, torch and fp64.

All cases run in one pair of spawned processes (tests/kernels/dist_workers_ce.py; one spawn for the module);
each test then checks one case in the parent:

* against gold: ``|ours - gold| <= |torch - gold| + tol`` for the loss and the gradients of input, weight
  and bias (the criterion and tolerances of tests/kernels/test_cross_entropy.py's ``check_linear``);
* against the unsharded op (``smxcompile.linear_cross_entropy`` on the full classifier): within a few ulps;
* the collectives: the forward moves O(N) numbers whatever V is.

The vocabulary (V = 101) is not divisible by the world size; layouts include uneven and empty shards.
"""

from __future__ import annotations

import os

import pytest
import torch

import smxcompile

import dist_workers_ce as W
import test_cross_entropy as T
from dist_utils import run_distributed

REDUCTIONS = ["mean", "sum", "none"]

CASES: dict[str, dict] = {}
for _name in T.OPTIONS:
    for _red in REDUCTIONS:
        CASES[f"{_name}-{_red}"] = {"options": _name, "reduction": _red}
for _layout_name, _layout in {"uneven": [30, 71], "empty_rank1": [T.V, 0], "empty_rank0": [0, T.V]}.items():
    for _red in ("mean", "none"):
        CASES[f"layout_{_layout_name}-{_red}"] = {"options": "scale_softcap_all", "reduction": _red,
                                                  "layout": _layout}
for _mode in ("rank0", "rank1", "ignored"):
    for _red in REDUCTIONS:
        CASES[f"targets_{_mode}-{_red}"] = {"options": "smoothing_class_weight", "reduction": _red,
                                            "targets": _mode}
        CASES[f"targets_{_mode}_plain-{_red}"] = {"options": "plain", "reduction": _red, "targets": _mode}
CASES.update({
    "bf16-mean": {"options": "smoothing", "reduction": "mean", "dtype": torch.bfloat16},
    "bf16-none": {"options": "z_loss", "reduction": "none", "dtype": torch.bfloat16},
    "bf16_return_lse-none": {"options": "plain", "reduction": "none", "dtype": torch.bfloat16, "extra": {"return_lse": True}},
    "batched_bt-mean": {"options": "class_weight", "reduction": "mean", "shape": (4, 9)},
    "dtensor-mean": {"options": "smoothing_class_weight", "reduction": "mean", "dtensor": True},
    "dtensor-none": {"options": "plain", "reduction": "none", "dtensor": True},
    "return_lse-none": {"options": "z_loss_all", "reduction": "none", "extra": {"return_lse": True}},
    "return_lse-mean": {"options": "plain", "reduction": "mean", "extra": {"return_lse": True}},
    "nan_row-none": {"options": "plain", "reduction": "none", "nan_row": True},
    "nan_row-mean": {"options": "plain", "reduction": "mean", "nan_row": True},
    # an ignored NaN row: torch's gradients are NaN everywhere (0 * NaN); the fused paths (unsharded and
    # sharded) skip ignored rows, so no NaN: this case is checked against the unsharded op only
    "nan_row_ignored-mean": {"options": "plain", "reduction": "mean", "nan_row": "ignored"},
    "masked_vocab-mean": {"options": "plain", "reduction": "mean", "masked_vocab": True, "targets": "rank0"},
    "collapse-sum": {"options": "plain", "reduction": "sum", "collapse": True, "v": 50, "layout": [20, 30]},
    "collapse-none": {"options": "plain", "reduction": "none", "collapse": True, "v": 50, "layout": [20, 30]},
    # the fused CPU path in many row chunks (the merge runs per chunk; chunk height from the largest shard)
    "chunked-mean": {"options": "class_weight", "reduction": "mean", "layout": [30, 71],
                     "extra": {"chunk_bytes": 4 * 71 * 3}},
    "chunked_z_loss-sum": {"options": "z_loss", "reduction": "sum", "extra": {"chunk_bytes": 4 * 51 * 2}},
    "chunked_token_weight-mean": {"options": "token_weight", "reduction": "mean", "layout": [0, T.V],
                                  "extra": {"chunk_bytes": 4 * T.V * 5}},
    "dtensor_fused-sum": {"options": "plain", "reduction": "sum", "dtensor": True},
    "comm_v1001-mean": {"options": "smoothing", "reduction": "mean", "v": 1001},
})


@pytest.fixture(scope="module")
def results():
    """Every case on both ranks: ``results[name] == [rank 0's, rank 1's]``; plus the error cases."""
    out = run_distributed(W.run_cases, 2, CASES, timeout=600)
    errors = run_distributed(W.run_errors, 2, timeout=120)
    return {name: [out[0][name], out[1][name]] for name in CASES} | {"__errors__": errors}


def _full(ranks, key):
    """The classifier gradient of the whole vocabulary: the ranks' shards in order."""
    parts = [r[key] for r in ranks]
    return None if parts[0] is None else torch.cat(parts)


def _gathered(ranks):
    for r in ranks:
        assert "error" not in r, r["error"]
    a, b = ranks
    # the loss (and grad_input, all-reduced) is the same on every rank
    torch.testing.assert_close(a["loss"], b["loss"], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(a["gx"], b["gx"], rtol=0, atol=0, equal_nan=True)
    return a["loss"], [a["gx"], _full(ranks, "gw"), _full(ranks, "gb")]


def _unsharded(case):
    x, w, b, t, opts = W.problem(case)
    leaves = [u.clone().requires_grad_() for u in (x, w, b) if u is not None]
    xx, ww = leaves[0], leaves[1]
    bb = leaves[2] if b is not None else None
    extra = case.get("extra", {})
    out = smxcompile.linear_cross_entropy(xx, ww, t, bias=bb, **opts, **extra)
    loss, obj, up = W.objective(out, extra)
    grads = list(torch.autograd.grad(obj, leaves, up)) + [None] * (3 - len(leaves))
    return loss.detach(), grads, (out.lse.detach() if extra.get("return_lse") else None)


def _assert_close_to_unsharded(ranks, cases, *, tolerances, equal_nan=False):
    """Each case's gathered loss and gradients against the unsharded op: ``assert_close`` with ``(rtol, a)`` =
    ``tolerances(case)``, atol = a x max|unsharded|."""
    for name, case in cases.items():
        loss, grads = _gathered([ranks[0][name], ranks[1][name]])
        ref_loss, ref_grads, _ = _unsharded(case)
        rtol, atol = tolerances(case)
        for what, ours, ref in zip(("loss", "grad_input", "grad_weight", "grad_bias"), [loss] + grads,
                                   [ref_loss] + ref_grads):
            if ref is not None:
                torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol * ref.abs().max().item(),
                                           equal_nan=equal_nan, msg=lambda m: f"{name} {what}: {m}")


@pytest.mark.parametrize("name", [n for n in CASES if "return_lse" not in n and n != "nan_row_ignored-mean"])
def test_matches_gold_and_torch(results, name):
    """Loss and gradients of input / weight / bias: no worse than torch against fp64 (check_linear)."""
    case = CASES[name]
    loss, grads = _gathered(results[name])
    x, w, b, t, opts = W.problem(case)
    T.check_linear(x, w, b, t, result=(loss, grads), **opts)


# collapse cases: the gradients cancel (rows sum to ~0 against |W| ~ 1e3), so a max-norm tolerance is
# meaningless there; they are checked against gold with check_linear's term-scaled tolerance instead
@pytest.mark.parametrize("name", [n for n in CASES if "collapse" not in n])
def test_matches_the_unsharded_op(results, name):
    """Within a few ulps of linear_cross_entropy on the whole classifier (the same formulas; only the lse
    merge and the all-reduced sums round differently)."""
    case = CASES[name]
    loss, grads = _gathered(results[name])
    ref_loss, ref_grads, ref_lse = _unsharded(case)
    eps = torch.finfo(case.get("dtype", torch.float32)).eps
    for what, ours, ref in zip(("loss", "grad_input", "grad_weight", "grad_bias", "lse"),
                               [loss] + grads + [results[name][0]["lse"]], [ref_loss] + ref_grads + [ref_lse]):
        if ref is None:
            continue
        assert ours.dtype == ref.dtype and torch.equal(ours.isnan(), ref.isnan()), what
        fin = ~ref.isnan()
        o, r = ours[fin].double(), ref[fin].double()
        # a few ulps of the tensor's scale: the sharded and unsharded sums run in different orders
        err, tol = (o - r).abs().max().item() if r.numel() else 0.0, 64 * eps * (r.abs().max().item() if r.numel() else 0)
        assert err <= tol, f"{what}: max |sharded - unsharded| = {err:.3g} > {tol:.3g}"


TRITON_CASES = {
    "triton_plain-mean": {"options": "class_weight", "reduction": "mean", "layout": [30, 71]},
    "triton_smoothing_softcap-none": {"options": "scale_softcap_all", "reduction": "none"},
    "triton_z_loss_targets_rank1-sum": {"options": "z_loss", "reduction": "sum", "targets": "rank1"},
}


@pytest.mark.triton
def test_bf16_lse_keeps_fp32_logits(results):
    """Apple CCE's rule per row on the sharded lse: no worse than torch in fp32 on the same bf16 inputs, against
    fp64, + 1e-5 (the shards' logits are fp32, as on one device; bf16 logits are ~1e-3 off)."""
    x, w, b, t, _ = W.problem(CASES["bf16_return_lse-none"])
    lse = results["bf16_return_lse-none"][0]["lse"].double()
    z = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())   # torch in fp32
    gold = torch.logsumexp(torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()), -1)
    ref = torch.logsumexp(z.float(), -1).double()
    assert bool(((lse - gold).abs() <= (ref - gold).abs() + 1e-5).all())


def test_triton_kernels_per_shard_match_the_unsharded_triton_op(monkeypatch):
    """The CUDA path, run through Triton's interpreter: every shard's statistics and backward kernels (local
    targets, -1 where a rank does not own the target; the global lse and other mass in the backward)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest on machines without a GPU)")
    ranks = run_distributed(W.run_triton_cases, 2, TRITON_CASES, timeout=600)
    for r in ranks:  # the kernels really ran, once per case and direction
        assert r["__calls__"] == {"lce_forward": len(TRITON_CASES), "lce_backward": len(TRITON_CASES)}
    from smxcompile.kernels import config

    monkeypatch.setattr(config, "force_triton", True)
    _assert_close_to_unsharded(ranks, TRITON_CASES, tolerances=lambda case: (1e-5, 1e-6))


CUDA_CASES = {f"cuda_{name}": {**case, "device": "cuda"} for name, case in TRITON_CASES.items()} | {
    "cuda_bf16-mean": {"options": "smoothing", "reduction": "mean", "dtype": torch.bfloat16, "device": "cuda"},
    "cuda_all_ignored-sum": {"options": "plain", "reduction": "sum", "targets": "ignored", "device": "cuda"},
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu/run.sh runs it)")
def test_shards_on_cuda_match_the_unsharded_op():
    """Two gloo ranks on one GPU (nccl wants a GPU per rank), every shard on the real Triton kernels, against the
    unsharded op on the same GPU: the math is checked, not the collectives' speed."""
    ranks = run_distributed(W.run_cases, 2, CUDA_CASES, timeout=120)  # under run.sh's 150 s

    def ulps(case):
        return (64 * torch.finfo(case.get("dtype", torch.float32)).eps,) * 2
    _assert_close_to_unsharded(ranks, CUDA_CASES, tolerances=ulps, equal_nan=True)


def test_layouts_and_target_ownership_cover_what_they_claim(results):
    """The cases really are uneven / empty shards, and targets all in one rank's shard or all ignored."""
    assert results["targets_rank0-mean"][0]["sizes"] == [51, 50]
    for name, sizes in (("layout_uneven-mean", [30, 71]), ("layout_empty_rank1-mean", [101, 0]),
                        ("layout_empty_rank0-mean", [0, 101])):
        assert results[name][0]["sizes"] == sizes
    for mode, lo, hi in (("rank0", 0, 51), ("rank1", 51, 101)):
        _, _, _, t, opts = W.problem(CASES[f"targets_{mode}-mean"])
        valid = t[t != -100]
        assert valid.numel() > 0 and ((valid >= lo) & (valid < hi)).all()
    _, _, _, t, _ = W.problem(CASES["targets_ignored-mean"])
    assert (t == -100).all()
    assert results["targets_ignored-mean"][0]["loss"].isnan()  # torch: a mean over no targets is NaN
    assert torch.equal(results["targets_ignored-sum"][0]["gx"], torch.zeros_like(results["targets_ignored-sum"][0]["gx"]))


def test_collectives_are_O_of_N(results):
    """Whatever V is, the forward moves O(N) numbers: an all_gather of 9 fp64 per rank (sizes, checksums), then all_reduces of the
    rows' maxima (N fp32) and of 3 (4 with label smoothing) numbers per row; the backward one all_reduce of
    grad_input (N x D). On the CPU fused path (mean/sum, no smoothing / soft-cap) the merge runs per row chunk
    over the non-ignored rows, and grad_input is reduced in the forward. A naive all-gather of the logits
    would move N x V per rank."""
    n, d = T.N, T.D
    _, _, _, t, _ = W.problem(CASES["smoothing-mean"])
    rows = int((t != -100).sum())
    assert rows < n
    stats = lambda parts: [("allgather_", 72, 144), ("allreduce_", 4 * n, 4 * n),
                           ("allreduce_", 4 * parts * n, 4 * parts * n)]
    for name, v, fwd, bwd in (
            ("smoothing-mean", T.V, stats(4), [("allreduce_", 4 * n * d, 4 * n * d)]),
            ("comm_v1001-mean", 1001, stats(4), [("allreduce_", 4 * n * d, 4 * n * d)]),
            ("plain-none", T.V, stats(3), [("allreduce_", 4 * n * d, 4 * n * d)]),
            ("plain-mean", T.V, [("allgather_", 72, 144), ("allreduce_", 4 * rows, 4 * rows),
                                 ("allreduce_", 12 * rows, 12 * rows), ("allreduce_", 4 * n * d, 4 * n * d)], [])):
        r = results[name][0]
        assert r["forward"] == fwd, (name, r["forward"])
        assert r["backward"] == bwd, (name, r["backward"])
        assert sum(c[2] for c in r["forward"] if c[1] < 4 * n * d) < 4 * n * v / 10


def test_dtensor_weight_is_sharded_like_torch_chunk(results):
    """A DTensor (Shard(0)) classifier: the local gradients are the shards of the unsharded gradient."""
    r0, r1 = results["dtensor-mean"]
    assert r0["gw"].shape[0] == 51 and r1["gw"].shape[0] == 50


def test_refuses_what_it_cannot_do(results):
    """Targets / inputs / options / weights that differ between ranks (also a permutation of rows, values moved
    between columns), soft targets, out-of-range targets, a class_weight of the shard's size, a bad argument on
    one rank only, double backward: clear errors, on both ranks (no hang, no mismatched collectives); a frozen
    input issues no N x D collective."""
    errs = results["__errors__"]
    for r in errs:
        assert r["targets_differ"][0] == "ValueError" and "targets differ" in r["targets_differ"][1]
        assert r["inputs_differ"][0] == "ValueError" and "embeddings" in r["inputs_differ"][1]
        assert r["rows_permuted"][0] == "ValueError"
        assert r["soft_targets"][0] == "NotImplementedError"
        assert r["out_of_range"][0] == "IndexError" and "out of bounds" in r["out_of_range"][1]
        assert r["class_weight_shard"][0] == "ValueError" and "(11,)" in r["class_weight_shard"][1], r["class_weight_shard"]
        assert r["reduce_input_grad_false"] is None
        for name in ("reduction_differs", "chunk_bytes_differs", "smoothing_differs", "ignore_index_differs",
                     "no_grad_on_one_rank"):
            assert r[name][0] == "ValueError" and "options" in r[name][1], (name, r[name])
        assert r["token_weight_differs"][0] == "ValueError" and "token_weight" in r["token_weight_differs"][1]
        assert r["class_weight_differs"][0] == "ValueError" and "class_weight" in r["class_weight_differs"][1]
        for name in ("columns_moved", "rows_100_apart_swapped"):
            assert r[name][0] == "ValueError" and "embeddings" in r[name][1], (name, r[name])
        assert r["double_backward"][0] == "RuntimeError" and "double backward" in r["double_backward"][1]
        assert r["frozen_input"] is None and ("allreduce_", 8 * 4 * 4) not in r["frozen_input_collectives"]  # N x D fp32
        assert [op for op, _ in r["frozen_input_collectives"]] == ["allgather_", "allreduce_", "allreduce_"]
    assert errs[1]["bad_bias_on_one_rank"][0] == "ValueError" and "bias" in errs[1]["bad_bias_on_one_rank"][1]
    assert errs[0]["bad_bias_on_one_rank"][0] == "RuntimeError" and "rank(s) [1]" in errs[0]["bad_bias_on_one_rank"][1]
    # CollectiveCounter: a functional all_reduce counted once (not its autograd wrapper), send / recv one way
    assert errs[0]["counted"] == [("all_reduce", 4000, 4000), ("send", 40, 0), ("allgather_", 12, 24)]
    assert errs[1]["counted"] == [("all_reduce", 4000, 4000), ("recv_", 0, 40), ("allgather_", 12, 24)]
    # reduce_input_grad=False: partial gradients that sum to the full one
    a, b = errs
    assert not torch.equal(a["partial"], a["full"])
    torch.testing.assert_close(a["partial"] + b["partial"], a["full"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a["full"], b["full"], rtol=0, atol=0)


def test_without_an_initialised_group_it_says_so():
    x, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        smxcompile.linear_cross_entropy(x, w, t, process_group=object())


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_softmax_collapse_target_gradient(results, reduction):
    """The target dominates (p_target rounds to 1 in fp32): the target entry of the gradient is computed on the
    owning rank from the *global* mass of the other classes, so it stays non-zero and matches fp64 (torch's
    ``p_y - 1`` is 0 here; see tests/kernels/test_cross_entropy.py::test_softmax_collapse_linear).

    Tolerance: the logits are ~1e3, so each fp32 logit (and each rank's fp32 lse) carries an absolute rounding
    of up to ulp(1e3)/2 = 3e-5, i.e. a relative error of 3e-5 in every exp(z - lse); the other rank's mass
    enters through its one lse, so its error does not average out over classes as it can on one device:
    rtol = 2 ulp(1e3) = 1.2e-4."""
    case = CASES[f"collapse-{reduction}"]
    _, grads = _gathered(results[f"collapse-{reduction}"])
    gw = grads[1]
    x, w, _, t, opts = W.problem(case)
    x64, w64 = x.double(), w.double().requires_grad_()
    up = T.upstream_for()(torch.zeros(16) if reduction == "none" else torch.zeros(())).double()
    gw64 = torch.autograd.grad(torch.nn.functional.cross_entropy(x64 @ w64.t(), t, reduction=reduction), w64, up)[0]
    rows = torch.arange(16)
    assert (t < 20).any() and (t >= 20).any()  # targets owned by both ranks
    torch.testing.assert_close(gw[t, rows].double(), gw64[t, rows], rtol=2 * 2.0**-14, atol=0)  # 2 ulp(1e3) in fp32
    assert (gw[t, rows] != 0).all()


def test_inside_a_module_compiled_with_the_smx_backend():
    """Under torch.compile(backend="smx") the vocabulary-parallel loss is a graph break and runs eagerly: the
    loss and the gradients (of the replicated projection before it, of each classifier shard) equal the
    unsharded eager run."""
    ranks = run_distributed(W.run_compiled, 2, timeout=300)
    x, w, _, t = T.make_problem(seed=4, bias=False)
    ref = W._Head(w, w.shape[1])
    loss = smxcompile.linear_cross_entropy(torch.tanh(ref.proj(x)), ref.w, t, label_smoothing=0.1)
    loss.backward()
    for r in ranks:
        torch.testing.assert_close(r["loss"], loss.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["proj_grad"], ref.proj.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r["w_grad"] for r in ranks]), ref.w.grad, rtol=1e-5, atol=1e-6)


def test_the_benchmark_runs_and_measures(tmp_path):
    """benchmarks/bench_vocab_parallel_ce.py at a tiny size: every variant agrees with smx, and smx's loss moves
    fewer bytes than the all-gather of the logits; V = 257 (uneven shards) runs for smx only."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_vocab_parallel_ce.py"), "--n", "64",
                           "--d", "16", "--vocab", "512,257", "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss_parallel" in proc.stdout and "command: python benchmarks/bench_vocab_parallel_ce.py" in proc.stdout
    rows = {(r["vocab"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    smx, naive, tp = rows[(512, "smx")], rows[(512, "allgather")], rows[(512, "loss_parallel")]
    assert naive["loss_fwd_bytes"] == 64 * 512 * 4  # the full logits
    assert smx["loss_fwd_bytes"] < naive["loss_fwd_bytes"] / 10
    assert smx["grad_input_bytes"] == naive["grad_input_bytes"] == tp["grad_input_bytes"] == 64 * 16 * 4
    for r in (naive, tp):
        assert r["dloss"] < 1e-5 and r["dgrad"] < 1e-5
    assert "error" in rows[(257, "allgather")] and "error" not in rows[(257, "smx")]  # uneven: smx only

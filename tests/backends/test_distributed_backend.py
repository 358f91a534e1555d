"""The smx backend under torch.distributed: DDP and FSDP2 (``fully_shard``) on CPU, gloo, 2 spawned processes.

Each test trains a tiny transformers GPT-2 (tests/backends/dist_workers_backend.py) for a few SGD steps, every rank on its
half of each global batch, compiled with ``backend="smx", options={"cpu": "rewrite"}`` (on CPU the default
``cpu="auto"`` keeps these small sites; ``rewrite`` makes them fire), and checks it against one process training
the same model on the whole global batches: per-step global loss, final parameters, and that the rewrites fired
on every rank. The last test launches examples/distributed_train.py through torchrun.
"""

from __future__ import annotations

import functools
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import dist_workers_backend as workers  # noqa: E402  (pytest puts this folder and tests/ on sys.path; spawned children inherit it)
from dist_utils import run_distributed  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORLD = 2

# Tolerances, fp32. The distributed runs differ from the single-process reference only in rounding: each rank's
# forward/backward runs on half the rows (other GEMM blockings), gradients are averaged across ranks instead of
# reduced over the whole batch, and the reference is eager while the ranks run the rewritten graph. Measured over
# 3 SGD steps: losses within 1e-7 relative, parameters within 1.2e-7 absolute (one ulp of a LayerNorm weight near
# 1.0; smx vs eager in one process differs by the same 1.2e-7). The bounds below are ~100x that, while every
# parameter tensor moved by at least 150x its bound during training (checked below): a lost or doubled gradient
# average, or ranks training on the wrong rows, changes the parameters by a sizeable part of an update.
LOSS_RTOL = 1e-5
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-6   # per tensor: max|p - p_ref| <= ATOL + RTOL * max|p_ref|
MIN_UPDATE_OVER_BOUND = 50.0


@functools.lru_cache(maxsize=None)
def _reference() -> dict:
    """Single process, eager, whole global batches: the losses and parameters the distributed runs must reproduce."""
    spec = {**workers.SPEC, "backend": "eager"}
    out = workers.single_process(spec)
    out["init"] = {n: p.detach().clone() for n, p in workers.build_model(spec).named_parameters()}
    return out


def _summary(reports: list[dict]) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for r in reports:
        for kind, acts in r["summary"].items():
            for action, n in acts.items():
                total.setdefault(kind, {}).setdefault(action, 0)
                total[kind][action] += n
    return total


def _check_against_reference(results: list[dict]) -> None:
    ref = _reference()
    bounds = {n: PARAM_ATOL + PARAM_RTOL * float(p.abs().max()) for n, p in ref["params"].items()}
    for n, p in ref["params"].items():  # the test can see a wrong update: every tensor moved far beyond its bound
        moved = float((p - ref["init"][n]).abs().max())
        assert moved > MIN_UPDATE_OVER_BOUND * bounds[n], (n, moved, bounds[n])
    for res in results:
        r = res["rank"]
        assert all(math.isfinite(x) for x in res["local_losses"]), res["local_losses"]
        # Equal-token-count batches (every label is a real next token, none is -100): the mean of the ranks'
        # mean losses is the mean loss of the whole global batch, which the reference computes.
        assert res["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL), (r, res["losses"], ref["losses"])
        errors = {n: float((res["params"][n] - p).abs().max()) for n, p in ref["params"].items()}
        bad = {n: (e, bounds[n]) for n, e in errors.items() if e > bounds[n]}
        assert not bad, f"rank {r}: parameters off the single-process run: {bad}"
    # the ranks trained on different rows (their own losses differ) and hold the same model
    assert results[0]["local_losses"] != results[1]["local_losses"]
    for n in ref["params"]:
        assert torch.equal(results[0]["params"][n], results[1]["params"][n]), n


def test_ddp_smx_matches_single_process():
    results = run_distributed(workers.ddp_worker, WORLD, workers.SPEC, timeout=300)
    _check_against_reference(results)
    for res in results:
        r, reports = res["rank"], res["reports"]
        # One Dynamo graph (no graph break in the model), split by DDPOptimizer at the gradient buckets: each piece
        # goes through smx_backend and has its own report.
        assert res["counters"]["stats"]["unique_graphs"] == 1, (r, res["counters"])
        assert len(reports) > 1, f"rank {r}: DDP did not split the graph: {len(reports)} piece(s)"
        # every site of the model is in exactly one piece, and every one was rewritten
        assert _summary(reports) == {"attention": {"rewritten": workers.SPEC["n_layer"]},
                                     "linear_cross_entropy": {"rewritten": 1}}, (r, _summary(reports))
        kinds = [sorted(x["summary"]) for x in reports]
        assert kinds == [sorted(x["summary"]) for x in results[0]["reports"]], "ranks split the graph differently"


def test_fsdp2_smx_matches_single_process():
    results = run_distributed(workers.fsdp_worker, WORLD, workers.SPEC, timeout=300)
    _check_against_reference(results)
    for res in results:
        r, reports = res["rank"], res["reports"]
        # FSDP2's hooks break the graph at every fully_shard module: one graph before the blocks (embeddings, no
        # site), one for a transformer block and one after them (ln_f, LM head, loss); each is one smx report (no
        # DDP-style splitting). torch 2.13 compiles the block graph once and runs it for every block (the blocks'
        # parameters are graph inputs), so the report lists one attention site for all layers.
        assert len(reports) == res["counters"]["stats"]["unique_graphs"] >= 3, (r, len(reports), res["counters"])
        summary = _summary(reports)
        assert 1 <= summary.get("attention", {}).get("rewritten", 0) <= workers.SPEC["n_layer"], (r, summary)
        assert summary == {"attention": summary["attention"], "linear_cross_entropy": {"rewritten": 1}}, (r, summary)


def _run_killing_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` that on timeout kills torchrun's whole process group (its workers too), not just torchrun."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"torchrun did not finish in {timeout:.0f} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_example_distributed_train_under_torchrun():
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--standalone",
           str(REPO / "examples" / "distributed_train.py"), "--mode", "ddp", "--steps", "2", "--backend-dist", "gloo"]
    proc = _run_killing_group(cmd, 300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for step in (1, 2):
        m = re.search(rf"^step\s+{step}/2\s+loss rank0 (\S+)\s+rank1 (\S+)\s+mean (\S+)", proc.stdout, re.M)
        assert m, proc.stdout
        r0, r1, mean = map(float, m.groups())
        assert all(math.isfinite(x) for x in (r0, r1)) and mean == pytest.approx((r0 + r1) / 2, abs=2e-4)
    for r in range(WORLD):  # every rank's report: its one graph piece (the model is below DDP's 1 MiB first bucket)
        assert re.search(rf"^\s+rank{r} piece 0 \(g\d+\): attention 2 rewritten, linear_cross_entropy 1 rewritten$",
                         proc.stdout, re.M), proc.stdout
    assert "smxcompile report: attention: 2 rewritten, linear_cross_entropy: 1 rewritten" in proc.stdout
    assert re.search(r"^final loss \(mean over 2 ranks\): \d", proc.stdout, re.M), proc.stdout

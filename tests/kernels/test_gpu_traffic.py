"""What the Triton kernels move, counted through the interpreter (benchmarks/gpu_traffic.py): the README's and
DESIGN.md's claims held as byte counts, and the counter's sampling checked against a full count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from smxcompile.kernels import triton_helpers  # noqa: E402

if not triton_helpers.interpreted():  # pragma: no cover - a GPU machine runs the real kernels
    pytest.skip("counts need Triton's interpreter", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_traffic import count_traffic, strata  # noqa: E402

from smxcompile.kernels.cross_entropy.triton_backward import lce_backward  # noqa: E402
from smxcompile.kernels.cross_entropy.triton_forward import lce_forward  # noqa: E402
from smxcompile.kernels.softmax.triton_kernels import MAX_FUSED_BLOCK, softmax_backward, softmax_forward  # noqa: E402
from smxcompile.kernels.softmax_topk.triton_kernels import softmax_topk_forward  # noqa: E402
from smxcompile.kernels.triton_helpers import plan_for_sms  # noqa: E402

FULL = dict(axis_cap=10**9, loop_cap=10**9)


def _kernels(tr):
    return [x for x in tr.launches if not x.kernel.startswith("aten.")]


@pytest.mark.parametrize("n,cap", [(1, 3), (5, 6), (6, 6), (7, 6), (100, 6), (1000, 9)])
def test_strata_cover_the_axis(n, cap):
    s = strata(n, cap)
    ids = [i for i, _ in s]
    assert sum(w for _, w in s) == n and len(s) <= cap
    assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] == n - 1
    if n > cap:
        assert s[0] == (0, 1) and s[-1] == (n - 1, 1)


def test_strata_rejects_a_small_cap():
    with pytest.raises(ValueError, match="cap"):
        strata(10, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_row_in_one_block_loads_each_element_once(dtype):
    """DESIGN.md: one load per element when a row fits in one block (up to MAX_FUSED_BLOCK columns)."""
    R, C = 4, MAX_FUSED_BLOCK
    x = torch.randn(R, C, dtype=dtype)
    with count_traffic(**FULL) as tr:
        y, _ = softmax_forward(x, -1)
    (k,) = _kernels(tr)
    s = x.element_size()
    assert (k.bytes_loaded, k.bytes_stored, k.bytes_reread) == (R * C * s, R * C * s, 0)
    torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=1e-2, rtol=1e-2)


def test_online_softmax_second_pass_reads_once_more_and_writes_once():
    """The two-pass path: the online (max, sum) sweep reads the row, the writing sweep reads it once more and
    writes once; the row's masked tail is not counted."""
    R, C, block = 3, 1000, 256  # 4 blocks per row, the last one masked to 232 columns
    x = torch.randn(R, C)
    with count_traffic(**FULL) as tr:
        softmax_forward(x, -1, block_size=block)
    (k,) = _kernels(tr)
    assert (k.bytes_loaded, k.bytes_stored) == (2 * R * C * 4, R * C * 4)
    assert k.bytes_reread == R * C * 4  # every sector of the row once more, by the same program


def test_softmax_tail_in_registers_is_read_once(monkeypatch):
    """The forward's default multi-block path reads only the head (up to the tail's block boundary) twice: the
    tail is loaded once, kept in registers and stored at the end (constants shrunk for the interpreter)."""
    from smxcompile.kernels.softmax import triton_kernels as ts
    for name, v in (("MAX_FUSED_BLOCK", 256), ("MAX_FUSED_BLOCK_16", 256), ("LOOP_BLOCK", 128), ("TAIL_BLOCK", 256),
                    ("TAIL_BLOCK_WIDE", 512), ("TAIL_BLOCK_ANY", 256)):
        monkeypatch.setattr(ts, name, v)
    R = 3
    for C, head in ((1000, 768), (1024, 512)):  # C % 16 != 0: TAIL_BLOCK_ANY; aligned: TAIL_BLOCK_WIDE
        x = torch.randn(R, C)
        with count_traffic(**FULL) as tr:
            softmax_forward(x, -1)
        (k,) = _kernels(tr)
        assert (k.bytes_loaded, k.bytes_stored) == (R * (C + head) * 4, R * C * 4)
        assert k.bytes_reread == R * head * 4


def test_softmax_backward_two_passes_when_the_row_does_not_fit():
    R, C = 2, 1024
    g, y = torch.randn(R, C), torch.rand(R, C)
    with count_traffic(**FULL) as tr:
        softmax_backward(g, y, -1, block_size=256)
    (k,) = _kernels(tr)
    assert (k.bytes_loaded, k.bytes_stored) == (4 * R * C * 4, R * C * 4)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])
def test_softmax_backward_tail_in_registers_is_read_once(monkeypatch, log):
    """The backward's default multi-block path reads only the head (up to the tail's block boundary) twice: the tail's
    g and y are loaded once and kept in registers until its dz is stored; the tail holds twice the columns for 16-bit
    g and y (constants shrunk for the interpreter). Log-softmax's first pass reads g alone: y once in any case."""
    from smxcompile.kernels.softmax import triton_kernels as ts
    for name, v in (("MAX_FUSED_BLOCK", 256), ("LOOP_BLOCK", 128), ("BWD_TAIL_BYTES", 2048)):
        monkeypatch.setattr(ts, name, v)
    R, C = 3, 1008  # (rows of whole 32-byte sectors in bf16: re-reads counted by sector)
    for dtype, head in ((torch.float32, 768), (torch.bfloat16, 512)):  # tails of 256 and 512 columns
        s = dtype.itemsize
        g, y = torch.randn(R, C, dtype=dtype), torch.rand(R, C, dtype=dtype)
        with count_traffic(**FULL) as tr:
            softmax_backward(g, y, -1, log=log)
        (k,) = _kernels(tr)
        g_bytes = R * (C + head) * s  # the head twice, the tail once
        y_bytes = R * C * s if log else g_bytes
        assert (k.bytes_loaded, k.bytes_stored) == (g_bytes + y_bytes, R * C * s)
        assert k.bytes_reread == (1 if log else 2) * R * head * s


def test_softmax_topk_reads_the_row_once():
    """softmax + top-k is one pass over the logits (a second small kernel merges the splits of long rows)."""
    R, C, k = 4, 8192, 8
    x = torch.randn(R, C)
    with plan_for_sms(132), count_traffic(**FULL) as tr:
        softmax_topk_forward(x, k)
    kernels = _kernels(tr)
    loaded = sum(x_.bytes_loaded for x_ in kernels)
    assert R * C * 4 <= loaded <= 1.05 * R * C * 4
    assert [x_.kernel for x_ in tr.launches] == ["_softmax_topk_fwd_kernel", "_softmax_topk_merge_kernel"]


@pytest.mark.parametrize("backward", [False, True])
def test_cut_cross_entropy_never_materializes_the_logits(backward):
    """The forward stores per-row statistics only; neither pass holds an N x V buffer."""
    N, D, V = 64, 32, 1024
    x, w = torch.randn(N, D), torch.randn(V, D) * 0.1
    y = torch.randint(0, V, (N,))
    y[::7] = -100
    with plan_for_sms(132), count_traffic() as tr:
        if backward:
            lse = torch.logsumexp(x @ w.T, -1)
            lce_backward(x, w, None, y, lse, torch.rand(N), torch.rand(N), torch.rand(N), None, ignore_index=-100)
        else:
            lce_forward(x, w, None, y, ignore_index=-100)
    stored = sum(k.bytes_stored for k in _kernels(tr))
    if not backward:
        assert stored < 0.05 * N * V * 4  # (max, sum, other, target) partials per split and the merged stats
        assert len(tr.launches) == 2  # the statistics kernel and the split merge
    flops = tr.flops
    assert flops >= 2 * N * V * D  # the logits are recomputed, never read back


def test_sampling_matches_the_full_count():
    """Sampled grids and loops give the full count for kernels whose programs and iterations do equal work."""
    x = torch.randn(40, 3000)

    def count(**caps):
        with plan_for_sms(132), count_traffic(**caps) as tr:  # a GPU's plan: one row per program
            softmax_forward(x, -1, block_size=256)
        (k,) = _kernels(tr)
        return k, (k.bytes_loaded, k.bytes_stored, k.bytes_reread)

    sampled, got = count(axis_cap=4, loop_cap=4)
    full, want = count(**FULL)
    assert sampled.programs_run < full.programs_run
    assert got == pytest.approx(want, rel=0.01)


def test_matmul_flops_and_sampled_loops_match_the_full_count():
    N, D, V = 48, 96, 640
    x, w = torch.randn(N, D), torch.randn(V, D) * 0.1
    y = torch.randint(0, V, (N,))

    def count(**caps):
        with count_traffic(**caps) as tr:
            lce_forward(x, w, None, y, ignore_index=-100, block_n=16, block_v=64, block_d=16)
        k = _kernels(tr)[0]
        return k.flops, k.bytes_loaded

    flops, loaded = count(axis_cap=3, loop_cap=3)
    assert flops == pytest.approx(2 * 48 * 640 * 96, rel=1e-9)  # every tile full: the exact matmul count
    assert (flops, loaded) == pytest.approx(count(**FULL), rel=0.01)


def test_counting_restores_the_interpreter():
    from triton.runtime import interpreter as interp

    before = (interp.InterpretedFunction.run, interp.InterpreterBuilder.create_masked_load)
    dst, src = torch.empty(256), torch.randn(256)
    with count_traffic() as tr:
        with pytest.raises(RuntimeError, match="do not nest"):
            with count_traffic():
                pass
        dst.copy_(src)  # torch glue: the destination is written, not read
    (g,) = tr.launches
    assert (g.kernel, g.bytes_loaded, g.bytes_stored) == ("aten.copy_", 1024, 1024)
    assert (interp.InterpretedFunction.run, interp.InterpreterBuilder.create_masked_load) == before
    x = torch.randn(2, 64)
    torch.testing.assert_close(softmax_forward(x, -1)[0], torch.softmax(x, -1))


def test_gpu_model_quick_cases_stay_within_their_documented_bounds(tmp_path):
    """benchmarks/gpu_model.py --quick (one case per family): every case within the bound docs/PERFORMANCE.md
    states for it, cut cross-entropy storing ~0 bytes of logits in two launches."""
    out = tmp_path / "gm.json"
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_model.py"), "--quick", "--families",
                        "softmax,quant_softmax,attention,linear_ce,cross_entropy", "--json", str(out)],
                       capture_output=True, text=True, cwd=root, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["family"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"softmax", "quant_softmax", "attention", "linear_ce", "cross_entropy"}
    for row in rows.values():
        assert row["within_bound"] and row["predicted_us"] > 0 and row["torch_predicted_us"] > 0, row
    lce = rows["linear_ce"]
    n, v = (int(t[1:]) for t in lce["shape"].split() if t[0] in "NV")
    # per-row partial statistics of each vocabulary split (4 x splits x N fp32), never the N x V logits
    assert lce["logits_bytes_stored"] < 0.05 * n * v * 2 and lce["launches"] == 2
    assert rows["softmax"]["ratio"] == 1.0 and rows["softmax"]["launches"] == 1


def test_backward_cases_time_torchs_backward_alone():
    """Every case has torch's path to time on a GPU; a backward case's runs torch's forward once and then only its
    backward through the kept graph (gradients for the case's inputs, the graph reused)."""
    from gpu_cases import all_cases, attention_case, ce_case, linear_ce_case, topk_case
    assert all(c.torch_run is not None for c in all_cases() if c.kernel.endswith("backward"))
    f32 = torch.float32
    for case, names in ((attention_case(1, 4, 2, 32, 16, backward=True, dtype=f32), ("q", "k", "v")),
                        (linear_ce_case(16, 8, 64, backward=True, dtype=f32), ("x", "w")),
                        (ce_case(16, 64, backward=True, dtype=f32), ("x",)),
                        (topk_case(4, 64, 5, renormalize=True, backward=True), ("x",))):
        a = case.make("cpu")
        first = case.torch_run(a)
        graph = a["torch_graph"]
        again = case.torch_run(a)
        assert a["torch_graph"] is graph
        assert [g.shape for g in again] == [a[n].shape for n in names]
        assert all(torch.equal(x, y) and torch.isfinite(x).all() for x, y in zip(first, again))


def test_a_tensor_left_in_l2_by_one_launch_is_a_hit_in_the_next():
    """Across launches: a tensor another launch wrote is read from L2 when it fits, and for the share of it L2
    holds when not (50 of 96 MiB); a launch of 64 MiB between pushes a 16 MiB tensor out (the same rule for torch's
    traces and our launches)."""
    from gpu_torch_paths import Tracer
    MiB = 2**20
    for mib, between, hit in ((16, 0, 16), (96, 0, 50), (16, 64, 0)):
        t = Tracer()
        a, b, c = t.buffer("a", mib * MiB), t.buffer("b", mib * MiB), t.buffer("c", 64 * MiB)
        t.stream("write", {}, {a: mib * MiB})
        if between:
            t.stream("other", {}, {c: between * MiB})
        t.stream("read", {a: mib * MiB}, {b: mib * MiB})
        last = t.traffic.launch_hbm()[-1]
        assert last == 2 * mib * MiB - hit * MiB, (mib, between, last / MiB)


def test_aten_softmax_sweeps_hit_l2_where_the_rows_in_flight_fit():
    """ATen's three-sweep softmax: re-reads from L2 for 64 rows of 512 KiB (32 MiB in flight), from DRAM for
    1024 such rows (one block per row, 264 resident)."""
    from gpu_torch_paths import Tracer, softmax
    for rows, reads in ((64, 1), (1024, 3)):
        t = Tracer()
        C = 131072
        softmax(t, t.buffer("x", rows * C * 4), t.buffer("y", rows * C * 4), rows, C, 4, 4)
        got = t.traffic.bytes_hbm / (rows * C * 4)
        assert abs(got - (reads + 1)) < 0.05, (rows, got)


def test_flash_attention_trace_and_our_kernel_count_the_same_flops():
    """The forward's FLOPs as FlashAttention-2's tiles compute them, causal diagonal tiles whole as ours are:
    equal work within the diagonal's share, so a prediction can favour neither side by FLOPs."""
    from gpu_cases import attention_case
    from gpu_model import measure
    row = measure(attention_case(1, 4, 4, 1024, 64), axis_cap=6, loop_cap=8)
    assert 0.9 < row["flops"] / row["torch_flops"] < 1.15, row
    assert row["torch_bytes_hbm"] > 0 and 0.87 < row["speedup_vs_torch"] <= 1.15, row


def test_loop_samples_share_one_lattice_and_weigh_every_iteration():
    """Loops that start apart (causal) sample the same tiles, and the weights sum to the loop's length."""
    from gpu_traffic import loop_strata
    loops = [range(63, n - 1, -1) for n in (0, 5, 20, 41)] + [range(n, 64) for n in (0, 7)]
    lattices = []
    for r in loops:
        picked = loop_strata(r, 8)
        assert sum(w for _, w in picked) == len(r) and len(picked) <= 8 and {v for v, _ in picked} <= set(r)
        lattices.append({v for v, _ in picked[1:-1]})
    assert lattices[1] <= lattices[0] and lattices[2] <= lattices[0] and lattices[5] <= lattices[4]
    assert loop_strata(range(3, 9), 8) == [(v, 1) for v in range(3, 9)]


@pytest.mark.parametrize("caps,tol", [((6, 8), 0.2), ((16, 32), 0.05)])
def test_sampled_dram_estimate_of_a_causal_backward_against_the_full_count(caps, tol):
    """FlashAttention-2's causal backward (tiles that 16 key-block programs of a head re-read): the sampled DRAM
    estimate within ``tol`` of the unsampled one (docs/PERFORMANCE.md, "GPU model", on where it is not)."""
    from gpu_torch_paths import Tracer, flash_backward
    got = []
    for ax, lp in (caps, (10**9, 10**9)):
        t = Tracer(axis_cap=ax, loop_cap=lp)
        flash_backward(t, 1, 16, 16, 2048, 2048, 128, 128, 2, True)
        got.append(t.traffic.bytes_hbm)
    assert abs(got[0] / got[1] - 1) < tol, got

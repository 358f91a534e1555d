"""Tests of the fused sampling kernel (smxcompile.kernels.sampling.triton_kernels.sample_triton).

On a machine without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before triton is imported) on CPU tensors; on a CUDA machine the same tests run the compiled kernel.

Reference: ``filtered_candidates`` / ``draw`` (smxcompile.kernels.sampling.candidates) on the same logits and
uniforms. Both keep the lowest indices among the entries tied at the top-p boundary or at the
``min_tokens_to_keep``-th value, as many as eager's sort keeps (checked against eager on integer logits). A token
must equal the reference's unless ``u * total`` lies within fp rounding of a boundary of the reference's
cumulative weights (at most 1% of the draws), and must always have a positive reference weight. Uniforms at the
middle of each kept entry's interval of the reference's CDF check that the kernel draws exactly the reference's
kept entries (ties at the k-th value included).
"""

import sys
from pathlib import Path

import pytest
import torch
from kernels_testing import DEVICE, TRITON_MARKS, compile_for_sm90, require_triton

require_triton()

from smxcompile.kernels.sampling.candidates import (  # noqa: E402
    NONFINITE_MESSAGE, draw, filtered_candidates, sample_candidates)
from smxcompile.kernels.sampling import triton_kernels  # noqa: E402
from smxcompile.kernels.sampling.triton_kernels import sample_triton  # noqa: E402

pytestmark = TRITON_MARKS

INF = float("inf")


def _opts(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, min_tokens_to_keep=1):
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep)


CONFIGS = {
    "top_k": _opts(top_k=20),
    "temperature_top_k": _opts(temperature=0.7, top_k=50),
    "top_p": _opts(top_p=0.9),
    "min_p": _opts(temperature=1.3, min_p=0.05),
    "all": _opts(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02),  # each binds on some row
    "top_k_top_p": _opts(top_k=30, top_p=0.7),  # flat rows: top-p's mass is over the top-k's
    "keep_3": _opts(top_p=0.3, min_p=0.5, min_tokens_to_keep=3),  # peaked rows: the 3 largest stay
}
#: The scale of the random logits of a configuration (3 unless given).
SCALES = {"top_k_top_p": 1.0, "keep_3": 6.0}


def _logits(B, V, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, V, generator=g) * scale).to(dtype).to(DEVICE)


def _uniform(n, seed=1):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _ref_cdf(x, opts):
    """Per row: the reference's kept weights in vocabulary order (fp64, (B, V)), and their cumulative sums."""
    idx, w = filtered_candidates(x, **opts)
    dense = torch.zeros(x.shape, dtype=torch.float64, device=x.device).scatter_(-1, idx, w.double())
    return dense, dense.cumsum(-1)


def _eager_kept(x, temperature, top_k, top_p, min_p, min_tokens_to_keep):
    """How many entries per row transformers' warpers keep (written out; ties broken by torch.sort)."""
    s = x.float() / temperature if temperature != 1.0 else x.float()
    if top_k:
        k = min(max(top_k, min_tokens_to_keep), s.shape[-1])
        s = s.masked_fill(s < torch.topk(s, k)[0][..., -1, None], -INF)
    if top_p < 1.0:
        sorted_s, order = torch.sort(s, descending=False)
        remove = sorted_s.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[..., -min_tokens_to_keep:] = False
        s = s.masked_fill(remove.scatter(1, order, remove), -INF)
    if min_p > 0.0:
        p = torch.softmax(s, -1)
        remove = p < min_p * p.amax(-1, keepdim=True)
        remove.scatter_(-1, torch.topk(p, min_tokens_to_keep, dim=-1).indices, False)
        s = s.masked_fill(remove, -INF)
    return torch.isfinite(s).sum(-1)


def _check_draws(x, u, opts, **launch):
    """The kernel's tokens at ``u`` against the reference's (see the module docstring)."""
    got = sample_triton(x, u, **opts, **launch)
    assert got.shape == (x.shape[0], 1) and got.dtype == torch.int64
    dense, cum = _ref_cdf(x, opts)
    ref = draw(torch.arange(x.shape[1], device=x.device).expand(x.shape), dense.float(), u)
    assert bool((dense.gather(-1, got) > 0).all()), "a token outside the reference's support"
    target = u.double()[:, None] * cum[:, -1:]
    near = ((cum - target).abs() <= 1e-5 * cum[:, -1:]).any(-1)  # within rounding of a boundary
    assert int(near.sum()) <= 0.01 * x.shape[0] + 1
    assert torch.equal(got[~near], ref[~near])


def _midpoints(x, opts, per_row=None, min_weight=1e-6):
    """Rows of ``x`` and uniforms at the middle of each kept entry's CDF interval (entries of relative weight
    >= min_weight; ``per_row`` of them spread over each row), with the entries they must draw."""
    dense, cum = _ref_cdf(x, opts)
    rows, us, want = [], [], []
    for r in range(x.shape[0]):
        total = cum[r, -1]
        cols = torch.nonzero(dense[r] >= min_weight * total).flatten()
        if per_row is not None and len(cols) > per_row:
            cols = cols[torch.linspace(0, len(cols) - 1, per_row).round().long()]
        mids = (cum[r, cols] - dense[r, cols] / 2) / total
        rows += [r] * len(cols)
        us.append(mids.float())
        want.append(cols)
    rows = torch.tensor(rows, device=x.device)
    return x[rows], torch.cat(us), torch.cat(want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_reference(name, dtype):
    opts = CONFIGS[name]
    x = _logits(4, 1200, dtype, scale=SCALES.get(name, 3.0), seed=len(name))
    rows = torch.arange(8, device=DEVICE) % 4  # 2 draws per row
    _check_draws(x[rows], _uniform(8, seed=len(name)), opts)


def test_every_kept_entry_drawable():
    """Uniforms in the middle of the reference's CDF intervals: exactly the reference's entries."""
    x = _logits(2, 700, torch.float16, seed=3)
    for opts in (CONFIGS["all"], CONFIGS["keep_3"], _opts(top_k=12)):
        xs, u, want = _midpoints(x, opts, per_row=8)
        assert torch.equal(sample_triton(xs, u, **opts, block_size=256).flatten(), want)


def test_ties_at_kth_value_all_kept():
    """Integer logits: many entries tie with the k-th value; every one of them can be drawn, as the reference."""
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-4, 3, (2, 300), generator=g).float().to(DEVICE)
    for opts in (_opts(top_k=10), _opts(temperature=0.5, top_k=25, min_tokens_to_keep=3)):
        dense, _ = _ref_cdf(x, opts)
        assert int((dense > 0).sum(-1).min()) > opts["top_k"]  # the ties are there
        xs, u, want = _midpoints(x, opts, per_row=16)
        got = sample_triton(xs.to(torch.bfloat16), u, **opts, block_size=128).flatten()
        assert torch.equal(got, want)
    # -0.0 ties with +0.0 at the k-th value
    z = torch.tensor([2.0] * 3 + [0.0, -0.0] * 4 + [-1.0] * 40)[torch.randperm(51, generator=g)].to(DEVICE)
    xs, u, want = _midpoints(z[None], _opts(top_k=5))
    assert len(want) == 11 and torch.equal(sample_triton(xs, u, **_opts(top_k=5), block_size=16).flatten(), want)
    zeros = torch.tensor([[-0.0, 0.0, -0.0, 0.0], [0.0, -0.0, 0.0, -0.0]], device=DEVICE)
    u = torch.tensor([0.1, 0.3, 0.6, 0.9] * 2, device=DEVICE)
    got = sample_triton(zeros.repeat_interleave(4, 0), u, **_opts(top_k=1, top_p=0.6))
    assert got.flatten().tolist() == [0, 0, 1, 2] * 2  # top-p keeps 3 of the 4 tied zeros: the first three


@pytest.mark.parametrize("path", ["candidates", "row passes"])
def test_ties_at_top_p_and_keep_min_counted_as_eager(path, monkeypatch):
    """Integer logits tie at the top-p boundary and at the ``min_tokens_to_keep``-th value: the reference keeps
    as many as eager, and the kernel draws exactly the reference's entries."""
    if path == "row passes":
        monkeypatch.setattr(triton_kernels, "MAX_CANDIDATES", 0)
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-3, 2, (6, 96), generator=g).float().to(DEVICE)
    cases = (_opts(top_p=0.5), _opts(top_p=0.2, min_tokens_to_keep=5), _opts(top_k=30, top_p=0.35),
             _opts(temperature=0.5, top_p=0.0, min_tokens_to_keep=3), _opts(min_p=0.9, min_tokens_to_keep=4))
    split = 0
    for opts in cases:
        dense, _ = _ref_cdf(x, opts)
        assert torch.equal((dense > 0).sum(-1).cpu(), _eager_kept(x, **opts).cpu()), opts
        lowest = torch.where(dense > 0, x, INF).amin(-1, keepdim=True)
        split += int(((x >= lowest).sum(-1) > (dense > 0).sum(-1)).sum())  # a tie group partly kept
        xs, u, want = _midpoints(x, opts, per_row=6)
        got = sample_triton(xs.to(torch.bfloat16), u, **opts, block_size=32).flatten()
        assert torch.equal(got, want), opts
    assert split >= 10


def test_strides():
    """Any strides: a column stride of 2, a transposed matrix (row stride 1), a broadcast row (stride 0)."""
    base = _logits(4, 2 * 900, seed=5)
    opts = CONFIGS["all"]
    _check_draws(base[:, ::2], _uniform(4, seed=2), opts)
    _check_draws(base[:, :900].t().contiguous().t(), _uniform(4, seed=3), opts, block_size=256)
    _check_draws(base[1].expand(16, 1800), _uniform(16, seed=4), opts)


def test_edge_options():
    """k >= V, top_p = 1.0, min_tokens_to_keep >= V (every filter off: plain sampling), and a row of V = 1."""
    x = _logits(2, 100, seed=6)
    plain = _opts(temperature=0.9)
    xs, u, want = _midpoints(x, plain, per_row=10)
    for opts in (_opts(temperature=0.9, top_k=100), _opts(temperature=0.9, top_k=500, top_p=1.0), plain,
                 _opts(temperature=0.9, top_p=0.2, min_p=0.9, min_tokens_to_keep=100)):
        assert torch.equal(sample_triton(xs, u, **opts).flatten(), want)
    one = _logits(3, 1, seed=7)
    assert sample_triton(one, _uniform(3), **CONFIGS["all"]).tolist() == [[0]] * 3
    assert sample_triton(one[:0], _uniform(0), **CONFIGS["all"]).shape == (0, 1)


def test_one_finite_logit():
    x = torch.full((3, 257), -INF, device=DEVICE)
    x[0, 0], x[1, 128], x[2, 256] = 5.0, -100.0, 0.0
    for opts in list(CONFIGS.values()) + [_opts(top_k=300), _opts(min_p=1.0)]:
        got = sample_triton(x, torch.tensor([0.0, 0.5, 0.999], device=DEVICE), **opts, block_size=64)
        assert got.flatten().tolist() == [0, 128, 256]


@pytest.mark.parametrize("bad", ["nan", "+inf", "all -inf"])
def test_nonfinite_rows_raise(bad):
    x = _logits(3, 300, seed=8)
    if bad == "nan":
        x[1, 17] = float("nan")
    elif bad == "+inf":
        x[1, 17] = INF
    else:
        x[1] = -INF
    for opts in (CONFIGS["top_k"], CONFIGS["all"]):
        with pytest.raises(RuntimeError, match="probability tensor contains"):
            sample_candidates(x, uniform=_uniform(3), **opts)
        with pytest.raises(RuntimeError) as err:
            sample_triton(x, _uniform(3), **opts, block_size=128)
        assert str(err.value) == NONFINITE_MESSAGE


@pytest.fixture
def row_passes(monkeypatch):
    """The kernel without its candidate path: every threshold by bisection over the row."""
    monkeypatch.setattr(triton_kernels, "MAX_CANDIDATES", 0)


@pytest.mark.parametrize("name", ["all", "top_p", "keep_3", "min_p"])
def test_row_passes_match_reference(name, row_passes):
    x = _logits(4, 1200, scale=SCALES.get(name, 3.0), seed=len(name))
    rows = torch.arange(16, device=DEVICE) % 4
    _check_draws(x[rows], _uniform(16, seed=len(name)), CONFIGS[name])


def _row_reads(x, opts):
    """How many times the kernel reads the logits: loaded bytes over the logits' bytes, every program and
    iteration counted (benchmarks/gpu_traffic.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gpu_traffic import count_traffic

    with count_traffic(axis_cap=1 << 20, loop_cap=1 << 20, count_torch=False) as traffic:
        sample_triton(x, _uniform(x.shape[0]), **opts)
    return traffic.bytes_loaded / (x.numel() * x.element_size())


@pytest.mark.skipif(DEVICE != "cpu", reason="counts interpreted launches")
def test_candidate_path_reads_row_five_times(monkeypatch):
    """Top-k (with top-p / min-p on its candidates), or a nucleus that fits: the row is read five times (range,
    three radix digits, compaction). A nucleus past MAX_CANDIDATES falls back to the bisection passes, which
    still draw from eager's support."""
    peaked, flat = _logits(2, 8192, scale=6.0, seed=9), _logits(2, 8192, scale=0.5, seed=9)
    for opts in (CONFIGS["all"], _opts(temperature=0.7, top_k=50), _opts(top_p=0.9), _opts(min_p=0.1)):
        scratch = 4096 * 8 / (8192 * 4) if not opts["top_k"] else 0.0  # the candidates read back, fp32 + int32
        assert _row_reads(peaked, opts) < 5.1 + scratch, opts
    assert _row_reads(flat, _opts(top_p=0.9)) > 8  # about 6000 of 8192 kept: the row's passes
    _check_draws(flat, _uniform(2, seed=5), _opts(top_p=0.9))
    monkeypatch.setattr(triton_kernels, "MAX_CANDIDATES", 0)
    assert _row_reads(peaked, CONFIGS["all"]) > 15


def test_compiles_for_sm90():
    """The kernel compiles for a GPU (fp64 scans, while loops, int64 pointer offsets), no GPU needed."""
    compile_for_sm90(
        """
        from smxcompile.kernels.sampling import triton_kernels as m
        fn = m._sample_kernel
        T = dict(u_ptr="*fp32", out_ptr="*i64", cand_s_ptr="*fp32", cand_i_ptr="*i32", V="i32", stride_b="i64",
                 stride_v="i64", temp="fp32", top_k="i32", n_cand="i32", keep_min="i32", one_minus_p="fp32",
                 min_p="fp32")
        n = 0
        for dt, scale, on, cap in (("*bf16", 2, True, 128), ("*fp16", 1, True, 0), ("*fp32", 0, False, 4096)):
            cs = dict(SCALE=scale, TOP_K=on, KEEP_MIN=on, TOP_P=True, CAND=cap > 0, CAP=max(cap, 1),
                      FIX_BF16=False, BLOCK=4096)
            sig = {a: "constexpr" if a in cs else dict(T, x_ptr=dt)[a] for a in fn.arg_names}
            k = triton.compile(triton.compiler.ASTSource(fn, sig, constexprs=cs), target=target,
                               options=dict(num_warps=8))
            for line in k.asm["ttir"].splitlines():
                mt = re.search(r"tt\\.addptr %[^,]+, %[^ ]+ : [^,]+, ([^ ]+?)(?: loc|$)", line.strip())
                if mt:
                    assert mt.group(1).endswith("i64>") or mt.group(1) == "i64", line
            assert "ld.local" not in k.asm["ptx"]  # no register spills
            n += 1
        print("compiled", n)
        """,
        3,
    )

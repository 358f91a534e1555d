"""The entmax package's test suite (``tests/`` of deep-spin/entmax), in our words, on our variants.

Its properties, checked on ``variants.get(name).apply`` against the installed ``entmax`` package (Peters et
al., "Sparse Sequence-to-Sequence Models", 2019; Correia et al., "Adaptively Sparse Transformers", 2019):
  - sparsemax / entmax15 / entmax_bisect give the package's values and input gradients on random rows, any
    dim, fp32 and fp64 (entmax_bisect at alpha 1.25, 1.5, 2 and per-row alphas);
  - the outputs are distributions (>= 0, sum 1) and sparse where the package's are (same support);
  - entmax_bisect at alpha = 2 is sparsemax and at alpha = 1.5 is entmax15; at alpha = 1 it is softmax;
  - fp64 gradcheck of the input gradient and of alpha's gradient (learnable alpha).
"""

from __future__ import annotations

import entmax
import pytest
import torch

from smxcompile import variants

PEER = {"sparsemax": lambda x, dim: entmax.sparsemax(x, dim),
        "entmax15": lambda x, dim: entmax.entmax15(x, dim),
        "entmax_bisect": lambda x, dim: entmax.entmax_bisect(x, 1.5, dim, n_iter=100)}


def _rows(dtype, shape=(4, 6, 9), seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2).to(dtype)


@pytest.mark.parametrize("dim", [-1, 0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", list(PEER))
def test_values_and_gradients_match_the_package(name, dtype, dim):
    x = _rows(dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    params = {"alpha": 1.5} if name == "entmax_bisect" else {}
    ours, peer = variants.get(name).apply(a, dim, **params), PEER[name](b, dim)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(ours, peer, **tol)
    assert torch.equal(ours > 0, peer > 0) or name == "entmax_bisect"    # bisection: support up to its tolerance
    assert bool((ours >= 0).all()) and torch.allclose(ours.sum(dim), torch.ones((), dtype=dtype))
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    torch.testing.assert_close(torch.autograd.grad((ours * w).sum(), a)[0],
                               torch.autograd.grad((peer * w).sum(), b)[0], **tol)


@pytest.mark.parametrize("alpha", [1.25, 2.0, "per_row"])
def test_entmax_bisect_alphas_match_the_package(alpha):
    x = _rows(torch.float64)
    if alpha == "per_row":
        alpha = 1.1 + torch.rand(4, 6, 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = variants.get("entmax_bisect").apply(a, -1, alpha=alpha)
    peer = entmax.entmax_bisect(b, alpha, -1, n_iter=100)
    torch.testing.assert_close(ours, peer, rtol=1e-6, atol=1e-8)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad((ours * w).sum(), a)[0],
                               torch.autograd.grad((peer * w).sum(), b)[0], rtol=1e-5, atol=1e-7)


def test_bisect_special_alphas_are_the_closed_forms():
    x = _rows(torch.float64)
    bisect = variants.get("entmax_bisect")
    torch.testing.assert_close(bisect.apply(x, -1, alpha=2.0), variants.get("sparsemax").apply(x, -1))
    torch.testing.assert_close(bisect.apply(x, -1, alpha=1.5), variants.get("entmax15").apply(x, -1))
    torch.testing.assert_close(bisect.apply(x, -1, alpha=1.0), torch.softmax(x, -1))


@pytest.mark.parametrize("name", list(PEER))
def test_input_gradcheck(name):
    x = _rows(torch.float64, (3, 7), seed=4).requires_grad_()
    params = {"alpha": 1.3} if name == "entmax_bisect" else {}
    assert torch.autograd.gradcheck(lambda t: variants.get(name).apply(t, -1, **params), (x,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("start", [1.0, 1.2, 1.7])
def test_learnable_alpha_gradcheck(start):
    """The package's ``EntmaxAlpha`` trains alpha: its gradient must be right, also starting at exactly 1."""
    x = _rows(torch.float64, (3, 7), seed=5)
    alpha = torch.full((3, 1), start, dtype=torch.float64, requires_grad=True)
    f = lambda al: variants.get("entmax_bisect").apply(x, -1, alpha=al)  # noqa: E731
    p = f(alpha)
    g = torch.autograd.grad((p * torch.linspace(-1, 1, 7, dtype=torch.float64)).sum(), alpha)[0]
    spread = (p > 0).sum(-1, keepdim=True) > 1          # a one-hot row does not move with alpha
    assert bool((g[spread] != 0).all()) and bool((g[~spread] == 0).all())
    if start > 1:     # alpha < 1 is outside the domain: one-sided check at 1 is the variant's own test
        assert torch.autograd.gradcheck(f, (alpha,), eps=1e-6, atol=1e-5)

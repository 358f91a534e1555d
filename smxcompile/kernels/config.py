"""Switches of the kernel layer (module-level, for tests and debugging)."""

import os

#: Run the Triton kernels on CPU tensors too (needs ``TRITON_INTERPRET=1`` set before
#: triton is imported). Tests use it to drive the Triton path end to end on a CPU machine.
force_triton: bool = os.environ.get("SMX_FORCE_TRITON", "") == "1"


def triton_available() -> bool:
    """True when triton imports."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def use_triton(x) -> bool:
    """Whether an op on tensor ``x`` runs its Triton kernel (CUDA, or CPU under ``force_triton``).

    fp64 always takes the torch path (the kernels accumulate in fp32)."""
    import torch

    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if x.is_cuda:
        return triton_available()
    return force_triton and os.environ.get("TRITON_INTERPRET") == "1" and triton_available()


def eager_aten(x) -> bool:
    """Whether a public op called on ``x`` runs its ATen composition under torch's autograd instead of the custom
    op: outside ``torch.compile`` / ``torch.export`` tracing, on a tensor without a Triton kernel, where the op
    measured slower (docs/PERFORMANCE.md, "Public ops called eagerly, against the torch code they replace")."""
    import torch

    return not torch.compiler.is_compiling() and not use_triton(x)

"""What every Triton launcher of smxcompile shares: triton's optional import (:data:`triton` and :data:`tl` are
None without it), the check before a launch (:func:`check_runtime`), launch arithmetic, the ``@triton.jit``
helpers several kernels call (with the interpreter's bf16 and libdevice workarounds) and the row layout of
softmax-like kernels. Runtime modes and layouts: docs/DESIGN.md, "Triton runtime and row layouts".
"""

from __future__ import annotations

import contextlib
import os

import torch

try:  # triton is optional: smxcompile must import without it.
    import triton
    import triton.language as tl
except Exception as _e:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    #: Why ``import triton`` failed (None when it imported).
    TRITON_IMPORT_ERROR: Exception | None = _e
else:
    TRITON_IMPORT_ERROR = None

#: TRITON_INTERPRET as it was when this module was imported (the kernels' mode when triton cannot tell).
INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"

#: Row-layout modes of :func:`row_layout` / :func:`row_offset`.
MODE_STRIDE, MODE_2D, MODE_TABLE = 0, 1, 2
#: Target elements per program when several short rows share one (:func:`row_plan`).
ROWS_TILE_ELEMS = 4096


# ---- Runtime checks ----


def interpret_env() -> bool:
    """Whether TRITON_INTERPRET is set now (as triton parses it)."""
    try:
        return bool(triton.knobs.runtime.interpret)
    except Exception:  # pragma: no cover - older/newer triton without knobs, or no triton
        return os.environ.get("TRITON_INTERPRET") == "1"


def interpreted() -> bool:
    """Whether smxcompile's kernels were decorated in interpreter mode (TRITON_INTERPRET=1 when imported)."""
    if triton is None:
        return INTERPRET_AT_IMPORT  # no kernels were defined
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # pragma: no cover
        return INTERPRET_AT_IMPORT
    return isinstance(safe_max, InterpretedFunction)


def check_runtime(t: torch.Tensor, what: str) -> None:
    """Raise a RuntimeError saying what to do when the ``what`` kernels (e.g. "softmax") cannot run on ``t``:
    triton missing; kernels decorated for the interpreter but ``t`` on CUDA; ``t`` on CPU without
    TRITON_INTERPRET=1, or with it set after the kernels were decorated for a GPU."""
    if triton is None:
        raise RuntimeError(
            f"smxcompile's Triton {what} kernels need triton, which failed to import "
            f"({TRITON_IMPORT_ERROR!r}); install it with `pip install smxcompile[triton]`"
        )
    if t.is_cuda:
        if interpreted():
            raise RuntimeError(
                f"the Triton {what} kernels were loaded in interpreter mode (TRITON_INTERPRET=1) and cannot "
                "run on CUDA tensors; unset TRITON_INTERPRET before importing triton"
            )
        return
    if not interpret_env():
        raise RuntimeError(
            f"the Triton {what} path needs CUDA or TRITON_INTERPRET=1 (Triton's CPU interpreter, set before "
            f"triton is imported); got a tensor on {t.device}"
        )
    if not interpreted():
        raise RuntimeError(
            f"TRITON_INTERPRET=1 was set after {__name__} was imported; the kernels were compiled for a GPU. "
            "Set TRITON_INTERPRET=1 before importing triton"
        )
    if t.device.type != "cpu":
        raise RuntimeError(f"the Triton interpreter runs on CPU tensors, got a tensor on {t.device}")


def on_device(t: torch.Tensor):
    """Context manager: launch on t's GPU (Triton launches on the current device); nothing on CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ---- Launch arithmetic ----


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (``b > 0``)."""
    return -(-a // b)


_SM_COUNT: dict = {}

#: SMs to plan interpreter launches for: None plans the fewest programs; :func:`plan_for_sms` sets a GPU's count
#: (``benchmarks/gpu_model.py`` counts the grids that GPU would run).
PLAN_SMS: int | None = None


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def planned_sms(device: torch.device) -> int | None:
    """The SMs a launch on ``device`` is planned for: the CUDA device's, else :data:`PLAN_SMS` (None: plan for the
    interpreter)."""
    return sm_count(device) if device.type == "cuda" else PLAN_SMS


@contextlib.contextmanager
def plan_for_sms(sms: int):
    """Context manager: plan interpreter launches as on a GPU with ``sms`` SMs. Raises ValueError for ``sms`` not
    a positive int."""
    global PLAN_SMS
    if isinstance(sms, bool) or not isinstance(sms, int) or sms < 1:
        raise ValueError(f"sms must be a positive int, got {sms!r}")
    saved, PLAN_SMS = PLAN_SMS, sms
    try:
        yield
    finally:
        PLAN_SMS = saved


def pow2_block(name: str, value: int | None, default: int, extent: int, minimum: int) -> int:
    """A power-of-two block size: ``value`` if given, else ``default`` shrunk to ``extent`` (the problem's size
    along the block), never below ``minimum``. Raises ValueError for ``value`` not a power of two >= ``minimum``."""
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= {minimum}, got {value!r}")
        return value
    return max(minimum, min(default, next_pow2(max(extent, 1))))


def launch_opts(num_warps: int | None, num_stages: int | None, warps: int, stages: int | None) -> dict:
    """``{"num_warps", "num_stages"}`` of a launch: the overrides, else ``warps`` and ``stages`` (no
    ``num_stages`` when both are None). Raises ValueError for an override that is not a positive int."""
    for name, v in (("num_warps", num_warps), ("num_stages", num_stages)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    opts = {"num_warps": num_warps or warps}
    if num_stages or stages:
        opts["num_stages"] = num_stages or stages
    return opts


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for ``dtype``: native for 16-bit; for fp32, torch's
    ``get_float32_matmul_precision()`` ("highest" -> IEEE, "high" -> tf32x3, "medium" -> tf32)."""
    if dtype != torch.float32:
        return "ieee"  # ignored for fp16 / bf16 operands (tensor cores, fp32 accumulation)
    return {"highest": "ieee", "high": "tf32x3", "medium": "tf32"}.get(torch.get_float32_matmul_precision(), "ieee")


def dot_f32(dtype: torch.dtype | None) -> bool:
    """The ``DOT_F32`` constexpr of :func:`dot`: bf16 operands in the interpreter (which mishandles them)."""
    return dtype == torch.bfloat16 and interpreted()


# ---- Row layout (softmax-like kernels) ----


def row_layout(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, int, int, int, int, int]:
    """Row layout of ``t`` viewed as R x C (C = t.shape[dim]), without a copy: ``(rows_table, s0, n1, s1,
    col_stride, mode)``; row ``r``'s offset is ``r*s0`` (mode 0), ``(r//n1)*s0 + (r%n1)*s1`` (mode 1) or
    ``rows_table[r]`` (mode 2, int64 [R]; ``t`` itself, unused, otherwise)."""
    col_stride = t.stride(dim)
    axes = [(s, st) for i, (s, st) in enumerate(zip(t.shape, t.stride())) if i != dim and s != 1]
    merged: list[tuple[int, int]] = []
    for s, st in axes:
        if merged and merged[-1][1] == s * st:
            ps, _ = merged[-1]
            merged[-1] = (ps * s, st)
        else:
            merged.append((s, st))
    if not merged:
        return t, 0, 1, 0, col_stride, MODE_STRIDE
    if len(merged) == 1:
        return t, merged[0][1], 1, 0, col_stride, MODE_STRIDE
    if len(merged) == 2:
        (_, s0), (n1, s1) = merged
        return t, s0, n1, s1, col_stride, MODE_2D
    off = torch.zeros((), dtype=torch.int64, device=t.device)
    for s, st in merged:
        off = off.unsqueeze(-1) + torch.arange(s, dtype=torch.int64, device=t.device) * st
    return off.reshape(-1), 0, 1, 0, col_stride, MODE_TABLE


def row_plan(R: int, C: int, device: torch.device, block_size: int | None, max_fused_block: int,
             loop_block: int) -> tuple[int, int, bool, int]:
    """``(ROWS, BLOCK, SINGLE, num_warps)`` of a row-wise kernel on R x C: a row of up to ``max_fused_block``
    columns is one block (``SINGLE``), a longer one swept in ``loop_block`` blocks; ``block_size`` (a power of
    two, else ValueError) overrides both. Short rows share a program, ~2 programs per SM on CUDA."""
    if block_size is not None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 \
                or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {block_size!r}")
        cap = block_size
    else:
        cap = max_fused_block
    full = next_pow2(C)
    if full <= cap:
        block, single = full, True
    else:
        block, single = (block_size if block_size is not None else loop_block), False
    rows = 1
    if block < ROWS_TILE_ELEMS:  # short rows (or small test blocks): several rows per program
        rows = min(ROWS_TILE_ELEMS // block, next_pow2(R))
        sms = planned_sms(device)
        if sms is not None:  # a GPU: keep at least ~2 programs per SM
            per = max(1, R // (2 * sms))
            rows = min(rows, 1 << (per.bit_length() - 1))
    elems = rows * block
    # ~32 fp32 values per thread at most (docs/PERFORMANCE.md, "Softmax kernels: register budgets")
    num_warps = 32 if elems >= 32768 else 16 if elems >= 16384 else 8 if elems >= 4096 else 4 if elems >= 1024 else 2
    return rows, block, single, num_warps


# ---- @triton.jit helpers ----

if triton is not None:

    @triton.jit
    def safe_max(m):
        """The running max as the exp() offset: ``m`` when finite, else 0 (as ``torch.logsumexp``)."""
        return tl.where(tl.abs(m) == float("inf"), 0.0, m)

    @triton.jit
    def tanh(u):
        """fp32 tanh without libdevice (which the interpreter lacks), ~2 ulp: a Taylor polynomial near 0,
        ``(1 - e) / (1 + e)`` with ``e = exp(-2|u|)`` elsewhere."""
        a = tl.abs(u)
        e = tl.exp(-2.0 * a)
        big = (1.0 - e) / (1.0 + e)
        a2 = a * a
        # tanh(a) = a - a^3/3 + 2a^5/15 - 17a^7/315 + 62a^9/2835 - 1382a^11/155925 + ...
        p = -1382.0 / 155925.0
        p = p * a2 + 62.0 / 2835.0
        p = p * a2 - 17.0 / 315.0
        p = p * a2 + 2.0 / 15.0
        p = p * a2 - 1.0 / 3.0
        small = a + a * a2 * p
        t = tl.where(a < 0.25, small, big)
        return tl.where(u < 0.0, -t, t)

    @triton.jit
    def cast_like(x, ptr, FIX_BF16: tl.constexpr):
        """fp32 ``x`` cast to ``ptr``'s element type, to nearest even (``FIX_BF16``: by hand, for the
        interpreter's truncating bf16 cast)."""
        ty = ptr.dtype.element_ty
        if FIX_BF16:
            if ty == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
                x = bits.to(tl.float32, bitcast=True)
        return x.to(ty)

    @triton.jit
    def dot(a, b, acc, PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """``acc + a @ b`` with fp32 accumulation; ``DOT_F32`` upcasts the operands first (exact for bf16)."""
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PREC)

    @triton.jit
    def row_offset(rows, row_ok, rows_ptr, s0, n1, s1, MODE: tl.constexpr):
        """int64 element offset of each row in ``rows`` (int64 [ROWS]), in the layout :func:`row_layout` gave."""
        if MODE == 0:
            off = rows * s0
        elif MODE == 1:
            off = (rows // n1) * s0 + (rows % n1) * s1
        else:
            off = tl.load(rows_ptr + rows, mask=row_ok, other=0)
        return off.to(tl.int64)

"""``smx demo`` training runs: one per backend, from the same weights on the same batches (per-step
loss and time, step-1 gradients, peak memory, held-out loss), and their comparison with the reference
backend (:func:`compare`)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time
from typing import Any, Callable

from .memory import PeakMemory
from .settings import DEFAULT_GRAD_TOLERANCE, DEFAULT_LATE_TOLERANCE, DEFAULT_STRICT_STEPS, DEFAULT_TOLERANCE, \
    LATE_WINDOW, Settings

EVAL_BATCHES = 4  # at most this many held-out batches are evaluated per backend

#: Extra names ``--backends`` accepts: a backend with options.
BACKEND_VARIANTS: dict[str, tuple[str, dict]] = {
    # every softmax rewritten to smx ops, attention and CPU included: shows the rewrite path training
    "smx-rewrite": ("smx", {"cpu": "rewrite", "cuda": "rewrite", "attention": False, "attention_softmax": True}),
}


@dataclasses.dataclass
class BackendRun:
    """What one backend did: per-step losses and times, compile time, memory, evaluation loss."""

    name: str
    losses: list[float] = dataclasses.field(default_factory=list)
    step_s: list[float] = dataclasses.field(default_factory=list)
    step1_grads: dict[str, Any] | None = None  # gradients after the first backward (dropped after compare)
    eval_loss: float | None = None
    peak_mem_bytes: int | None = None
    mem_method: str = ""
    error: str | None = None
    model: Any = None  # the trained (uncompiled) nn.Module

    @property
    def first_step_s(self) -> float | None:
        return self.step_s[0] if self.step_s else None

    @property
    def median_step_s(self) -> float | None:
        return statistics.median(self.step_s[1:]) if len(self.step_s) > 1 else None

    @property
    def compile_s(self) -> float | None:
        """First step minus a steady step: time spent compiling forward and backward."""
        if self.name == "eager" or self.median_step_s is None:
            return None
        return max(0.0, self.first_step_s - self.median_step_s)


def train_backend(name: str, model, batches: list, s: Settings, device: str,
                  on_step: Callable[[int, float, float], None] | None = None) -> BackendRun:
    """Train ``model`` in place for ``len(batches)`` AdamW steps under ``backend=name``.

    ``name == "eager"`` runs the module uncompiled; anything else is
    ``torch.compile(model, backend=name)``. Memory is measured over steps 2..N
    (after compiling). Exceptions are caught and stored in ``.error``.
    """
    import torch

    run = BackendRun(name=name, model=model)
    torch._dynamo.reset()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    mem: PeakMemory | None = None
    try:
        if name == "eager":
            step_fn = model
        else:
            backend, options = BACKEND_VARIANTS.get(name, (name, None))
            step_fn = torch.compile(model, backend=backend, options=options)
        with contextlib.ExitStack() as stack:
            for i, batch in enumerate(batches):
                if i == 1:
                    mem = stack.enter_context(PeakMemory(device))
                batch = batch.to(device)
                sync()
                t0 = time.perf_counter()
                loss = step_fn(input_ids=batch, labels=batch).loss
                loss.backward()
                if i == 0:
                    t_grab = time.perf_counter()
                    run.step1_grads = {n: p.grad.detach().to("cpu", copy=True)
                                       for n, p in model.named_parameters() if p.grad is not None}
                    t0 += time.perf_counter() - t_grab  # not part of the step
                opt.step()
                opt.zero_grad(set_to_none=True)
                value = loss.item()
                sync()
                dt = time.perf_counter() - t0
                run.losses.append(value)
                run.step_s.append(dt)
                if on_step:
                    on_step(i, value, dt)
                if i == 0:
                    # Compiling leaves millions of Python objects behind; collect them now and
                    # freeze the survivors so no gen-2 collection lands inside a timed step.
                    gc.collect()
                    gc.freeze()
                if not math.isfinite(value):
                    raise FloatingPointError(f"loss is {value} at step {i + 1}")
    except Exception as e:  # report and go on with the other backends
        run.error = f"{type(e).__name__}: {e}".strip().splitlines()[0][:500]
    finally:
        gc.unfreeze()
    if mem is not None and mem.peak_bytes is not None:
        run.peak_mem_bytes, run.mem_method = mem.peak_bytes, mem.method
    return run


def evaluate(model, windows, batch_size: int, device: str) -> float:
    """Mean loss of the (uncompiled) ``model`` on up to ``EVAL_BATCHES`` batches of held-out windows."""
    import torch

    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(0, min(len(windows), EVAL_BATCHES * batch_size), batch_size):
            b = windows[i:i + batch_size].to(device)
            losses.append(model(input_ids=b, labels=b).loss.item())
    model.train()
    return sum(losses) / len(losses)


# --------------------------------------------------------------------------- comparing


def grad_errors(grads: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Per parameter: ``||g - g_ref|| / ||g_ref||`` (the denominator floored at 1e-6 of the total norm)."""
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in ref.values()))
    floor = max(total * 1e-6, 1e-30)
    out = {}
    for name, r in ref.items():
        g = grads.get(name)
        if g is None or g.shape != r.shape:
            out[name] = math.inf
            continue
        out[name] = float((g.double() - r.double()).norm()) / max(float(r.double().norm()), floor)
    return out


def compare(runs: list[BackendRun], tolerance: float = DEFAULT_TOLERANCE, strict_steps: int = DEFAULT_STRICT_STEPS,
            late_tolerance: float = DEFAULT_LATE_TOLERANCE,
            grad_tolerance: float = DEFAULT_GRAD_TOLERANCE) -> dict[str, Any]:
    """Check every backend against the reference (eager, else the first backend that ran).

    A backend agrees when

    * after the first backward (same weights, same batch for everyone) every
      parameter's gradient is within ``grad_tolerance`` of the reference's, as
      ``||g - g_ref|| / ||g_ref||`` (skipped when gradients were not recorded),
    * each of the first ``strict_steps`` per-step losses satisfies
      ``|loss - ref| <= tolerance * |ref|`` (same weights up to rounding: a wrong
      kernel shows up here), and
    * the mean loss over the last ``LATE_WINDOW`` steps and the held-out loss are
      within ``late_tolerance`` (relative) of the reference's. Later steps are not
      compared one by one: training is chaotic, and two correct fp32 backends drift
      apart exponentially once rounding differences have been amplified.

    Returns a JSON-ready dict with ``reference``, ``passed``, the tolerances, and per
    backend ``max_abs_diff`` / ``max_rel_diff`` (all steps, for the table),
    ``grad_max_rel_err`` / ``grad_worst_param``, ``strict_max_rel_diff``,
    ``late_rel_diff``, ``eval_rel_diff``, ``agrees`` and ``why``.
    """
    ok = [r for r in runs if r.error is None]
    ref = next((r for r in ok if r.name == "eager"), ok[0] if ok else None)
    out: dict[str, Any] = {"reference": ref.name if ref else None, "tolerance": tolerance,
                           "grad_tolerance": grad_tolerance,
                           "strict_steps": strict_steps, "late_tolerance": late_tolerance,
                           "late_window": LATE_WINDOW, "backends": {}}
    passed = ref is not None

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-12)

    for r in runs:
        row: dict[str, Any] = dict(max_abs_diff=None, max_rel_diff=None, grad_max_rel_err=None,
                                   grad_worst_param=None, strict_max_rel_diff=None, late_rel_diff=None,
                                   eval_rel_diff=None)
        if r.error is not None:
            row.update(agrees=False, why=f"failed: {r.error}")
        elif ref is None or len(r.losses) != len(ref.losses):
            row.update(agrees=False, why="no reference to compare with")
        else:
            rel_d = [rel(a, b) for a, b in zip(r.losses, ref.losses)]
            row["max_abs_diff"] = max(abs(a - b) for a, b in zip(r.losses, ref.losses))
            row["max_rel_diff"] = max(rel_d)
            k = min(strict_steps, len(rel_d))
            worst = max(range(k), key=rel_d.__getitem__)
            row["strict_max_rel_diff"] = rel_d[worst]
            w = min(LATE_WINDOW, len(r.losses))
            row["late_rel_diff"] = rel(statistics.fmean(r.losses[-w:]), statistics.fmean(ref.losses[-w:]))
            if r.eval_loss is not None and ref.eval_loss is not None:
                row["eval_rel_diff"] = rel(r.eval_loss, ref.eval_loss)
            if r.step1_grads is not None and ref.step1_grads is not None:
                errs = grad_errors(r.step1_grads, ref.step1_grads)
                row["grad_worst_param"] = max(errs, key=errs.__getitem__)
                row["grad_max_rel_err"] = errs[row["grad_worst_param"]]
            if row["grad_max_rel_err"] is not None and not row["grad_max_rel_err"] <= grad_tolerance:
                row.update(agrees=False, why=f"step-1 gradient of {row['grad_worst_param']} differs by "
                                             f"{row['grad_max_rel_err']:.1e} (> --grad-tolerance {grad_tolerance:g})")
            elif rel_d[worst] > tolerance:
                row.update(agrees=False, why=f"step {worst + 1}: loss {r.losses[worst]:.6f} vs {ref.losses[worst]:.6f} "
                                             f"(relative {rel_d[worst]:.1e} > --tolerance {tolerance:g})")
            elif row["late_rel_diff"] > late_tolerance:
                row.update(agrees=False, why=f"mean loss of the last {w} steps differs by {row['late_rel_diff']:.1e} "
                                             f"(> --late-tolerance {late_tolerance:g})")
            elif row["eval_rel_diff"] is not None and row["eval_rel_diff"] > late_tolerance:
                row.update(agrees=False, why=f"held-out loss {r.eval_loss:.6f} vs {ref.eval_loss:.6f} "
                                             f"(> --late-tolerance {late_tolerance:g})")
            else:
                row.update(agrees=True, why="")
        passed = passed and row["agrees"]
        out["backends"][r.name] = row
    out["passed"] = passed
    return out

"""``smx demo`` settings: its options (``add_arguments``), their defaults for the full run and for
``--quick``, the tolerances of the agreement check, and the command line that reproduces a run."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path
from typing import Any

from ..argtypes import positive_float, positive_int
from .data import CORPORA

#: Settings of the full run: a 32K BPE head and 2048-token windows, where the rewrites matter; why: docs/PERFORMANCE.md,
#: "`smx demo`: why the default run is 2048 tokens, batch 1, 40 steps".
DEFAULTS: dict[str, Any] = dict(
    steps=40,
    batch_size=1,
    seq_len=2048,
    layers=4,
    n_embd=256,
    heads=4,
    vocab_size=32000,
    lr=1e-3,
    corpus="topics+docstrings",
    strict_steps=20,
)

#: Settings of ``--small``: the earlier default (128-token windows, 16K vocabulary), where the attention blocks
#: are kept on CPU (below 512 keys) and smx is about Inductor's speed.
SMALL: dict[str, Any] = dict(
    steps=120,
    batch_size=8,
    seq_len=128,
    layers=4,
    n_embd=256,
    heads=4,
    vocab_size=16384,
    lr=1e-3,
    corpus="topics+docstrings",
    strict_steps=40,
)

#: Settings of ``--quick`` (tests, CI): tiny model, small vocab, a handful of steps.
QUICK: dict[str, Any] = dict(
    steps=6,
    batch_size=4,
    seq_len=64,
    layers=2,
    n_embd=64,
    heads=2,
    vocab_size=2048,
    lr=1e-3,
    corpus="topics",
    strict_steps=40,
)

#: The agreement check's bounds: docs/PERFORMANCE.md, "`smx demo`: how the agreement check was sized".
DEFAULT_TOLERANCE = 1e-4
DEFAULT_GRAD_TOLERANCE = 1e-5
DEFAULT_STRICT_STEPS = 40
DEFAULT_LATE_TOLERANCE = 2e-2
LATE_WINDOW = 20

_DESCRIPTION = """\
Train a small GPT-2 (transformers, eager attention) on Python's bundled
documentation with a BPE tokenizer trained on that text, once per backend
(eager, Inductor, smx) from the same initial weights on the same batches.
Prints the smx rewrite report, a side-by-side table of loss, compile time,
step time and peak memory, and checks that every backend's losses agree with
eager's. Saves the smx-trained checkpoint (safetensors + config + tokenizer),
results.json and, if matplotlib is installed, loss.png into --out.
Exit code: 0 when all backends agree, 1 when one disagrees or fails."""

_EPILOG = """\
examples:
  smx demo                                  full run (~5 min on 2 CPU cores): 2048-token windows, 32K vocab
  smx demo --small                          the earlier default: 128-token windows, 16K vocab
  smx demo --quick                          tiny model, a few steps (CI smoke test)
  smx demo --backends inductor,smx          skip eager (inductor becomes the reference)
  smx demo --steps 300 --layers 6 --out run2
  smx demo --steps 300 --late-tolerance 0.05  longer run: the late check is about drift

outputs (in --out, default ./smx-demo-out):
  checkpoint/    GPT2LMHeadModel.from_pretrained(...) and
                 PreTrainedTokenizerFast.from_pretrained(...) load it
  results.json   per-step losses and times, the table, the rewrite report
  loss.png       loss curves (only when matplotlib is importable)

notes:
  Dropout is 0 so that the backends see identical computations. Agreement with
  eager: at step 1 (same weights, same batch) every parameter's gradient must be
  within --grad-tolerance (relative norm) of eager's, which is what exposes a
  wrong softmax kernel; steps 1..--strict-steps must satisfy
  |loss - eager| <= tolerance*|eager|;
  after that fp32 rounding differences grow chaotically (two correct backends
  reach ~1e-3 by step ~110 with --small, 1e-4 by step 40 with the default one
  window per step), so only the mean loss of the last 20 steps and the
  held-out loss are compared, within --late-tolerance. "compile" is the
  first step's time minus a steady step's time. Peak memory is the peak RSS
  increase during steps 2..N on CPU (torch.cuda.max_memory_allocated on CUDA).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``smx demo`` options to ``parser`` (the CLI calls this for the ``demo`` subcommand).

    Options whose default depends on ``--quick`` default to ``None`` here and are
    resolved by :func:`resolve_settings`; an explicit value always wins.
    """
    parser.description = _DESCRIPTION
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter

    def d(key: str) -> str:
        return f"(default: {DEFAULTS[key]}; with --small: {SMALL[key]}; with --quick: {QUICK[key]})"

    g = parser.add_argument_group("run")
    g.add_argument("--quick", action="store_true",
                   help="tiny settings for tests and CI: small model, vocab 2048, a few steps "
                        "(well under a minute per backend); explicit options still win")
    g.add_argument("--small", action="store_true",
                   help="the earlier default: 128-token windows, a 16K vocabulary, batch 8, 120 steps (the "
                        "attention blocks are kept on CPU below 512 keys); explicit options still win")
    g.add_argument("--backends", default="eager,inductor,smx", metavar="LIST",
                   help="comma-separated torch.compile backends, run in this order; 'eager' means "
                        "no compile and is the reference; 'smx-rewrite' is smx with options "
                        "{'cpu': 'rewrite', 'cuda': 'rewrite', 'attention': False, 'attention_softmax': True}, which rewrites every softmax to smx::softmax "
                        "(default: eager,inductor,smx)")
    g.add_argument("--steps", type=positive_int, default=None, metavar="N",
                   help=f"training steps per backend {d('steps')}")
    g.add_argument("--tolerance", type=positive_float, default=DEFAULT_TOLERANCE, metavar="REL",
                   help="max relative difference of each of the first --strict-steps losses from the "
                        f"reference backend's (default: {DEFAULT_TOLERANCE:g})")
    g.add_argument("--grad-tolerance", type=positive_float, default=DEFAULT_GRAD_TOLERANCE, metavar="REL",
                   help="max ||g - g_ref|| / ||g_ref|| of any parameter's gradient at step 1, where every backend "
                        f"starts from the same weights and batch (default: {DEFAULT_GRAD_TOLERANCE:g})")
    g.add_argument("--strict-steps", type=positive_int, default=None, metavar="K",
                   help="how many leading steps are held to --tolerance; later steps drift chaotically "
                        f"{d('strict_steps')}")
    g.add_argument("--late-tolerance", type=positive_float, default=DEFAULT_LATE_TOLERANCE, metavar="REL",
                   help=f"max relative difference of the mean loss over the last {LATE_WINDOW} steps and of "
                        f"the held-out loss (default: {DEFAULT_LATE_TOLERANCE:g})")
    g.add_argument("--seed", type=int, default=0, help="seed for the weights and the batch order (default: 0)")
    g.add_argument("--out", type=Path, default=Path("smx-demo-out"), metavar="DIR",
                   help="where checkpoint/, results.json and loss.png go (default: smx-demo-out)")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto = cuda when available, else cpu (default: auto)")

    g = parser.add_argument_group("model and data")
    g.add_argument("--batch-size", type=positive_int, default=None, metavar="B", help=f"windows per step {d('batch_size')}")
    g.add_argument("--seq-len", type=positive_int, default=None, metavar="T", help=f"tokens per window {d('seq_len')}")
    g.add_argument("--layers", type=positive_int, default=None, metavar="L", help=f"transformer layers {d('layers')}")
    g.add_argument("--n-embd", type=positive_int, default=None, metavar="D", help=f"hidden size {d('n_embd')}")
    g.add_argument("--heads", type=positive_int, default=None, metavar="H", help=f"attention heads {d('heads')}")
    g.add_argument("--vocab-size", type=positive_int, default=None, metavar="V",
                   help=f"BPE vocabulary and LM-head width; keep >= 16384 for a realistic head and loss {d('vocab_size')}")
    g.add_argument("--lr", type=positive_float, default=None, help=f"AdamW learning rate {d('lr')}")
    g.add_argument("--corpus", choices=CORPORA, default=None,
                   help="'topics' = pydoc_data.topics only (~465K chars, its BPE saturates near 9K tokens); "
                        "'topics+docstrings' adds the standard library's docstrings (~2.2M chars in all) "
                        f"where the BPE reaches ~27K tokens {d('corpus')}")


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser for ``python -m smx_app.demo`` (same options as ``smx demo``)."""
    parser = argparse.ArgumentParser(prog="smx demo")
    add_arguments(parser)
    return parser


@dataclasses.dataclass
class Settings:
    """Every knob of one demo run, after ``--quick`` and the defaults are applied."""

    backends: list[str]
    steps: int
    batch_size: int
    seq_len: int
    layers: int
    n_embd: int
    heads: int
    vocab_size: int
    lr: float
    corpus: str
    tolerance: float
    grad_tolerance: float
    strict_steps: int
    late_tolerance: float
    seed: int
    out: Path
    device: str
    quick: bool


def resolve_settings(args: argparse.Namespace) -> Settings:
    """Apply ``--quick``/defaults to the parsed options and validate them.

    Raises:
        ValueError: on --quick with --small, an empty backend list, a duplicated backend, or a head count
            that does not divide the hidden size.
    """
    if getattr(args, "quick", False) and getattr(args, "small", False):
        raise ValueError("--quick and --small are two different configurations; pass one")
    table = QUICK if getattr(args, "quick", False) else SMALL if getattr(args, "small", False) else DEFAULTS
    get = lambda k: getattr(args, k, None) if getattr(args, k, None) is not None else table[k]  # noqa: E731
    backends = [b.strip() for b in str(getattr(args, "backends", "eager,inductor,smx")).split(",") if b.strip()]
    if not backends:
        raise ValueError("--backends is empty")
    if len(set(backends)) != len(backends):
        raise ValueError(f"--backends lists a backend twice: {backends}")
    s = Settings(
        backends=backends,
        steps=get("steps"),
        batch_size=get("batch_size"),
        seq_len=get("seq_len"),
        layers=get("layers"),
        n_embd=get("n_embd"),
        heads=get("heads"),
        vocab_size=get("vocab_size"),
        lr=get("lr"),
        corpus=get("corpus"),
        tolerance=float(getattr(args, "tolerance", DEFAULT_TOLERANCE)),
        grad_tolerance=float(getattr(args, "grad_tolerance", DEFAULT_GRAD_TOLERANCE)),
        strict_steps=int(get("strict_steps")),
        late_tolerance=float(getattr(args, "late_tolerance", DEFAULT_LATE_TOLERANCE)),
        seed=int(getattr(args, "seed", 0)),
        out=Path(getattr(args, "out", "smx-demo-out")),
        device=getattr(args, "device", "auto"),
        quick=bool(getattr(args, "quick", False)),
    )
    if s.n_embd % s.heads:
        raise ValueError(f"--heads ({s.heads}) must divide --n-embd ({s.n_embd})")
    if s.vocab_size < 258:
        raise ValueError("--vocab-size must be at least 258 (256 bytes + <|endoftext|> + 1 merge)")
    return s


def reproduce_command(s: Settings) -> str:
    """The exact ``smx demo`` command line that reproduces run ``s``."""
    parts = ["smx", "demo"]
    if s.quick:
        parts.append("--quick")
    parts += [
        "--backends", ",".join(s.backends),
        "--steps", str(s.steps),
        "--batch-size", str(s.batch_size),
        "--seq-len", str(s.seq_len),
        "--layers", str(s.layers),
        "--n-embd", str(s.n_embd),
        "--heads", str(s.heads),
        "--vocab-size", str(s.vocab_size),
        "--lr", f"{s.lr:g}",
        "--corpus", s.corpus,
        "--seed", str(s.seed),
        "--tolerance", f"{s.tolerance:g}",
        "--grad-tolerance", f"{s.grad_tolerance:g}",
        "--strict-steps", str(s.strict_steps),
        "--late-tolerance", f"{s.late_tolerance:g}",
        "--device", s.device,
        "--out", str(s.out),
    ]
    return shlex.join(parts)

"""``smx demo``: train a small GPT-2 on real text under eager, Inductor and ``smx``, side by side.

One run: a BPE tokenizer trained on Python's bundled documentation, a ``transformers`` GPT-2 with
eager attention and dropout 0, ``--steps`` AdamW steps per backend from the same weights on the same
batches, the ``smxcompile.explain`` report, a table and the agreement check against eager
(:func:`compare`; exit code 1 when a backend disagrees or fails), and the artifacts in ``--out``
(``checkpoint/``, ``results.json``, ``loss.png``). From Python::

    from smx_app import demo
    parser = argparse.ArgumentParser(); demo.add_arguments(parser)
    exit_code = demo.run(parser.parse_args(["--quick"]))

The parts: :mod:`.settings` (options, defaults, tolerances), :mod:`.data` (corpus, tokenizer, windows),
:mod:`.model`, :mod:`.memory` (peak memory), :mod:`.training` (a run per backend, the comparison),
:mod:`.results` (tables, checkpoint, plot), :mod:`.job` (the run itself).
"""

# torch, transformers, tokenizers and rich are imported inside functions: ``smx --help`` stays fast

from .data import CORPORA, EOT, EVAL_EVERY, load_corpus, make_batches, make_windows, split_windows, train_tokenizer
from .job import DemoResult, main, run, run_demo
from .memory import PeakMemory, rss_bytes
from .model import build_model, count_attention_calls, demo_model_and_inputs
from .results import check_checkpoint, loss_memory_note, markdown_table, plot_losses, print_table, save_checkpoint, \
    table_rows
from .settings import DEFAULT_GRAD_TOLERANCE, DEFAULT_LATE_TOLERANCE, DEFAULT_STRICT_STEPS, DEFAULT_TOLERANCE, DEFAULTS, \
    LATE_WINDOW, QUICK, Settings, add_arguments, build_parser, reproduce_command, resolve_settings
from .training import BACKEND_VARIANTS, EVAL_BATCHES, BackendRun, compare, evaluate, grad_errors, train_backend

__all__ = [
    "add_arguments", "build_parser", "Settings", "resolve_settings", "reproduce_command", "DEFAULTS", "QUICK",
    "DEFAULT_TOLERANCE", "DEFAULT_GRAD_TOLERANCE", "DEFAULT_STRICT_STEPS", "DEFAULT_LATE_TOLERANCE", "LATE_WINDOW",
    "CORPORA", "EOT", "EVAL_EVERY", "load_corpus", "train_tokenizer", "make_windows", "split_windows", "make_batches",
    "build_model", "demo_model_and_inputs", "count_attention_calls", "PeakMemory", "rss_bytes",
    "BACKEND_VARIANTS", "EVAL_BATCHES", "BackendRun", "train_backend", "evaluate", "grad_errors", "compare",
    "table_rows", "print_table", "loss_memory_note", "markdown_table", "save_checkpoint", "check_checkpoint",
    "plot_losses", "DemoResult", "run", "run_demo", "main",
]

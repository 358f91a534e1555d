"""``smx demo``: train a small GPT-2 on real text under eager, Inductor and ``smx``, side by side.

The main job of smxcompile, end to end, on real input:

1. **Data.** Python's bundled documentation: the ``pydoc_data.topics`` pages that
   ``help("if")`` shows, plus (by default) the docstrings of the standard library
   that ``help(module)`` shows. A byte-level BPE tokenizer (the ``tokenizers``
   library, special token ``<|endoftext|>``) is trained on that text, the text is
   cut into fixed windows of ``--seq-len`` tokens, and every 20th window is held
   out for evaluation.
2. **Model.** ``transformers.GPT2LMHeadModel`` built from a config (eager
   attention, dropout 0 so the backends are comparable), randomly initialised
   with ``--seed``; every backend starts from a deep copy of the same state dict.
3. **Training.** For each backend (``eager`` means no compile), ``torch.compile``
   the model, then run ``--steps`` AdamW steps on the same batches in the same
   order, recording per-step loss, time per step (step 1, which compiles, is
   timed separately) and peak memory.
4. **Report.** Before the ``smx`` run, ``smxcompile.explain`` lists every
   softmax-shaped site it found and what it did with it.
5. **Verdict.** A side-by-side table, then the agreement check against eager
   (see :func:`compare`): steps 1..``--strict-steps`` within ``--tolerance``,
   the late-run mean loss and the held-out loss within ``--late-tolerance``;
   exit code 1 when a backend disagrees or fails.
6. **Artifacts** in ``--out``: ``checkpoint/`` (safetensors + config +
   tokenizer, loadable with ``from_pretrained``), ``results.json`` and, when
   matplotlib is installed, ``loss.png``.

Use it from the command line (``smx demo --help``) or in-process::

    from smx_app import demo
    parser = argparse.ArgumentParser(); demo.add_arguments(parser)
    exit_code = demo.run(parser.parse_args(["--quick"]))

The package, by what each part does: :mod:`.settings` (options, defaults, tolerances), :mod:`.data`
(corpus, tokenizer, windows, batches), :mod:`.model` (the GPT-2), :mod:`.memory` (peak memory),
:mod:`.training` (a run per backend, the comparison), :mod:`.results` (tables, checkpoint, plot),
:mod:`.job` (the run itself). Its public names are gathered here.
"""

# Heavy imports (torch, transformers, tokenizers, rich) happen inside functions so
# that ``smx --help`` stays fast.

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

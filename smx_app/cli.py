"""The ``smx`` command line: ``smx demo``, ``smx explain``, ``smx swap``, ``smx eval``, ``smx export``.

Run as ``smx`` (the console script) or ``python -m smx_app.cli``. The commands live by group:
:mod:`smx_app.demo` (``smx demo``), :mod:`smx_app.cli_export` (``smx explain``, ``smx export``),
:mod:`smx_app.cli_swap` (``smx swap``, ``smx eval``).
"""

from __future__ import annotations

import argparse
import sys

from .cli_export import add_explain_parser, add_export_parser
from .cli_swap import add_eval_parser, add_swap_parser

EPILOG = """\
examples:
  smx demo                          train a small GPT-2 on Python's bundled docs with eager,
                                    inductor and smx; print the rewrite report and a side-by-side table
  smx demo --quick                  the same in about a minute, with a tiny model
  smx explain                       the rewrite report of the demo model
  smx explain mypkg.models:build    the report of any model: 'module:factory' where factory()
                                    returns (model, example_args) or (model, args, kwargs)
  smx explain --json ...            the report as JSON
  smx swap --list-variants          the softmax variants smx swap can put in a model
  smx swap smx-demo-out --variant ssmax --calibrate 50 --out ssmax-run
                                    replace the demo model's attention softmax by SSMax, calibrate
                                    its scale on training text, compare held-out perplexity
  smx eval ssmax-run                held-out perplexity of a checkpoint (and, for a swapped one,
                                    attention entropy / sink mass vs the original softmax)
  smx export ssmax-run --out ssmax.onnx
                                    the model as smxcompile rewrites it (swaps, quantized softmax,
                                    fusions) as ONNX, checked in onnxruntime
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``smx`` parser: ``demo``, ``explain``, ``swap``, ``eval``, ``export`` (each sets ``func``)."""
    p = argparse.ArgumentParser(
        prog="smx",
        description="smxcompile: a torch.compile backend (backend='smx') that finds softmax-shaped "
        "subgraphs and rewrites them into fused kernels; everything else goes to Inductor.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    from smx_app import demo

    d = sub.add_parser("demo", help="train a small GPT-2 on real text under eager, inductor and smx",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(d)
    d.set_defaults(func=demo.run)

    add_explain_parser(sub)
    add_swap_parser(sub)
    add_eval_parser(sub)
    add_export_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """``smx ARGV``: run the subcommand and return its exit status (no subcommand: the help, 0)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

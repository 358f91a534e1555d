"""The ``smx`` command line: ``smx demo``, ``smx explain``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

EPILOG = """\
examples:
  smx demo                          train a small GPT-2 on Python's bundled docs with eager,
                                    inductor and smx; print the rewrite report and a side-by-side table
  smx demo --quick                  the same in seconds, with a tiny model
  smx explain                       the rewrite report of the demo model
  smx explain mypkg.models:build    the report of any model: 'module:factory' where factory()
                                    returns (model, example_args) or (model, args, kwargs)
  smx explain --json ...            the report as JSON
"""


def _explain_cmd(args: argparse.Namespace) -> int:
    import smxcompile

    if args.target:
        if ":" not in args.target:
            print(f"smx explain: expected 'module:factory', got {args.target!r}", file=sys.stderr)
            return 2
        mod_name, fn_name = args.target.split(":", 1)
        if not mod_name or not fn_name:
            print(f"smx explain: expected 'module:factory', got {args.target!r}", file=sys.stderr)
            return 2
        sys.path.insert(0, ".")
        try:
            factory = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError, ValueError) as e:
            print(f"smx explain: cannot load {args.target!r}: {e}", file=sys.stderr)
            return 2
        if not callable(factory):
            print(f"smx explain: {args.target!r} is not callable (a factory returning (model, args) is needed)",
                  file=sys.stderr)
            return 2
        try:
            built = factory()
        except TypeError as e:
            print(f"smx explain: calling {args.target}() failed: {e} (the factory must take no arguments)",
                  file=sys.stderr)
            return 2
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            print("smx explain: the factory must return (model, args) or (model, args, kwargs)", file=sys.stderr)
            return 2
        model, fargs = built[0], built[1]
        fkwargs = built[2] if len(built) == 3 else {}
        if not isinstance(fargs, (tuple, list)):
            fargs = (fargs,)
    else:
        from smxcompile.demo import demo_model_and_inputs

        model, fargs, fkwargs = demo_model_and_inputs()
    try:
        options = json.loads(args.options) if args.options else None
        smxcompile.SmxOptions.from_mapping(options)
    except json.JSONDecodeError as e:
        print(f"smx explain: --options is not valid JSON ({e}); example: --options '{{\"cpu\": \"rewrite\"}}'",
              file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"smx explain: {e}", file=sys.stderr)
        return 2
    report = smxcompile.explain(model, *fargs, options=options, **fkwargs)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smx",
        description="smxcompile: a torch.compile backend (backend='smx') that finds softmax-shaped "
        "subgraphs and rewrites them into fused kernels; everything else goes to Inductor.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    from smxcompile import demo

    d = sub.add_parser("demo", help="train a small GPT-2 on real text under eager, inductor and smx",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(d)
    d.set_defaults(func=demo.run)

    e = sub.add_parser("explain", help="print the rewrite report of a model",
                       description="Trace a model the way backend='smx' does and list every softmax-shaped "
                       "site: rewritten, kept (left to Inductor on purpose) or skipped, with the reason and "
                       "the source line.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("target", nargs="?", help="'module:factory' returning (model, args[, kwargs]); default: the demo model")
    e.add_argument("--json", action="store_true", help="print the report as JSON")
    e.add_argument("--options", help='backend options as JSON, e.g. \'{"cpu": "rewrite"}\'')
    e.set_defaults(func=_explain_cmd)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

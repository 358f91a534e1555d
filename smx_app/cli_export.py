"""``smx explain`` (the rewrite report of a model) and ``smx export`` (a checkpoint to ONNX or MLIR as
smxcompile rewrites it): their commands and their parsers."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from .argtypes import positive_int

EXPORT_DESCRIPTION = """Export a causal language model checkpoint to ONNX (or MLIR) as smxcompile rewrites it (smxcompile.export_onnx):
the rewritten graph, not the original one, so the file keeps the fusions, the swapped variants of a
`smx swap` output and the corrected quantized softmax. Batch and sequence length stay dynamic. The
file is checked before this returns: onnx.checker, and onnxruntime against eager PyTorch on random
token ids of two shapes and on the first one a token shorter. Prints the rewrite report, how each smxcompile op was exported and the ONNX
op counts; --compare also exports the checkpoint plainly (torch.onnx.export) and prints the op counts
before/after and both onnxruntime CPU latencies side by side.

Targets: onnxruntime (default; fused attention as the ONNX Attention op or onnxruntime's
com.microsoft MultiHeadAttention, whichever the installed onnxruntime runs fastest and exactly) or
portable (standard ONNX ops only, attention as MatMul / Softmax / MatMul, for other runtimes).

--format mlir writes torch-mlir's torch, linalg-on-tensors or stablehlo dialect instead
(smxcompile.export_mlir), the sequence length dynamic (stablehlo: static shapes), the smx ops in their
reference ATen form."""

EXPORT_EPILOG = """examples:
  smx export smx-demo-out --out demo.onnx
  smx export smx-demo-out --out demo.onnx --compare          op counts and latency vs a plain export
  smx export runs/ssmax --out ssmax.onnx --batch 4 --seq-len 64
  smx export smx-demo-out --out portable.onnx --target portable --opset 18
  smx export smx-demo-out --out plain.onnx --rewrites none   the model as written, through the same checks
  smx export smx-demo-out --format mlir --out demo.mlir      linalg-on-tensors, run on MLIR's JIT as a check
  smx export smx-demo-out --format mlir --output-type torch --keep-ops --out demo.torch.mlir
"""


def _export_cmd(args: argparse.Namespace) -> int:
    import torch

    import smxcompile
    from smx_app import lm

    try:
        ck = lm.checkpoint_dir(args.checkpoint)
        try:
            options = json.loads(args.options) if args.options else None
        except json.JSONDecodeError as e:
            raise ValueError(f"--options is not JSON ({e}): e.g. --options '{{\"disable\": [\"attention\"]}}'") from e
        if options is not None:
            smxcompile.SmxOptions.from_mapping(options)
        rewrites = "all" if args.rewrites == "all" else [] if args.rewrites == "none" else \
            [k.strip() for k in args.rewrites.split(",") if k.strip()]
        bad = [k for k in ([] if isinstance(rewrites, str) else rewrites) if k not in smxcompile.REWRITE_KINDS]
        if bad:
            raise ValueError(f"--rewrites: unknown kind(s) {bad}; known: {', '.join(smxcompile.REWRITE_KINDS)}, "
                             "or all / none")
        onnx_only = [f for f, v in (("--target", args.target != "onnxruntime"), ("--opset", args.opset is not None),
                                    ("--attention-op", args.attention_op is not None), ("--compare", args.compare))
                     if v]
        if args.format == "mlir" and onnx_only:
            raise ValueError(f"{', '.join(onnx_only)}: ONNX options; --format mlir takes --output-type / --keep-ops")
        if args.format == "onnx" and (args.output_type or args.keep_ops):
            raise ValueError("--output-type / --keep-ops are MLIR options: add --format mlir")
        model = lm.load_lm(ck, "cpu")
    except (OSError, ValueError, KeyError) as e:
        print(f"smx export: {e}", file=sys.stderr)
        return 2
    model.config.use_cache = False
    vocab = int(model.config.vocab_size)
    n_pos = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    seq = args.seq_len or min(32, n_pos or 32)
    if seq < 2 or (n_pos and seq > n_pos):
        print(f"smx export: --seq-len must be in 2..{n_pos}", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    batch = max(args.batch, 2)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    if args.format == "mlir":
        return _export_mlir(args, model, ids, vocab, options, rewrites)
    ids2 = torch.randint(0, vocab, (batch + 1, max(2, seq // 2 + 1)), generator=g)
    try:
        out = smxcompile.export_onnx(model, (), args.out, kwargs={"input_ids": ids}, options=options,
                                     dynamic_shapes={"input_ids": {0: "batch", 1: "sequence"}},
                                     check_inputs=[((), {"input_ids": ids2})], target=args.target, opset=args.opset,
                                     attention_op=args.attention_op, rewrites=rewrites, compare=args.compare,
                                     threads=args.threads)
    except smxcompile.OnnxExportError as e:
        print(f"smx export: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _export_mlir(args: argparse.Namespace, model, ids, vocab: int, options, rewrites) -> int:
    """``smx export --format mlir``: the sequence dim dynamic (batch static: torch-mlir's linalg lowering
    miscompiles GPT-2 with both dynamic), checked on a second length; for stablehlo every shape static
    (torch-mlir does not lower the dynamic length's ``aten.cumsum`` to StableHLO)."""
    import torch

    import smxcompile
    from smxcompile.export.capture import export_options

    output_type = args.output_type or "linalg-on-tensors"
    if args.keep_ops and output_type != "torch":
        print("smx export: --keep-ops keeps the smx ops as torch.operator, which only the torch dialect holds: "
              "add --output-type torch", file=sys.stderr)
        return 2
    static = output_type == "stablehlo"
    ids2 = torch.randint(0, vocab, (ids.shape[0], max(2, ids.shape[1] // 2 + 1)), generator=torch.Generator().manual_seed(1))
    try:
        out = smxcompile.export_mlir(model, (), kwargs={"input_ids": ids}, output_type=output_type,
                                     options=export_options(options, rewrites), decompose=not args.keep_ops,
                                     dynamic_shapes=None if static else {"input_ids": {1: "sequence"}}, path=args.out,
                                     check_inputs=[] if static else [((), {"input_ids": ids2})])
    except ImportError as e:
        print(f"smx export: {e}", file=sys.stderr)
        return 2
    except (smxcompile.MlirExportError, smxcompile.OnnxExportError) as e:
        print(f"smx export: {e}", file=sys.stderr)
        return 1
    print(out.report)
    top = sorted(out.ops.items(), key=lambda kv: -kv[1])[:12]
    print(f"wrote {args.out} ({output_type}{', smx ops kept' if args.keep_ops else ''}): "
          + ", ".join(f"{k} {v}" for k, v in top))
    if static:
        print(f"shapes static: input_ids {tuple(ids.shape)} (--batch, --seq-len; torch-mlir does not lower the "
              "dynamic sequence length's aten.cumsum to stablehlo)")
    if out.checked == "run":
        print(f"run on MLIR's LLVM JIT against eager PyTorch on shapes {tuple(ids.shape)} and {tuple(ids2.shape)}: "
              f"max |diff| {out.max_abs_diff:.3g}")
    else:
        print(f"parsed and verified ({output_type} modules are not run here)")
    return 0


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
        from smx_app.demo import demo_model_and_inputs

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


EXPLAIN_EPILOG = """examples:
  smx explain                                  the report of the demo model
  smx explain mypkg.models:build               any model: factory() returns (model, args) or (model, args, kwargs)
  smx explain mypkg.models:build --json        the report as JSON
  smx explain mypkg.models:build --options '{"cpu": "rewrite", "check": true}'
                                               with backend options (here: every CPU site, each one checked)
"""


def add_explain_parser(sub) -> None:
    """Add ``smx explain`` to ``sub`` (what the ``smx`` parser's ``add_subparsers()`` returned)."""
    e = sub.add_parser("explain", help="print the rewrite report of a model",
                       description="Trace a model the way backend='smx' does and list every softmax-shaped "
                       "site: rewritten, kept (left to Inductor on purpose) or skipped, with the reason and "
                       "the source line.", epilog=EXPLAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("target", nargs="?", help="'module:factory' returning (model, args[, kwargs]); default: the demo model")
    e.add_argument("--json", action="store_true", help="print the report as JSON")
    e.add_argument("--options", help='backend options as JSON, e.g. \'{"cpu": "rewrite"}\'')
    e.set_defaults(func=_explain_cmd)


def add_export_parser(sub) -> None:
    """Add ``smx export`` to ``sub`` (what the ``smx`` parser's ``add_subparsers()`` returned)."""
    x = sub.add_parser("export", help="export a checkpoint to ONNX (or MLIR) as smxcompile rewrites it, checked on a runtime",
                       description=EXPORT_DESCRIPTION, epilog=EXPORT_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    x.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="checkpoint folder (config.json + weights) or an `smx demo --out` / `smx swap --out` folder")
    x.add_argument("--format", choices=("onnx", "mlir"), default="onnx",
                   help="onnx (checked in onnxruntime) or mlir (torch-mlir; pip install smxcompile[mlir]) "
                   "(default: onnx)")
    x.add_argument("--out", required=True, type=Path, metavar="FILE", help="the .onnx / .mlir file to write")
    x.add_argument("--output-type", choices=("torch", "linalg-on-tensors", "stablehlo"), default=None,
                   help="--format mlir: the MLIR dialect (default: linalg-on-tensors, run on MLIR's JIT as a check; "
                   "stablehlo is written with static shapes, the --batch x --seq-len example's, since torch-mlir "
                   "does not lower a dynamic sequence length to it)")
    x.add_argument("--keep-ops", action="store_true",
                   help="--format mlir --output-type torch: keep the smx ops as torch.operator for a compiler "
                   "with its own lowering (default: their reference ATen form)")
    x.add_argument("--target", choices=("onnxruntime", "portable"), default="onnxruntime",
                   help="onnxruntime: its fastest exact ops, com.microsoft ones included; portable: standard ONNX "
                   "ops only (default: onnxruntime)")
    x.add_argument("--opset", type=positive_int, default=None, metavar="N",
                   help="ONNX opset, at least 18 (default: the target's; 23 for the Attention op)")
    x.add_argument("--attention-op", choices=("Attention", "MultiHeadAttention", "decompose"), default=None,
                   help="force the form of fused attention (default: the target's choice)")
    x.add_argument("--rewrites", default="all", metavar="KINDS",
                   help="rewrite kinds to apply, comma-separated (attention,softmax_topk,...), all or none (default: all)")
    x.add_argument("--compare", action="store_true",
                   help="also export plainly with torch.onnx.export and print op counts and onnxruntime CPU latency "
                   "side by side")
    x.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="onnxruntime intra-op threads of the --compare timing (default: 1)")
    x.add_argument("--batch", type=positive_int, default=2, metavar="B",
                   help="batch of the example input, at least 2 (the dim stays dynamic; 1 is raised to 2; default: 2)")
    x.add_argument("--seq-len", type=positive_int, default=None, metavar="T",
                   help="sequence length of the example input (default: 32, at most the model's)")
    x.add_argument("--options", help='backend options as JSON (over the default {"cpu": "rewrite", "cuda": "rewrite"}: every fusion kept)')
    x.set_defaults(func=_export_cmd)

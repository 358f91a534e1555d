"""Start-up cost as module counts (not timings): ``import smxcompile`` registers the ops without Dynamo,
Inductor, DTensor or the exporters; ``smx --help`` parses without torch. Times: docs/PERFORMANCE.md."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch._dynamo", "torch._inductor", "torch.distributed.tensor", "transformers", "onnx", "onnxscript",
         "triton", "sympy", "matplotlib")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_import_registers_the_ops_without_the_compiler_stack():
    mods = _modules_after("import smxcompile, torch\nassert hasattr(torch.ops.smx, 'softmax_topk')")
    assert not sorted(m for m in mods if m.split(".")[0] in HEAVY or m.startswith(HEAVY)), "imported eagerly"


def test_lazy_names_resolve_and_the_backend_is_registered():
    code = ("import smxcompile, torch\n"
            "assert callable(smxcompile.smx_backend) and callable(smxcompile.export_onnx)\n"
            "assert smxcompile.distributed.vocab_parallel_linear_cross_entropy\n"
            "import smxcompile.explain\nassert callable(smxcompile.explain)\n"
            "f = torch.compile(lambda x: torch.softmax(x, -1), backend='smx')\n"
            "assert f(torch.zeros(2, 3)).shape == (2, 3)\n"
            "assert set(smxcompile.__all__) <= set(dir(smxcompile))")
    assert "smxcompile.backends.smx" in _modules_after(code)


def test_help_does_not_import_torch():
    for argv in ([], ["demo"], ["export"], ["swap"], ["eval"], ["explain"]):
        code = f"import sys\nfrom smx_app.cli import build_parser\ntry:\n    build_parser().parse_args({json.dumps(argv + ['--help'])})\nexcept SystemExit:\n    pass"
        mods = _modules_after(code)
        assert "torch" not in mods, argv
    assert subprocess.run([sys.executable, "-m", "smx_app.cli", "--help"], capture_output=True, text=True,
                          check=True).stdout.startswith("usage: smx")

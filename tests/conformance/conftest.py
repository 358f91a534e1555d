"""The conformance suites reuse the pass tests' helpers (a function's Dynamo graph, the pass run on it)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "passes"))

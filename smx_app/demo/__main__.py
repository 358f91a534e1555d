"""``python -m smx_app.demo [options]``: the same as ``smx demo``."""

import sys

from .job import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m staticpipe.selftest [--quick] [--cpu] ...``: the checks of ``staticpipe.selftest``."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

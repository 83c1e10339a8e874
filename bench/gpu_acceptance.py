"""The GPU acceptance checks: the command ``python -m staticpipe.selftest`` (the same options: ``--quick``,
``--cpu``, ``--only``, ``--json``, ...; ``--help`` lists them). This file runs it from a checkout.

    python bench/gpu_acceptance.py --cpu --quick   # = python -m staticpipe.selftest --cpu --quick
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from staticpipe.selftest import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

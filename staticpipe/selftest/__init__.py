"""``python -m staticpipe.selftest [--quick]``: the checks a machine with GPUs must pass before staticpipe's
GPU path is trusted there, printed as a report to paste into a bug report (the versions of staticpipe,
Paddle, CUDA and cuDNN, the GPUs, Python and the CPU, then a table of the checks' results).
``--cpu --quick`` is a dry run on CPU devices. The checks and options: ``python -m staticpipe.selftest
--help`` (``cli``).

Modules: ``cli`` (options, the report's order), ``report`` (the header and the table), ``checks`` (the
checks by key, each run here or in a process of its own), ``process`` (a process under a time limit),
``harness`` (rows, the context, comparison), and the checks: ``equivalence`` (a, b), ``seed`` (c, d),
``two_processes`` (e), ``amp`` (f, g).
"""
from .cli import main

__all__ = ["main"]

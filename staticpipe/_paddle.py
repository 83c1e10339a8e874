"""The one place that imports Paddle and fixes what staticpipe needs from it.

Why a module of its own: on Paddle 3.x a process builds PIR programs (staticpipe's default there) unless
it opts in to the legacy IR (``STATICPIPE_LEGACY_IR=1``, ``legacy_ir.py``, which must act before any
program is built, whatever was imported first), and paddle 2.6.2 crashes on numpy 2 arrays. So every
staticpipe module imports Paddle through here.
"""
from __future__ import annotations

import os

if os.environ.get("STATICPIPE_LEGACY_IR", "0").strip().lower() in ("1", "true", "yes", "on"):
    os.environ.setdefault("FLAGS_enable_pir_api", "0")  # read by a paddle imported from here on (Paddle 3)

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from paddle.base import core, framework  # noqa: E402

PADDLE_MAJOR = int(paddle.__version__.split(".")[0])
if PADDLE_MAJOR >= 3:  # PIR by default; the legacy IR for those who opt in
    from . import legacy_ir

    legacy_ir.install()
elif PADDLE_MAJOR == 2 and int(np.__version__.split(".")[0]) >= 2:
    raise ImportError(
        f"paddlepaddle {paddle.__version__} aborts on numpy {np.__version__} arrays; "
        "install numpy<2 (pip install 'numpy<2')"
    )



def use_legacy_ir() -> None:
    """Build legacy static programs in this process from here on: on Paddle 3.x the opt-in that
    ``STATICPIPE_LEGACY_IR=1`` makes at import, for a script to make itself before it builds its programs
    (those built before stay what they are); on Paddle 2.x the legacy IR is the only one."""
    if PADDLE_MAJOR >= 3:
        legacy_ir.use_legacy_ir()


# op_role bits of the legacy IR (paddle/fluid/framework/op_proto_maker.h)
ROLE_FORWARD = 0
ROLE_BACKWARD = 1
ROLE_OPTIMIZE = 2
ROLE_RPC = 4
ROLE_DIST = 8
ROLE_LRSCHED = 16
ROLE_LOSS = 256

OP_DEVICE = "op_device"
OP_ROLE = "op_role"
OP_ROLE_VAR = "op_role_var"
GRAD_SUFFIX = "@GRAD"

__all__ = ["paddle", "core", "framework", "np", "PADDLE_MAJOR", "use_legacy_ir"]

"""The one place that imports Paddle and fixes what staticpipe needs from it.

Why a module of its own: Paddle 3.x builds PIR programs by default, which staticpipe's rewrite does not
read (``legacy_ir.py`` settles that, whatever was imported first), and paddle 2.6.2 crashes on numpy 2
arrays. Both must be settled before any program is built, so every staticpipe module imports Paddle
through here.
"""
from __future__ import annotations

import os

if os.environ.get("STATICPIPE_LEGACY_IR", "1").strip().lower() not in ("0", "false", "no", "off"):
    os.environ.setdefault("FLAGS_enable_pir_api", "0")  # read by a paddle imported from here on

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from paddle.base import core, framework  # noqa: E402

PADDLE_MAJOR = int(paddle.__version__.split(".")[0])
if PADDLE_MAJOR >= 3:  # the legacy static IR is what staticpipe rewrites
    from . import legacy_ir

    legacy_ir.install()
elif PADDLE_MAJOR == 2 and int(np.__version__.split(".")[0]) >= 2:
    raise ImportError(
        f"paddlepaddle {paddle.__version__} aborts on numpy {np.__version__} arrays; "
        "install numpy<2 (pip install 'numpy<2')"
    )

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

__all__ = ["paddle", "core", "framework", "np", "PADDLE_MAJOR"]

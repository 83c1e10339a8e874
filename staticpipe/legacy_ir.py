"""Paddle 3.x in legacy-IR mode: an explicit opt-in for programs written for Paddle's legacy static IR.

Paddle 3 builds PIR programs by default, and so does staticpipe on it (``pir_ir.py``). Legacy-IR mode is
for users whose programs, or whose features (see README "PIR programs"), still need the legacy IR, which
Paddle is removing release by release:

- the IR is chosen when ``paddle`` is imported (``global_var._use_pir_api_``, ``paddle.static.Program``,
  the dtype objects), so a later flag change alone leaves ``import paddle, staticpipe`` building PIR;
  ``use_legacy_ir`` switches the process the way Paddle's own ``OldIrGuard`` does. It runs at import when
  ``STATICPIPE_LEGACY_IR=1`` is set, whatever was imported first, or when a script calls
  ``staticpipe.use_legacy_ir()`` before building its programs;
- 56 Python APIs (``paddle.sqrt``, ``tanh``, ``matmul``, ``sum``, ``maximum``, ...) became thin wrappers of
  ``paddle._C_ops``, which build PIR ops only and reject a legacy ``Variable`` ("must be Value, but got
  Variable") -- Paddle's own ``ClipGradByGlobalNorm`` calls two of them. ``install`` puts a wrapper in
  front of each: given a legacy ``Variable`` in legacy static mode it appends the legacy op (``sqrt``,
  ``matmul_v2``, ``reduce_sum``, ``elementwise_max``, ...) through ``LayerHelper``, as Paddle 2.6 did;
  anything else (PIR values, dygraph tensors) goes to Paddle's own function unchanged. So the wrappers are
  installed on every Paddle 3 import: a legacy program built under Paddle's ``OldIrGuard`` works too. An
  API without a legacy builder here raises an error naming it.

``BUILDERS`` is the list ``tests/test_legacy_ir.py`` checks against the installed Paddle, so the next API
Paddle moves shows up there by name.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

import paddle
from paddle.base import framework
from paddle.base.dygraph import generated_tensor_methods_patch as generated
from paddle.base.layer_helper import LayerHelper

ENV = "STATICPIPE_LEGACY_IR"
Builder = Callable[..., Any]


def _op(op_type: str, inputs: dict, attrs: dict | None = None, dtype: Any = None, name: str | None = None) -> Any:
    """Append one legacy op with output ``Out`` and return that output."""
    helper = LayerHelper(op_type, name=name)
    first = next(iter(inputs.values()))[0]
    out = helper.create_variable_for_type_inference(dtype=first.dtype if dtype is None else dtype)
    helper.append_op(type=op_type, inputs=inputs, outputs={"Out": [out]}, attrs=attrs or {})
    return out


def _unary(op_type: str, **defaults: Any) -> Builder:
    def build(x: Any, *args: Any, name: str | None = None, **kwargs: Any) -> Any:
        attrs = dict(defaults)
        attrs.update(zip(defaults, args))
        attrs.update((k, v) for k, v in kwargs.items() if k in defaults)
        return _op(op_type, {"X": [x]}, attrs, name=name)
    return build


def _binary(op_type: str, bool_out: bool = False) -> Builder:
    def build(x: Any, y: Any, name: str | None = None) -> Any:
        return _op(op_type, {"X": [x], "Y": [y]}, {"axis": -1},
                   paddle.bool if bool_out else None, name)
    return build


def _predicate(op_type: str) -> Builder:
    return lambda x, name=None: _op(op_type, {"X": [x]}, dtype=paddle.bool, name=name)


def _axes(x: Any, axis: Any) -> tuple[list[int], bool]:
    if axis is None or axis == [] or axis == ():
        return [0], True
    axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    return axes, len(axes) == len(x.shape)


def _reduce(op_type: str, dtype_arg: bool = False, bool_out: bool = False) -> Builder:
    def build(x: Any, axis: Any = None, *args: Any, name: str | None = None, **kwargs: Any) -> Any:
        if dtype_arg:  # sum(x, axis, dtype, keepdim)
            dtype = kwargs.pop("dtype", args[0] if args else None)
            keepdim = kwargs.pop("keepdim", args[1] if len(args) > 1 else False)
            if dtype is not None:
                x = paddle.cast(x, dtype)
        else:  # all/any/amax/amin(x, axis, keepdim)
            keepdim = kwargs.pop("keepdim", args[0] if args else False)
        dims, everything = _axes(x, axis)
        return _op(op_type, {"X": [x]}, {"dim": dims, "keep_dim": keepdim, "reduce_all": everything},
                   paddle.bool if bool_out else None, name)
    return build


def _arg(op_type: str) -> Builder:
    def build(x: Any, axis: Any = None, keepdim: bool = False, dtype: Any = "int64", name: str | None = None) -> Any:
        var_type = framework.convert_np_dtype_to_dtype_(dtype)
        return _op(op_type, {"X": [x]}, {"axis": 0 if axis is None else axis, "keepdims": keepdim,
                                         "flatten": axis is None, "dtype": var_type}, var_type, name)
    return build


def _matmul(x: Any, y: Any, transpose_x: bool = False, transpose_y: bool = False, name: str | None = None) -> Any:
    return _op("matmul_v2", {"X": [x], "Y": [y]}, {"trans_x": transpose_x, "trans_y": transpose_y}, name=name)


BUILDERS: dict[str, Builder] = {
    **{n: _unary(n) for n in ("sqrt", "tanh", "sigmoid", "exp", "log", "abs", "floor", "ceil", "sin", "cos",
                              "rsqrt", "sign", "log1p", "expm1", "acos", "asin", "acosh", "atanh", "sinh", "cosh",
                              "log2", "log10")},
    "round": _unary("round", decimals=0),
    "gelu": _unary("gelu", approximate=False),
    "softplus": _unary("softplus", beta=1.0, threshold=20.0),
    "matmul": _matmul,
    "multiply": _binary("elementwise_mul"),
    "maximum": _binary("elementwise_max"),
    "minimum": _binary("elementwise_min"),
    "greater_than": _binary("greater_than", bool_out=True),
    "logical_and": _binary("logical_and", bool_out=True),
    "logical_or": _binary("logical_or", bool_out=True),
    "logical_xor": _binary("logical_xor", bool_out=True),
    "logical_not": _predicate("logical_not"),
    "isfinite": _predicate("isfinite_v2"),
    "isinf": _predicate("isinf_v2"),
    "isnan": _predicate("isnan_v2"),
    "sum": _reduce("reduce_sum", dtype_arg=True),
    "amax": _reduce("reduce_amax"),
    "amin": _reduce("reduce_amin"),
    "all": _reduce("reduce_all", bool_out=True),
    "any": _reduce("reduce_any", bool_out=True),
    "argmax": _arg("arg_max"),
    "argmin": _arg("arg_min"),
}


def legacy_static() -> bool:
    """Building a legacy static program now (not dygraph, not PIR)."""
    return not framework.in_dygraph_mode() and not framework.global_var._use_pir_api_


def _front(name: str, original: Callable) -> Callable:
    """``original``, unless it is given a legacy ``Variable`` in legacy static mode: then the legacy
    builder, or an error naming the API when there is none."""
    builder = BUILDERS.get(name)

    @functools.wraps(original)
    def api(*args: Any, **kwargs: Any) -> Any:
        if legacy_static() and any(isinstance(a, framework.Variable) for a in (*args, *kwargs.values())):
            if builder is None:
                raise NotImplementedError(
                    f"paddle.{name} builds only PIR ops in Paddle {paddle.__version__}, and staticpipe's legacy-IR "
                    f"mode has no builder for it: write it with other ops in the program you pipeline, or use "
                    f"paddlepaddle 2.6.2 (staticpipe/legacy_ir.py lists the APIs it rebuilds)")
            return builder(*args, **kwargs)
        return original(*args, **kwargs)
    api.__staticpipe_front__ = original
    return api


def opted_in() -> bool:
    """``STATICPIPE_LEGACY_IR`` set to 1 (or true, yes, on): the process builds legacy programs."""
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def use_legacy_ir() -> None:
    """Make legacy static programs the default in this process, whatever was imported first."""
    paddle.set_flags({"FLAGS_enable_pir_api": False})
    os.environ["FLAGS_enable_pir_api"] = "0"  # threads started later read it (GlobalThreadLocal)
    paddle.pir_utils._switch_to_old_ir_()


def install() -> None:
    """Front every moved API (module docstring), idempotent; switch the process to the legacy IR when
    ``STATICPIPE_LEGACY_IR`` opts in."""
    if opted_in():
        use_legacy_ir()
    namespaces = [(paddle, generated.funcs_map), (paddle.tensor, generated.methods_map),
                  (paddle.nn.functional, generated.nn_funcs_map), (framework.Variable, generated.methods_map)]
    for namespace, pairs in namespaces:
        for name, _ in pairs:
            current = getattr(namespace, name, None)
            if current is not None and not hasattr(current, "__staticpipe_front__"):
                setattr(namespace, name, _front(name, current))

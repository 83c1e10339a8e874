"""staticpipe.linear_scans: Paddle's minimize with its per-parameter scans in one pass gives exactly the
program, the (parameter, gradient) list and the device map Paddle's own code gives."""
from __future__ import annotations

import re

import paddle.optimizer.optimizer as paddle_optimizer
import pytest

from models import build_dlrm, build_gpt, build_mlp, build_resnet
from staticpipe._paddle import paddle
from staticpipe.linear_scans import linear_scans


def program_text(program) -> list:
    """Every op of every block: type, inputs, outputs and attributes (the creation call stack aside: it
    names the calling lines, which differ between the two builds by construction; and name scopes without
    the counter Paddle keeps process-wide)."""
    ops = []
    for block in program.blocks:
        for op in block.ops:
            attrs = {name: str(op.attr(name)) for name in sorted(op.attr_names) if name != "op_callstack"}
            attrs["op_namescope"] = re.sub(r"_\d+/", "/", attrs.get("op_namescope", ""))
            ops.append((block.idx, op.type, sorted((k, op.input(k)) for k in op.input_names),
                        sorted((k, op.output(k)) for k in op.output_names), attrs))
    return ops


def minimized(build, make_optimizer, fast: bool, **minimize_args):
    net = build()
    opt = make_optimizer()
    args = {k: v(net) if callable(v) else v for k, v in minimize_args.items()}
    with paddle.static.program_guard(net.main, net.startup), paddle.utils.unique_name.guard("minimize_"):
        if fast:
            with linear_scans():
                result = opt.minimize(net.loss, **args)
        else:
            result = opt.minimize(net.loss, **args)
    pairs = result[1] if isinstance(result, tuple) else result
    device_map = dict(getattr(getattr(opt, "_optimizer", opt), "_param_device_map", {}))
    return program_text(net.main), [(p.name, g.name if g is not None else None) for p, g in pairs], device_map


def adamw_clip():
    return paddle.optimizer.AdamW(1e-3, grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))


def momentum():
    return paddle.optimizer.Momentum(0.1, momentum=0.9)


def fp16_o1():
    return paddle.static.amp.decorate(paddle.optimizer.SGD(0.1), init_loss_scaling=128.0,
                                      use_dynamic_loss_scaling=True)


def first_half(net):
    params = net.main.global_block().all_parameters()
    return params[: len(params) // 2]


def first_names(net):
    return {p.name for p in net.main.global_block().all_parameters()[:2]}


def with_a_gradient_name_taken():
    """An MLP whose program already declares its first weight's gradient name: Paddle's backward renames the
    gradient around it, so the fast tail must hand the call to Paddle's own."""
    net = build_mlp(num_stages=2, depth=2)
    block = net.main.global_block()
    weight = block.all_parameters()[0]
    block.create_var(name=weight.name + "@GRAD", shape=weight.shape, dtype=weight.dtype)
    return net


CASES = {
    "mlp-momentum": (lambda: build_mlp(num_stages=2, depth=4), momentum, {}),
    "gpt-tied-adamw-clip": (lambda: build_gpt(num_stages=2, n_layers=2), adamw_clip, {}),
    "resnet-batch-norm": (lambda: build_resnet(depth=50, num_stages=2, image_size=8, width=4), momentum, {}),
    "dlrm-embeddings": (lambda: build_dlrm(num_stages=2), adamw_clip, {}),
    "parameter-subset": (lambda: build_mlp(num_stages=2, depth=4), momentum, {"parameters": first_half}),
    "parameter-names": (lambda: build_mlp(num_stages=2, depth=4), momentum,
                        {"parameters": lambda net: [p.name for p in first_half(net)]}),
    "no-grad-set": (lambda: build_mlp(num_stages=2, depth=4), momentum, {"no_grad_set": first_names}),
    "amp-fp16-o1": (lambda: build_mlp(num_stages=2, depth=4), fp16_o1, {}),
    "gradient-name-taken": (with_a_gradient_name_taken, momentum, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_program_pairs_and_device_map_as_paddle(case):
    build, make_optimizer, args = CASES[case]
    paddle_own = minimized(build, make_optimizer, False, **args)
    fast = minimized(build, make_optimizer, True, **args)
    assert fast[1] == paddle_own[1] and paddle_own[1]
    assert fast[2] == paddle_own[2]
    assert fast[0] == paddle_own[0]


def test_paddle_functions_are_restored_after_nested_holds_and_errors():
    own_backward = paddle_optimizer.append_backward
    own_map = paddle_optimizer.Optimizer._update_param_device_map
    own_grad_op_desc = paddle.base.core.get_grad_op_desc
    with linear_scans():
        with linear_scans():
            assert paddle_optimizer.append_backward is not own_backward
            assert paddle.base.core.get_grad_op_desc is not own_grad_op_desc
        assert paddle_optimizer.append_backward is not own_backward  # the outer hold still holds
    assert paddle_optimizer.append_backward is own_backward
    with pytest.raises(RuntimeError, match="inside"):
        with linear_scans():
            raise RuntimeError("inside")
    assert paddle_optimizer.append_backward is own_backward
    assert paddle_optimizer.Optimizer._update_param_device_map is own_map
    assert paddle.base.core.get_grad_op_desc is own_grad_op_desc


def test_a_parameter_list_paddle_rejects_gets_paddle_s_own_error():
    net = build_mlp(num_stages=2, depth=2)
    with paddle.static.program_guard(net.main, net.startup), linear_scans():
        with pytest.raises(TypeError, match=r"parameter_list\[0\]"):
            paddle_optimizer.append_backward(net.loss, parameter_list=[3])

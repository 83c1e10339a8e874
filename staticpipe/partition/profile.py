"""``profile``: what every forward op of a program costs on the real device, forward and backward.

Why op by op: a partitioner that works at op level needs op-level costs, and Paddle's own profiler
reports kernels, not the ops of *this* program. Each op is copied into a one-op program and run alone
through the prepared-context executor (the one the pipeline's stage workers use, so the per-op
interpreter overhead is counted as it will be paid), on inputs produced by one full run of the program:
the values are real, so data-dependent kernels (embedding lookups, losses) do real work.

The backward: a gradient op belongs to the forward op whose gradient it computes, found by the rule the
rewrite finds its stage with (``rewrite.stages.latest_gradient_source``). A program without backward
ops is differentiated on a throw-away clone. A PIR program is measured by ``pir_profile.py`` into the
same ``Profile``.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from .._paddle import core, framework, np, paddle
from ..io import DataLoader
from ..ir import arg_names, clear_device_tags, free_scope, is_pir_program, np_dtype, tensor_bytes
from ..placement import generic_place, launched_world, place_of
from ..rewrite.programs import copy_ops
from ..rewrite.stages import BWD, FWD, grad_base, gradient_owners, op_label, role_of
from .costs import OpRow, Profile
from .layers import group_layers
from .pir_profile import profile_pir, the_loss


def profile(program: framework.Program, feed: dict[str, np.ndarray] | DataLoader, place: Any = None,
            repeat: int = 3, startup: framework.Program | None = None, loss: Any = None) -> Profile:
    """Measure every forward op of ``program`` (forward only, or already minimized; a PIR program: before
    minimize, see ``pir_profile.py``) on ``place``.

    ``feed``: one batch (``{name: array}``) or a ``staticpipe.io.DataLoader`` whose first batch is used;
    profile at the micro-batch size you will train with: the costs are per micro-batch.
    ``place``: a device string ("cpu", "gpu:k") or a Paddle place; default "gpu:0" (the CPU without CUDA).
    ``startup``: initialises the parameters; without it they are filled with small random values (op
    times do not depend on them). ``loss``: the variable (or name) to differentiate when ``program``
    has no backward; by default the one scalar float output no op reads (preferring a mean or sum).
    Timing runs on the calling thread with its intra-op thread budget (``core.set_num_threads``).
    """
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise ValueError(f"repeat must be an integer >= 1, got {repeat!r}")
    batch = first_batch(feed)
    if place is None or isinstance(place, str):
        place = place_of(place or "gpu:0")
    if is_pir_program(program):
        return profile_pir(program, batch, place, repeat, startup, loss)
    block = program.global_block()
    for i, op in enumerate(block.ops):
        if op.has_attr("sub_block"):
            raise ValueError(f"{op_label(i, op)} has a sub-block (control flow), which staticpipe cannot profile")
    work, origin, loss_name = _differentiated(program, loss)
    wblock = work.global_block()
    roles = [role_of(op, i) for i, op in enumerate(wblock.ops)]
    forward_of = gradient_owners(wblock, roles)

    layers = group_layers(program)
    scope = core.Scope()
    try:
        rows, params, var_bytes, unestimated = _measure(program, work, origin, roles, forward_of, layers, startup,
                                                        batch, scope, place, repeat)
    finally:  # a scope is Paddle's until freed (``ir.free_scope``); this one holds a model's values
        free_scope(scope)
    return Profile.measured(place, batch, repeat, loss_name, rows, params, var_bytes, layers, unestimated)


def _measure(program, work, origin, roles, forward_of, layers, startup, batch, scope, place, repeat):
    """Every forward op's row, the parameters' and activations' bytes, and the op types without a FLOP
    estimate, measured in ``scope``."""
    block, wblock = program.global_block(), work.global_block()
    _initialise(work, startup, scope, place)
    _feed(wblock, roles, batch, scope, place)
    exe = core.Executor(generic_place(place))
    names = [v.name for v in work.list_vars()]
    exe.run_prepared_ctx(exe.prepare(work.desc, 0, names, False), scope, False, True, True)
    sync = (lambda: core._cuda_synchronize(place)) if isinstance(place, core.CUDAPlace) else (lambda: None)

    backward: dict[int, float] = {}
    for j, i in forward_of.items():
        backward[i] = backward.get(i, 0.0) + _time_op(exe, wblock, j, scope, repeat, sync)
    read_by_backward = {n for j in forward_of for n in wblock.ops[j].input_arg_names}
    params = {p.name: static_bytes(p) for p in block.all_parameters()}
    rows, unestimated, var_bytes = [], set(), {}
    layer_of = {i: layer.index for layer in layers for i in layer.ops}
    for j, role in enumerate(roles):
        if role != FWD:
            continue
        op = wblock.ops[j]
        outs = [n for n in arg_names(op.output_arg_names) if _is_activation(wblock._var_recursive(n))]
        var_bytes.update((n, tensor_bytes(scope, n)) for n in outs)
        flops = _flops(op, lambda name: _shape(scope, name))
        if flops is None:
            unestimated.add(op.type)
        rows.append(OpRow(origin[j], op.type, layer_of[origin[j]], _time_op(exe, wblock, j, scope, repeat, sync),
                          backward.get(j, 0.0),
                          sum(params[n] for n in dict.fromkeys(op.input_arg_names) if n in params),
                          sum(var_bytes[n] for n in outs), sum(var_bytes[n] for n in outs if n in read_by_backward),
                          flops or 0, "" if flops is not None else "FLOPs not estimated"))
    return rows, params, var_bytes, unestimated


def refuse_measuring_in_launched_job(what: str) -> None:
    """``ValueError`` in a process of a launched job (several processes, one per device): each would
    measure its own times and could cut or choose differently from the others -- plans that do not
    match hang or fail. A profile taken once and loaded on every rank gives every rank the same plan."""
    if launched_world() is not None:
        raise ValueError(f"{what} in a launched job: every process would measure its own times and could choose "
                         "another plan than the others; take the profile once (staticpipe.profile(...).to_json(path)) "
                         "and pass profile=staticpipe.partition.Profile.from_json(path) on every rank, with no feed")


def first_batch(feed: dict | DataLoader) -> dict[str, np.ndarray]:
    if isinstance(feed, dict):
        if not feed:
            raise ValueError("feed is empty: give one batch as {data variable name: array}")
        return {name: np.asarray(value) for name, value in feed.items()}
    if isinstance(feed, DataLoader):
        if feed.iterable:
            epoch = feed.epoch()
            try:
                return next(epoch)
            finally:
                epoch.close()
        feed.start()
        try:
            return feed.next_batch()
        finally:
            feed.reset()
    raise ValueError(f"feed must be a dict of arrays or a staticpipe.io.DataLoader, got {type(feed).__name__}")


def _differentiated(program: framework.Program, loss: Any) -> tuple[framework.Program, list[int | None], str]:
    """A copy of ``program`` with its forward and backward ops only (a backward is added when it has
    none), the original index of each of its forward ops, and the loss name."""
    roles = [role_of(op, i) for i, op in enumerate(program.global_block().ops)]
    work = program.clone()
    if BWD in roles:
        kept = [i for i, r in enumerate(roles) if r in (FWD, BWD)]
        wblock = work.global_block()
        for i in reversed(range(len(roles))):
            if roles[i] not in (FWD, BWD):
                wblock._remove_op(i, sync=False)
        wblock._sync_with_cpp()
        name = loss if isinstance(loss, str) else getattr(loss, "name", None) or _loss_of_backward(work)
    else:
        kept = list(range(len(roles)))
        name = loss if isinstance(loss, str) else getattr(loss, "name", None) or _find_loss(program)
        if not work.global_block().has_var(name):
            raise ValueError(f"loss '{name}' is not a variable of the program")
        with paddle.static.program_guard(work, paddle.static.Program()):
            paddle.static.append_backward(work.global_block().var(name))
    clear_device_tags(work)
    origin = [kept[j] if j < len(kept) and roles[kept[j]] == FWD else None
              for j in range(len(work.global_block().ops))]
    return work, origin, name


def _find_loss(program: framework.Program) -> str:
    block = program.global_block()
    read = {n for op in block.ops for n in op.input_arg_names}
    found = []  # (name, producing op type)
    for op in block.ops:
        for name in arg_names(op.output_arg_names):
            var = block._var_recursive(name)
            if name not in read and var.dtype in _FLOAT_TYPES and int(np.prod(var.shape or [1])) == 1:
                found.append((name, op.type))
    return the_loss(found)


def _loss_of_backward(program: framework.Program) -> str:
    """The variable whose gradient the backward starts from: the output of the first backward op
    (``fill_constant`` of ``<loss>@GRAD``)."""
    first = next(op for i, op in enumerate(program.global_block().ops) if role_of(op, i) == BWD)
    return grad_base(first.output_arg_names[0]) or first.output_arg_names[0]


_FLOAT_TYPES = (core.VarDesc.VarType.FP32, core.VarDesc.VarType.FP64, core.VarDesc.VarType.FP16,
                core.VarDesc.VarType.BF16)


def _initialise(program: framework.Program, startup: framework.Program | None, scope: core._Scope,
                place: core.Place) -> None:
    if startup is not None:
        startup = clear_device_tags(startup.clone())
        paddle.static.Executor(place).run(startup, scope=scope)
    rng = np.random.default_rng(0)
    for var in program.list_vars():
        found = scope.find_var(var.name)
        if not var.persistable or (found is not None and found.get_tensor()._is_initialized()):
            continue
        if var.type != core.VarDesc.VarType.LOD_TENSOR:
            continue
        dtype = np.dtype(np_dtype(var))
        shape = [max(int(d), 1) for d in var.shape]
        value = rng.uniform(-0.05, 0.05, shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype)
        scope.var(var.name).get_tensor().set(value, place)


def _feed(block: framework.Block, roles: list[str], batch: dict[str, np.ndarray], scope: core._Scope,
          place: core.Place) -> None:
    for i, op in enumerate(block.ops):
        if roles[i] != FWD:
            continue
        for name in op.input_arg_names:
            if getattr(block._var_recursive(name), "is_data", False) and name not in batch:
                raise ValueError(f"feed has no value for data variable '{name}', which "
                                 f"{op_label(i, op)} reads")
    for name, value in batch.items():
        if not block.has_var(name):
            raise ValueError(f"feed names '{name}', which is not a variable of the program")
        dtype = np.dtype(np_dtype(block.var(name)))
        scope.var(name).get_tensor().set(np.asarray(value, dtype), place)


def _time_op(exe: core.Executor, block: framework.Block, i: int, scope: core._Scope, repeat: int,
             sync: Callable[[], None]) -> float:
    """Median seconds of op ``i`` run alone, after one warm-up run (kernel choice, allocation)."""
    program = paddle.static.Program()
    copy_ops(program.global_block(), block, [i])
    op = block.ops[i]
    ctx = exe.prepare(program.desc, 0, arg_names(op.input_arg_names + op.output_arg_names), False)
    times = []
    for k in range(repeat + 1):
        start = time.perf_counter()
        exe.run_prepared_ctx(ctx, scope, False, True, True)
        sync()
        if k:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def static_bytes(var: framework.Variable) -> int:
    """Bytes of ``var`` from its declared shape, every unknown (batch) dimension counted as 1."""
    return int(np.prod([max(int(d), 1) for d in var.shape])) * core.size_of_dtype(var.dtype)


def _is_activation(var: framework.Variable) -> bool:
    return var.type == core.VarDesc.VarType.LOD_TENSOR and not var.persistable


def _shape(scope: core._Scope, name: str) -> list[int]:
    return list(scope.find_var(name).get_tensor().shape())


def _flops(op: framework.Operator, shape: Callable[[str], list[int]]) -> int | None:
    """Forward multiply-adds x 2 for matrix products and convolutions, one per element for elementwise
    ops; None for any other op type."""
    if op.type == "mul":
        x, y = shape(op.input("X")[0]), shape(op.input("Y")[0])
        xc, yc = op.attr("x_num_col_dims"), op.attr("y_num_col_dims")
        return 2 * int(np.prod(x[:xc])) * int(np.prod(x[xc:])) * int(np.prod(y[yc:]))
    if op.type in ("matmul", "matmul_v2"):
        x, out = shape(op.input("X")[0]), shape(op.output("Out")[0])
        trans = op.attr("trans_x" if op.type == "matmul_v2" else "transpose_X")
        k = x[0] if len(x) == 1 else (x[-2] if trans else x[-1])
        return 2 * int(np.prod(out)) * k
    if op.type in ("conv2d", "depthwise_conv2d", "conv3d"):
        out, kernel = shape(op.output("Output")[0]), shape(op.input("Filter")[0])
        return 2 * int(np.prod(out)) * int(np.prod(kernel[1:]))
    if op.type.startswith("elementwise_"):
        return int(np.prod(shape(op.output("Out")[0])))
    return None

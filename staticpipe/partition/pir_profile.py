"""``profile`` of a PIR program (Paddle 3's default IR): the same ``Profile`` as the legacy IR's, op by op.

Why op by op here too: the policies and the planner cut at op level (layers are groups of ops). Paddle
3.3.1's profiler (``paddle.profiler``) does time every interpreter instruction of a static PIR run, but
names it by op type only (``pd_op.matmul``), after the executor's passes renamed ops (``add`` ran as the
in-place ``add_``, ``relu_grad`` as ``relu_grad_``), in the order its threads ran them: tying its events
back to this program's ops would be a guess by type and order. What PIR makes hard is copying one op
into a program of its own; ``rewrite.pir_programs.cut_program`` already does the equivalent for sections
(a clone of the program with every other op erased, the values it reads from elsewhere made data ops),
so each op is timed as a section of one op:

- the forward program is cloned and differentiated by Paddle's PIR backward (``pir_ir.differentiate``,
  with an optimizer that updates nothing), which records the forward op of every backward op; a
  backward op's time goes to that op (to the op the rewrite's rule names, ``latest_gradient_source``,
  where Paddle records none: a sum of gradients);
- one run of the whole differentiated program computes every value, and every value is left in the
  profile's scope under the name ``PirView`` gives it (the names ``auto_place`` reads the program by);
- each op then runs alone, its inputs read from that scope (persistable data ops), through the
  interpreter Paddle builds for it, run directly as the runtime runs a section (``runtime/pir_runs.py``:
  ``Executor.run`` would print the whole program for its cache key on every run), with the runtime's
  flags (ops on the calling thread; on a CPU, buffers kept between runs): the per-op overhead counted
  is what a stage pays. The median of ``repeat`` runs after a warm-up.

Ops that make no tensor (``builtin.combine`` packing a list for ``concat``, ``builtin.split``) cost 0: the
interpreter runs no kernel for them. An op reading such a value (or a sparse one, which a data op cannot
stand for) is timed together with the ops that make it, less their own times.
Bytes come from the run's real tensors, as the legacy profile's; "saved" counts every value a backward op
reads, as a PIR backward section keeps each of them (``tests/test_partition.py`` checks that both IRs give
the same bytes to a network they build op for op alike; Paddle builds some layers with other ops on PIR:
``static.nn.fc`` on a 3-D input reshapes around its matmul, whose gradient reads more, so a GPT's PIR
profile saves more than its legacy one, as its PIR pipeline holds more).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, ContextManager

from .._paddle import ROLE_BACKWARD, ROLE_OPTIMIZE, core, np, paddle
from ..ir import clear_device_tags, free_scope, np_dtype, tensor_bytes
from ..pir_ir import (EAGER_DELETION, FEEDS, SERIAL_RUN, SPLIT_POINTS, TRACE_RUN, Gradients, differentiate,
                      flags_set, pir_thread)
from ..pir_view import PirView
from ..rewrite.pir_programs import cut_program
from ..rewrite.stages import BWD, FWD, gradient_owners, op_label, role_of
from .costs import OpRow, Profile
from .layers import group_layers

LOSS_OP_TYPES = ("mean", "reduce_mean", "reduce_sum", "sum")  # what usually makes a loss scalar (both IRs)
ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "elementwise_pow", "remainder",
               "floor_divide", "fmax", "fmin"}  # the legacy IR's elementwise_* ops, one FLOP per element


def profile_pir(program: Any, batch: dict[str, np.ndarray], place: Any, repeat: int, startup: Any,
                loss: Any) -> Profile:
    """``partition.profile`` of the forward PIR ``program`` (its arguments, checked there)."""
    ops = program.global_block().ops  # Paddle's own minimize leaves every op's role unset: named *_grad then
    if any(op.op_role in (ROLE_BACKWARD, ROLE_OPTIMIZE) or op.name().endswith(("_grad", "_grad_")) for op in ops):
        raise ValueError("staticpipe.profile takes a PIR program before minimize (the forward program, as auto_place "
                         "and auto_plan do): once differentiated, a PIR program no longer says which forward op each "
                         "backward op belongs to; profile the forward program, or build it again")
    forward = PirView(program, Gradients(), None)  # the program as auto_place reads it
    for i, op in enumerate(forward.ops):
        if op.has_attr("sub_block"):
            raise ValueError(f"{op_label(i, op)} has a sub-block (control flow), which staticpipe cannot profile")
    name = _loss_name(forward, loss)
    mapping = paddle.pir.IrMapping()
    work = clear_device_tags(program.clone(mapping))
    with paddle.static.program_guard(work):
        _, grads = differentiate(_BackwardOnly(), mapping.look_up(forward.var(name).value), None, None, None)
    view = PirView(work, grads, mapping.look_up(forward.var(name).value))
    _check_same_forward(forward, view)
    roles = [role_of(op, i) for i, op in enumerate(view.ops)]
    layers = group_layers(forward)
    scope = core.Scope()
    try:
        with pir_thread(), _runtime_flags(place):
            rows, params, var_bytes, unestimated = _measure(view, roles, layers, startup, batch, scope, place, repeat)
    finally:
        free_scope(scope)  # a scope is Paddle's until freed; this one holds every value of a step
    return Profile.measured(place, batch, repeat, name, rows, params, var_bytes, layers, unestimated)


class _BackwardOnly:
    """What ``pir_ir.differentiate`` calls an optimizer for: Paddle's PIR backward, and no update ops."""

    def backward(self, loss: Any, **kwargs: Any) -> Any:
        return paddle.optimizer.SGD(0.0).backward(loss, **kwargs)

    def _apply_optimize(self, *args: Any, **kwargs: Any) -> list:
        return []


def _measure(view: PirView, roles: list[str], layers: list, startup: Any, batch: dict, scope: core._Scope,
             place: Any, repeat: int) -> tuple[list[OpRow], dict[str, int], dict[str, int], set[str]]:
    """Every forward op's row, the parameters' and activations' bytes, and the op types without a FLOP
    estimate, measured in ``scope``."""
    fed = _initialise(view, startup, batch, scope, place)
    sync = (lambda: core._cuda_synchronize(place)) if isinstance(place, core.CUDAPlace) else (lambda: None)
    timer = _Timer(view, scope, place, fed, repeat, sync)
    alone = [timer.time(j) for j in range(len(view.ops))]
    backward: dict[int, float] = {}
    index = {op.op: i for i, op in enumerate(view.ops) if roles[i] == FWD}  # Paddle's record of each backward op
    for j, i in gradient_owners(view, roles, lambda j: index.get(view.ops[j].forward)).items():
        backward[i] = backward.get(i, 0.0) + alone[j]
    # the loss gradient's seed (full_like) reads the loss for its shape and dtype only, where the legacy IR's
    # fill_constant reads nothing: not counted, so that both IRs save the same bytes (a scalar's)
    read_by_backward = {n for j, r in enumerate(roles) if r == BWD
                        for n in view.ops[j].input_arg_names[view.ops[j].type == "full_like":]}
    params = {p.name: tensor_bytes(scope, p.name) for p in view.all_parameters()}
    layer_of = {i: layer.index for layer in layers for i in layer.ops}
    rows, unestimated, var_bytes = [], set(), {}
    for i, role in enumerate(roles):
        if role != FWD:
            continue
        op = view.ops[i]
        outs = [n for n in op.output_arg_names if view.var(n).type == core.VarDesc.VarType.LOD_TENSOR
                and not view.var(n).persistable]
        var_bytes.update((n, tensor_bytes(scope, n)) for n in outs)
        flops = _flops(op, lambda name: list(scope.find_var(name).get_tensor().shape()))
        if flops is None:
            unestimated.add(op.type)
        rows.append(OpRow(i, op.type, layer_of[i], alone[i], backward.get(i, 0.0),
                          sum(params[n] for n in dict.fromkeys(op.input_arg_names) if n in params),
                          sum(var_bytes[n] for n in outs), sum(var_bytes[n] for n in outs if n in read_by_backward),
                          flops or 0, "" if flops is not None else "FLOPs not estimated"))
    return rows, params, var_bytes, unestimated


class _Timer:
    """Times ops of ``view`` one at a time (module docstring), each on the values of one run in ``scope``."""

    def __init__(self, view: PirView, scope: core._Scope, place: Any, fed: dict, repeat: int,
                 sync: Callable[[], None]):
        self.view, self.scope, self.place, self.fed, self.repeat, self.sync = view, scope, place, fed, repeat, sync
        self.exe = paddle.static.Executor(place)
        self.alone: dict[int, float] = {}
        # a PIR value is made by one op (values are named one to one), so one map serves every op
        self.producer = {n: i for i, op in enumerate(view.ops) for n in op.output_arg_names}

    def time(self, j: int) -> float:
        """Median seconds of op ``j`` run alone (with the ops making its non-tensor inputs, less theirs)."""
        ops = self._with_makers(j)
        if all(self.view.ops[i].type.startswith("builtin") for i in ops):
            self.alone[j] = 0.0
            return 0.0
        made = {n for i in ops for n in self.view.ops[i].output_arg_names}
        inputs = [n for i in ops for n in self.view.ops[i].input_arg_names
                  if n not in made and n not in self.view.free_ops]
        program = cut_program(self.view, ops, persistent={n: n for n in inputs})
        run = self._interpreter(program)
        times = []
        for k in range(self.repeat + 1):
            start = time.perf_counter()
            run()
            self.sync()
            if k:
                times.append(time.perf_counter() - start)
        self.alone[j] = max(0.0, statistics.median(times) - sum(self.alone[i] for i in ops if i != j))
        return self.alone[j]

    def _with_makers(self, j: int) -> list[int]:
        """Op ``j`` and, recursively, the ops making the values it reads that a data op cannot stand for
        (a vector of tensors, sparse rows)."""
        producer = self.producer
        ops, todo = {j}, [j]
        while todo:
            for name in self.view.ops[todo.pop()].input_arg_names:
                if name in producer and self.view.var(name).type != core.VarDesc.VarType.LOD_TENSOR \
                        and producer[name] not in ops:
                    ops.add(producer[name])
                    todo.append(producer[name])
        return sorted(ops)

    def _interpreter(self, program: Any) -> Callable[[], None]:
        """Paddle's interpreter of ``program``, built once and run directly (as ``runtime/pir_runs.py`` runs
        a section: partitioning does not import the runtime), fed the batch's data values it reads."""
        feeds = {n: self.fed[n] for n in getattr(program, FEEDS)}
        cache = getattr(self.exe, "_executor_cache", None)
        direct = (cache is not None and hasattr(self.exe, "_pir_feed_data")
                  and hasattr(cache, "_get_pir_program_and_executor"))
        if not direct:
            return lambda: self.exe.run(program, feed=feeds, fetch_list=[], scope=self.scope)  # another Paddle
        compiled, interpreter, data_ops = cache._get_pir_program_and_executor(cache._CachedData(
            program, dict(feeds), [], "feed", "fetch", self.place, self.scope, self.exe.plan))
        self.exe._pir_feed_data(compiled, dict(feeds), self.scope, data_ops)

        def run() -> None:
            for name, tensor in feeds.items():
                core.set_feed_variable(self.scope, tensor, name, 0)
            interpreter.run(list(feeds), False, False)
        return run


def _initialise(view: PirView, startup: Any, batch: dict, scope: core._Scope, place: Any) -> dict[str, Any]:
    """Parameters (from ``startup``, else small random values: op times do not depend on them), then one run
    of the whole differentiated program leaving every value it computes in ``scope`` under its view name.
    Returns the batch as tensors, by data name."""
    data = {n: v for n, v in view.vars.items() if v.is_data}
    for i, op in enumerate(view.ops):
        for name in op.input_arg_names:
            if name in data and name not in batch:
                raise ValueError(f"feed has no value for data variable '{name}', which {op_label(i, op)} reads")
    arrays, fed = {}, {}
    for name, value in batch.items():
        if name not in data:
            raise ValueError(f"feed names '{name}', which is not a variable of the program")
        arrays[name] = np.asarray(value, np_dtype(data[name].dtype))
        fed[name] = core.DenseTensor()
        fed[name].set(arrays[name], place)
    exe = paddle.static.Executor(place)
    if startup is not None:
        exe.run(clear_device_tags(startup.clone()), scope=scope)
    rng = np.random.default_rng(0)
    for name, var in view.vars.items():
        found = scope.find_var(name)
        if not var.persistable or var.constant or var.is_data:
            continue
        if found is not None and found.get_tensor()._is_initialized():
            continue
        dtype = np.dtype(np_dtype(var.dtype))
        shape = [max(int(d), 1) for d in var.shape]
        value = rng.uniform(-0.05, 0.05, shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype)
        scope.var(name).get_tensor().set(value, place)
    names = [n for op in view.ops for n in op.output_arg_names
             if view.var(n).type == core.VarDesc.VarType.LOD_TENSOR and not view.var(n).persistable]
    values = exe.run(view.program, feed=arrays, fetch_list=[view.var(n).value for n in names], scope=scope,
                     return_numpy=False)
    for name, tensor in zip(names, values):
        kept = scope.var(name).get_tensor()
        if tensor._is_initialized() and tensor._numel() > 0:
            kept._share_data_with(tensor._copy(place))
        else:  # an output the kernel leaves without memory (batch norm's reserve space on CPU): empty, as it is
            kept.set(np.zeros((0,) * max(1, len(view.var(name).shape)), np_dtype(view.var(name).dtype)), place)
    return fed


def _loss_name(forward: PirView, loss: Any) -> str:
    """The view's name of ``loss`` (a value of the program or a name), or of the one scalar float value no
    op reads (preferring a mean or sum)."""
    if loss is not None:
        name = forward.name_of(loss)
        forward.var(name)  # ValueError naming it when the program has no such value
        return name
    read = {n for op in forward.ops for n in op.input_arg_names}
    floats = (paddle.float32, paddle.float64, paddle.float16, paddle.bfloat16)
    found = [(n, op.type) for op in forward.ops for n in op.output_arg_names
             if n not in read and forward.var(n).dtype in floats and int(np.prod(forward.var(n).shape or [1])) == 1]
    return the_loss(found)


def the_loss(found: list[tuple[str, str]]) -> str:
    """The loss among ``found`` ((name, type of the op making it) of the scalar float values no op reads, on
    either IR): the only one, else the only one a mean or a sum makes; ``ValueError`` naming them otherwise."""
    preferred = [n for n, t in found if t in LOSS_OP_TYPES]
    for candidates in ([n for n, _ in found], preferred):
        if len(candidates) == 1:
            return candidates[0]
    raise ValueError(f"cannot tell which variable is the loss (scalar float outputs no op reads: "
                     f"{', '.join(n for n, _ in found) or 'none'}); pass loss=")


def _check_same_forward(forward: PirView, view: PirView) -> None:
    """The differentiated clone's forward ops are the program's, at the same indices and with the same
    names (Paddle's backward appends its ops): the rows and byte names are then the program's own."""
    same = all(a.type == b.type and a.output_arg_names == b.output_arg_names for a, b in zip(forward.ops, view.ops))
    if not same or any(role_of(op, i) != FWD for i, op in enumerate(view.ops[:len(forward.ops)])):
        raise RuntimeError(f"paddle {paddle.__version__} differentiated a clone of the program into other forward "
                           "ops than the program's; staticpipe.profile cannot tell its rows apart")


def _flops(op: Any, shape: Callable[[str], list[int]]) -> int | None:
    """Forward multiply-adds x 2 for matrix products and convolutions, one per element for elementwise
    ops; None for any other op type (the legacy IR's estimates, by PIR's op and argument names)."""
    if op.type == "matmul":
        x, out = shape(op.input("x")[0]), shape(op.output("out")[0])
        k = x[0] if len(x) == 1 else (x[-2] if op.attr("transpose_x") else x[-1])
        return 2 * int(np.prod(out)) * k
    if op.type in ("conv2d", "depthwise_conv2d", "conv3d"):
        out, kernel = shape(op.output("out")[0]), shape(op.input("filter")[0])
        return 2 * int(np.prod(out)) * int(np.prod(kernel[1:]))
    if op.type.rstrip("_") in ELEMENTWISE:
        return int(np.prod(shape(op.output_arg_names[0])))
    return None


def _runtime_flags(place: Any) -> ContextManager[None]:
    """The runtime's flags while inside (``runtime/pir_runs.py``: ops on the calling thread; on a CPU, no eager
    deletion), restored after: the interpreters built inside run only inside."""
    return flags_set({SERIAL_RUN: True, TRACE_RUN: True,
                      **({EAGER_DELETION: -1.0} if isinstance(place, core.CPUPlace) else {})})


def pir_twin(program: Any, loss: Any) -> tuple[Any, Any]:
    """A clone of the PIR ``program`` with its split points, and ``loss`` (a value of ``program``) in it: what
    ``auto_plan`` tags and minimizes for each partition it prices, leaving the program itself untouched."""
    mapping = paddle.pir.IrMapping()
    twin = program.clone(mapping)
    anchors = getattr(program, SPLIT_POINTS, None)
    if anchors is not None:
        setattr(twin, SPLIT_POINTS, [None if a is None else mapping.look_up(a.result(0)).get_defining_op()
                                     for a in anchors])
    return twin, mapping.look_up(loss)

"""``PipelineOptimizer``: the user-facing wrapper that differentiates, optimizes, then rewrites.

It adds backward and optimizer ops through the wrapped Paddle optimizer, exactly as single-device
training would, so the main program stays a valid single-device program (the reference); the pipeline
``Plan`` is built from it by pure passes and attached to the main and startup programs.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import replace
from typing import Any

from . import placement
from ._paddle import OP_ROLE, ROLE_BACKWARD, ROLE_OPTIMIZE, core, framework, paddle
from .capabilities import bf16_kernel_op, require_bf16
from .pir_ir import Gradients, differentiate, is_pir_value
from .pir_view import PirView
from .gc_paused import gc_paused
from .linear_scans import linear_scans
from .op_callstacks import fast_callstacks
from .placement import split_points_kept
from .plan import Plan, attach_plan, plan_of
from .rewrite import PlanOptions, check_layout, plan_with
from .schedule.simulate import StageCosts


class PipelineOptimizer:
    """Wrap ``optimizer``; ``minimize`` splits the program into stages by its ``device_guard`` tags.

    ``num_microbatches``: micro-batches per global batch (gradients are accumulated over them).
    ``schedule``: "1F1B", "F-then-B" (aliases "FThenB", "GPipe"), "interleaved" (several chunks per
    device: guards cycling through the devices), "ZB-H1", "ZB-V" (zero bubble, backward split into B
    and W), "ZB-2P" (zero bubble at twice 1F1B's activations), "V-Min", "V-Half" (a V like ZB-V at a
    third / half of 1F1B's activations), "Eager1F1B" (Paddle's: 1F1B with twice the warm-up),
    "DualPipeV" (a V pairing a forward with a backward of another micro-batch), or a custom schedule:
    ``{rank: [Action, ...]}`` or its text (``rank 0: 0F0 0F1 ...``).
    ``schedule_costs``: for "ZB-H1", "ZB-V", "ZB-2P", "V-Min" and "V-Half", the F, B and W durations to plan the
    order with (``docs/schedules.md``: each keeps the shortest of a portfolio of orders), one
    per kind or a list of one per stage (``{"F": [0.031, 0.035], ...}``: ``Timeline.stage_costs()`` of a
    traced step), or a function of the action; None plans with unit costs.
    ``schedule_comm``: for the same schedules, the latency of a message between two devices
    to plan the order with: seconds, ``{(source rank, destination rank): seconds}`` or a function of the two
    ranks (``schedule/latency.py``); None: messages are free.
    ``micro_batch_size``: fixes the batch dimension of cut variables at rewrite time; otherwise it is
    fixed by the first batch.
    ``recompute``: True (every stage) or a list of stage indices that keep only their inputs between
    forward and backward and recompute the rest (activation checkpointing).
    ``dp_degree``: data-parallel replicas of the whole pipeline, for a job of ``dp_degree`` x devices
    processes (``python -m staticpipe.launch``): replica k is processes k x devices ... (k+1) x devices - 1,
    trains on the k-th slice of every global batch, and the replicas average their accumulated gradients
    before each update, so training equals one pipeline (and one device) on the global batch.
    ``replica_batches``: "split" (the default, above) or "own", Paddle's fleet meaning: every process is fed
    its own replica's batches (a loader batch is that replica's micro-batch, so the global batch is
    dp_degree x num_microbatches x micro_batch_size), as ``staticpipe.fleet`` builds it.
    ``loss_reduction``: "auto" (the default) trains as one device on the whole batch whatever the loss
    reduces the batch by: a batch mean's micro-batches are averaged, a batch sum's added (and so are the
    fetched losses); a loss that is neither is refused at minimize. "mean" averages the micro-batches'
    gradients whatever the loss, as Paddle's pipeline does (``staticpipe.fleet`` asks for it).
    ``sharding_degree``: ZeRO stage 1 -- groups of that many consecutive replicas (it divides ``dp_degree``)
    share one copy of the optimizer state: each member keeps the moments and master weights of about
    1/sharding_degree of each stage's parameters, updates those, and broadcasts their new values to the
    group (``rewrite/sharding.py``). Training is unchanged; each rank's optimizer state shrinks.
    """

    def __init__(self, optimizer: Any, num_microbatches: int = 1, schedule: str | dict = "1F1B",
                 micro_batch_size: int | None = None, recompute: bool | list[int] = False,
                 dp_degree: int = 1, schedule_costs: StageCosts | None = None, replica_batches: str = "split",
                 loss_reduction: str = "auto", sharding_degree: int = 1, schedule_comm: Any = None):
        if not _is_paddle_optimizer(optimizer):
            raise ValueError(f"optimizer must be a paddle.optimizer.Optimizer, or one decorated by Paddle's static AMP "
                             f"(paddle.static.amp.decorate, paddle.static.amp.bf16.decorate_bf16), got "
                             f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
        self.inner = optimizer
        self.options = PlanOptions(num_microbatches, schedule, micro_batch_size, recompute, schedule_costs, dp_degree,
                                   replica_batches, loss_reduction, sharding_degree, schedule_comm)
        self.plan: Plan | None = None

    def _option(name: str) -> property:  # noqa: N805  (a property factory, used in the class body)
        """An option as an attribute; setting it checks the new options as the constructor does."""
        return property(lambda self: getattr(self.options, name),
                        lambda self, value: setattr(self, "options", replace(self.options, **{name: value})))

    num_microbatches = _option("num_microbatches")
    schedule = _option("schedule")
    micro_batch_size = _option("micro_batch_size")
    recompute = _option("recompute")
    dp_degree = _option("dp_degree")
    schedule_costs = _option("schedule_costs")
    replica_batches = _option("replica_batches")
    loss_reduction = _option("loss_reduction")
    sharding_degree = _option("sharding_degree")
    schedule_comm = _option("schedule_comm")
    del _option

    def amp_init(self, place: Any = None, scope: Any = None, test_program: Any = None, **kwargs: Any) -> None:
        """Paddle's ``amp_init``, which a pure-fp16/bf16 script calls after the startup program to cast the
        float32 parameters to the low precision the program declares. staticpipe's ``Executor.run(startup)``
        already stores every stage's parameters in the dtype its stage declares, so this only checks that
        it may be called; a ``test_program`` to cast is not supported yet (an error, not ignored)."""
        if self.plan is None:
            raise ValueError("amp_init before minimize: call minimize(loss) first, then run the startup program")
        if not hasattr(self.inner, "amp_init"):
            raise ValueError(f"amp_init: the wrapped optimizer ({type(self.inner).__name__}) is not AMP-decorated")
        if test_program is not None:
            raise ValueError("amp_init(test_program=...): casting an evaluation program to low precision is not "
                             "supported by staticpipe yet; evaluate with a clone of the trained program taken after "
                             "minimize (main.clone(for_test=True)), whose parameters have the stages' dtypes")

    def __getattr__(self, name: str) -> Any:
        """Only for names the class lacks: Paddle's AMP decorators read optimizer internals (``type``,
        ``_learning_rate``) when they are wrapped around this optimizer, the wrong way round."""
        raise AttributeError(f"'PipelineOptimizer' object has no attribute {name!r}; to train with AMP, wrap the "
                             "AMP-decorated optimizer in it instead: "
                             "PipelineOptimizer(paddle.static.amp.decorate(optimizer), ...)")

    def layout(self, loss: Any) -> tuple[Any, list[str], list[int]]:
        """(stage assignment, the distinct devices, each stage's device index) of ``loss``'s forward program
        under these options, on either IR, before ``minimize`` changes anything (``rewrite.check_layout``)."""
        program = loss.block.program
        return check_layout(PirView(program, Gradients(), loss) if is_pir_value(loss) else program, self.options)

    def minimize(self, loss: framework.Variable, startup_program: framework.Program | None = None,
                 parameters: Any = None, no_grad_set: Any = None) -> tuple[list, list]:
        if is_pir_value(loss):
            return self._minimize_pir(loss, startup_program, parameters, no_grad_set)
        if not isinstance(loss, framework.Variable):
            raise ValueError(f"minimize: the loss is a {type(loss).__module__}.{type(loss).__qualname__}, not a variable "
                             "of a Paddle static program (legacy IR or PIR)")
        program = loss.block.program
        if plan_of(program) is not None:
            raise ValueError("minimize was already called on this program: it holds a pipeline plan (and the "
                             "backward and optimizer ops of the first call); build the program again to minimize "
                             "it anew")
        if _has_role(program, ROLE_BACKWARD):
            raise ValueError("this program already holds backward ops: minimize (or append_backward) ran on it "
                             "before, and a pipeline's minimize would add a second backward; build the program "
                             "again to minimize it anew")
        check_layout(program, self.options)  # what can fail on the forward program fails before it changes
        _check_amp(self.inner)
        _check_bf16(self.inner, program)
        startup = startup_program or paddle.static.default_startup_program()
        updates = _update_ops(program)
        # AMP inserts casts into the forward ops (split points kept); the others make Paddle's minimize faster
        with split_points_kept(program), linear_scans(), fast_callstacks(), gc_paused():
            result = _inner_minimize(self.inner, loss, startup_program, parameters, no_grad_set)
        if _update_ops(program) == updates:
            raise ValueError(f"the inner optimizer's minimize ({type(self.inner).__name__}) added no update ops to the "
                             "program: nothing would ever train; wrap a paddle.optimizer.Optimizer")
        self.plan = plan_with(program, loss.name, self.options)
        attach_plan(self.plan, program, startup)
        return result

    def _minimize_pir(self, loss: Any, startup_program: Any, parameters: Any, no_grad_set: Any) -> tuple[list, list]:
        """``minimize`` of a PIR program (Paddle 3's default IR): the same plan from the same passes, read
        through ``pir_ir.PirView``; what the PIR builders do not build yet is refused by name."""
        program = loss.block.program
        if plan_of(program) is not None:
            raise ValueError("minimize was already called on this program: it holds a pipeline plan; build the "
                             "program again to minimize it anew")
        if any(op.op_role in (ROLE_BACKWARD, ROLE_OPTIMIZE) for op in program.global_block().ops):
            raise ValueError("this program already holds backward ops: minimize (or paddle.autograd.ir_backward) ran "
                             "on it before; build the program again to minimize it anew")
        if type(self.inner).__module__.startswith("paddle.static.amp."):
            raise ValueError("staticpipe does not pipeline PIR programs with AMP (paddle.static.amp) yet; build the "
                             "program in legacy-IR mode for it (STATICPIPE_LEGACY_IR=1, see README)")
        check_layout(PirView(program, Gradients(), loss), self.options)  # before the program changes
        _check_bf16(self.inner, program)
        startup = startup_program or paddle.static.default_startup_program()
        result, grads = differentiate(self.inner, loss, startup_program, parameters, no_grad_set)
        view = PirView(program, grads, loss)
        if not any(op.op_role == ROLE_OPTIMIZE for op in program.global_block().ops if op.num_operands()):
            raise ValueError(f"the inner optimizer ({type(self.inner).__name__}) added no update ops to the program: "
                             "nothing would ever train")
        self.plan = plan_with(view, view.loss, self.options)
        attach_plan(self.plan, program, startup)
        view.attach()
        return result


def _update_ops(program: framework.Program) -> int:
    """How many optimizer-role ops ``program`` holds (Paddle tags every parameter update with it)."""
    return sum(1 for op in program.global_block().ops
               if op.has_attr(OP_ROLE) and int(op.attr(OP_ROLE)) & ROLE_OPTIMIZE)


def _has_role(program: framework.Program, role: int) -> bool:
    return any(op.has_attr(OP_ROLE) and int(op.attr(OP_ROLE)) & role for op in program.global_block().ops)


def _inner_minimize(inner: Any, loss: framework.Variable, startup: framework.Program | None, parameters: Any,
                    no_grad_set: Any) -> Any:
    """``inner.minimize``: Paddle's optimizers name the parameter list ``parameters``, its static AMP
    decorators (``paddle.static.amp.decorate``, ``decorate_bf16``) ``parameter_list``. ``startup`` is passed
    on as the user gave it: given one, pure-bf16 AMP also makes its initialisers bfloat16 (master weights
    then start rounded); given None, it leaves that to ``amp_init``, as in a single-device script."""
    accepted = inspect.signature(inner.minimize).parameters
    name = "parameters" if "parameters" in accepted else "parameter_list"
    return inner.minimize(loss, startup_program=startup, no_grad_set=no_grad_set, **{name: parameters})


def _check_amp(inner: Any) -> None:
    """Refuse what Paddle's static AMP would silently not do here: ``paddle.static.amp.decorate`` casts only
    ops the current device has low-precision kernels for, and Paddle 2.6 has none on CPU, so pure fp16/bf16
    (O2) would train in float32 without a word. fp16/bf16 O1 there keeps its meaning (loss scaling runs,
    in float32) and is allowed, with a warning; ``decorate_bf16`` casts and runs bfloat16 on CPU."""
    if type(inner).__module__ != "paddle.static.amp.decorator" or placement.cuda_device_count() > 0:
        return
    dtype = "bfloat16" if inner._amp_vartype == core.VarDesc.VarType.BF16 else "float16"
    if inner._use_pure_fp16:
        raise ValueError(f"paddle.static.amp.decorate(level='O2', dtype='{dtype}') needs CUDA: on CPU Paddle has no "
                         f"{dtype} kernels for its white-list ops, casts nothing and would train in float32; use "
                         "paddle.static.amp.bf16.decorate_bf16 for bfloat16 on CPU")
    logging.getLogger("staticpipe").warning(
        "staticpipe: AMP O1 (%s) on CPU: Paddle casts no op to %s here (no CPU kernels); loss scaling runs, "
        "in float32", dtype, dtype)


def _check_bf16(inner: Any, program: Any) -> None:
    """Refuse, before the program changes, a bfloat16 program with a stage on a CPU that cannot run
    bfloat16 (``capabilities.require_bf16``): ``decorate_bf16`` casts every stage's white-list ops, Paddle's
    ``decorate(dtype="bfloat16")`` does where CUDA is (its CPU stages too), and a matmul the user gave
    bfloat16 values needs oneDNN's bfloat16 kernels on its device. Where a stage runs is its tag, through
    ``STATICPIPE_DEVICE_MAP``; an ``Executor(device_map=...)`` that moves a stage to the CPU is checked
    before the stage's first run."""
    module = type(inner).__module__
    if module == "paddle.static.amp.bf16.decorator" or (
            module == "paddle.static.amp.decorator" and placement.cuda_device_count() > 0
            and getattr(inner, "_amp_vartype", None) in (core.VarDesc.VarType.BF16, paddle.bfloat16)):
        what, ops = "a bfloat16 AMP program (its white-list ops cast to bfloat16)", program.global_block().ops
    else:
        found = bf16_kernel_op(program)
        if found is None:
            return
        what, ops = found[1], [found[0]] if placement.op_device(found[0]) else program.global_block().ops  # untagged: joins a stage
    mapping = placement.device_map()
    for device in sorted({d for d in map(placement.op_device, ops) if d}) or ["gpu:0"]:  # no guard at all: one stage, on gpu:0
        require_bf16(device, placement.place_of(mapping.get(device, device)), what)


def _is_paddle_optimizer(optimizer: Any) -> bool:
    """A ``paddle.optimizer.Optimizer``, or Paddle's static AMP decorator around one: what ``minimize``
    knows how to split (the decorators keep the optimizer they wrap as ``_optimizer``)."""
    if type(optimizer).__module__.startswith("paddle.static.amp."):
        optimizer = getattr(optimizer, "_optimizer", None)
    return isinstance(optimizer, paddle.optimizer.Optimizer)

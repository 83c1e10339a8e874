"""staticpipe.rewrite: stage assignment, sections with send/recv, routes, data feeds, gradient merge.

Every program here is small and built by hand; nothing is executed.
"""
from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

import pytest

import staticpipe
from pipeline_util import dense_layers, learning_rate_var, op_vars
from staticpipe._paddle import paddle
from staticpipe.plan import BACKWARD, FORWARD, INIT, OPTIMIZE, CutVar, SectionRef
from staticpipe.rewrite import MERGED_SUFFIX, assign_stages, build_plan
from staticpipe.rewrite.optimize import place_optimize_ops
from staticpipe.rewrite.sections import param_grads

pytestmark = pytest.mark.timeout(120)

dg = staticpipe.device_guard
fc = paddle.static.nn.fc
SECTION_KINDS = [FORWARD, BACKWARD, OPTIMIZE, INIT]


def momentum():
    return paddle.optimizer.Momentum(0.1, momentum=0.9)


def build(body, pipeline=None, optimizer=momentum, minimize=True):
    """Build ``body()`` (returns the loss) in fresh programs with deterministic names; then minimize it
    with the plain optimizer (``pipeline=None``) or a PipelineOptimizer with ``pipeline`` as keywords."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        loss = body()
        opt = None
        if minimize:
            opt = optimizer()
            if pipeline is not None:
                opt = staticpipe.PipelineOptimizer(opt, **pipeline)
            opt.minimize(loss)
    return SimpleNamespace(main=main, startup=startup, loss=loss, opt=opt, plan=getattr(opt, "plan", None))


def mlp(layout, hidden=256):
    """fc layers on the devices of ``layout`` (ReLU, then a 10-way classifier), cross-entropy on the last."""
    def body():
        h = paddle.static.data("features", [None, 64], "float32")
        label = paddle.static.data("label", [None, 1], "int64")
        for i, dev in enumerate(layout):
            last = i == len(layout) - 1
            with dg(dev):
                h = fc(h, 10 if last else hidden, activation=None if last else "relu")
        with dg(layout[-1]):
            return paddle.mean(paddle.nn.functional.cross_entropy(h, label, reduction="none"))
    return body


MLP2 = ["gpu:0"] * 3 + ["gpu:1"] * 2
MLP3 = ["gpu:0"] * 2 + ["gpu:1"] + ["gpu:2"] * 2


def types(section):
    return [op.type for op in section.program.global_block().ops]


def ops(section):
    return list(section.program.global_block().ops)


# ============================================================================= stage assignment

def two_stages_reversed():
    x = paddle.static.data("x", [None, 4], "float32")
    with dg("gpu:1"):
        h = fc(x, 8)
    with dg("gpu:0"):
        return paddle.mean(fc(h, 3))


def test_stages_numbered_by_first_forward_use_of_each_device():
    net = build(two_stages_reversed)
    a = assign_stages(net.main)
    assert a.devices == ["gpu:1", "gpu:0"]
    block = net.main.global_block()
    got = [(op.type, a.role[i], a.stage[i]) for i, op in enumerate(block.ops)]
    assert got == [
        ("mul", "forward", 0), ("elementwise_add", "forward", 0),
        ("mul", "forward", 1), ("elementwise_add", "forward", 1), ("reduce_mean", "forward", 1),
        ("fill_constant", "backward", 1), ("reduce_mean_grad", "backward", 1),
        ("elementwise_add_grad", "backward", 1), ("mul_grad", "backward", 1),
        ("elementwise_add_grad", "backward", 0), ("mul_grad", "backward", 0),
        ("momentum", "optimize", None), ("momentum", "optimize", None),
        ("momentum", "optimize", None), ("momentum", "optimize", None),
    ]
    (w0, b0), (w1, b1) = dense_layers(net.main)  # the layer on gpu:1 (stage 0), then the one on gpu:0
    assert a.param_stage == {w0: 0, b0: 0, w1: 1, b1: 1}
    # each optimizer op sits on the stage of the parameter it updates
    placement = place_optimize_ops(block, a, param_grads(block, a))
    for s, items in placement.ops.items():
        assert sorted(block.ops[i].input("Param")[0] for i in items) == sorted(
            p for p, st in a.param_stage.items() if st == s)

    plan = build_plan(net.main, net.loss.name, 2)
    assert plan.devices == ["gpu:1", "gpu:0"]
    assert [s.parameters for s in plan.stages] == [(w0, b0), (w1, b1)]
    assert [[op.input("Param") for op in ops(s.sections[OPTIMIZE]) if op.type == "momentum"]
            for s in plan.stages] == [[[b0], [w0]], [[b1], [w1]]]
    assert types(plan.stages[0].sections[BACKWARD]) == [
        "recv_v2", "elementwise_add_grad", "mul_grad", "sum", "sum"]
    assert types(plan.stages[1].sections[BACKWARD]) == [
        "fill_constant", "reduce_mean_grad", "elementwise_add_grad", "mul_grad", "sum", "sum", "send_v2"]


def test_stage_parameters_of_a_three_stage_mlp():
    net = build(mlp(MLP3), pipeline=dict(num_microbatches=2))
    plan, layers = net.plan, dense_layers(net.main)  # layers: (weight, bias) of the 5 fc layers
    assert plan.devices == ["gpu:0", "gpu:1", "gpu:2"]
    assert [s.parameters for s in plan.stages] == [
        (*layers[0], *layers[1]),
        (*layers[2],),
        (*layers[3], *layers[4]),
    ]
    assert [plan.stage_of_var(weight) for weight, _ in layers] == [[0], [0], [1], [2], [2]]
    assert plan.stage_of_var(learning_rate_var(net.main)) == [0, 1, 2]


def test_every_section_op_of_a_guarded_program_carries_its_stage_device():
    plan = build(mlp(MLP3), pipeline=dict(num_microbatches=2)).plan
    for st in plan.stages:
        for kind, sec in st.sections.items():
            assert {op.attr("op_device") for op in ops(sec)} == {st.device}, (st.index, kind)


# ----------------------------------------------------------------------------- unguarded forward ops

def producer_rule():
    x = paddle.static.data("x", [None, 4], "float32")
    with dg("gpu:0"):
        a = fc(x, 4)
    with dg("gpu:1"):
        b = fc(a, 4)
    c = paddle.add(a, b)  # unguarded, inputs from stages 0 and 1
    return paddle.mean(c)  # unguarded, input from the unguarded add


def test_unguarded_op_joins_latest_producer_stage():
    net = build(producer_rule)
    a = assign_stages(net.main)
    block = net.main.global_block()
    assert [(op.type, repr(op.attr("op_device")), a.stage[i]) for i, op in enumerate(block.ops)][:6] == [
        ("mul", "'gpu:0'", 0), ("elementwise_add", "'gpu:0'", 0),
        ("mul", "'gpu:1'", 1), ("elementwise_add", "'gpu:1'", 1),
        ("elementwise_add", "''", 1), ("reduce_mean", "''", 1)]
    # their unguarded backward ops (the loss gradient included) follow them to stage 1
    unguarded_bwd = [(op.type, a.stage[i]) for i, op in enumerate(block.ops)
                     if a.role[i] == "backward" and op.attr("op_device") == ""]
    assert unguarded_bwd == [("fill_constant", 1), ("reduce_mean_grad", 1), ("elementwise_add_grad", 1)]
    plan = build_plan(net.main, net.loss.name, 2)
    assert types(plan.stages[1].sections[FORWARD]) == [
        "recv_v2", "mul", "elementwise_add", "elementwise_add", "reduce_mean"]
    assert types(plan.stages[1].sections[BACKWARD])[:3] == ["fill_constant", "reduce_mean_grad",
                                                           "elementwise_add_grad"]


def consumer_rule():
    x = paddle.static.data("x", [None, 4], "float32")
    s = paddle.scale(x, 2.0)  # unguarded, reads only data: earliest consumer is stage 1
    with dg("gpu:0"):
        a = fc(x, 4)
    with dg("gpu:1"):
        b = paddle.add(fc(a, 4), s)
    with dg("gpu:2"):
        return paddle.mean(paddle.multiply(b, s))


def test_unguarded_op_with_only_data_inputs_joins_earliest_consumer_stage():
    net = build(consumer_rule)
    a = assign_stages(net.main)
    op0 = net.main.global_block().ops[0]
    assert (op0.type, op0.attr("op_device"), a.stage[0]) == ("scale", "", 1)
    plan = build_plan(net.main, net.loss.name, 2)
    assert types(plan.stages[1].sections[FORWARD])[:2] == ["recv_v2", "scale"]
    assert plan.data_vars == {"x": (0, 1)}
    # the scaled value travels from stage 1 to stage 2 along with stage 1's activation (the names are
    # Paddle's own: read them from the program)
    scaled = op0.output("Out")[0]
    added = next(op.output("Out")[0] for op in net.main.global_block().ops
                 if op.type == "elementwise_add" and scaled in op.input_arg_names)
    routes = [(r.src, r.dst, sorted(v.name for v in r.vars)) for r in plan.routes if r.dst == SectionRef(2, FORWARD)]
    assert routes == [(SectionRef(1, FORWARD), SectionRef(2, FORWARD), sorted([added, scaled]))]


def leftover_rule():
    x = paddle.static.data("x", [None, 4], "float32")
    with dg("gpu:1"):
        a = fc(x, 4)
    with dg("gpu:0"):
        loss = paddle.mean(fc(a, 4))
    paddle.scale(x, 3.0)  # unguarded, reads only data, consumed by nothing: stage 0 (here gpu:1)
    return loss


def test_unguarded_op_without_producer_or_consumer_goes_to_stage_0():
    net = build(leftover_rule)
    a = assign_stages(net.main)
    i = next(i for i, op in enumerate(net.main.global_block().ops) if op.type == "scale")
    assert (a.stage[i], a.devices[a.stage[i]]) == (0, "gpu:1")
    plan = build_plan(net.main, net.loss.name, 2)
    assert types(plan.stages[0].sections[FORWARD]) == ["mul", "elementwise_add", "scale", "send_v2"]


def test_program_without_guards_is_one_stage_on_gpu0():
    def body():
        x = paddle.static.data("features", [None, 8], "float32")
        label = paddle.static.data("label", [None, 1], "int64")
        h = fc(fc(x, 16, activation="relu"), 4)
        return paddle.mean(paddle.nn.functional.cross_entropy(h, label, reduction="none"))

    net = build(body, pipeline=dict(num_microbatches=3))
    a = assign_stages(net.main)
    assert a.devices == ["gpu:0"]
    assert {a.stage[i] for i, role in enumerate(a.role) if role in ("forward", "backward")} == {0}
    plan = net.plan
    assert plan.devices == ["gpu:0"]
    assert plan.routes == ()
    assert plan.data_vars == {"features": (0,), "label": (0,)}
    assert " ".join(map(str, plan.actions[0])) == "0F0 0B0 0F1 0B1 0F2 0B2 0OPT"
    for sec in plan.stages[0].sections.values():
        assert not {"send_v2", "recv_v2"} & set(types(sec))
    assert staticpipe.plan_of(net.main) is plan and staticpipe.plan_of(net.startup) is plan


# ----------------------------------------------------------------------------- documented rule, chain case

def unguarded_chain():
    x = paddle.static.data("x", [None, 4], "float32")
    u0 = paddle.scale(x, 2.0)  # unguarded, data only: earliest consumer (stage 0)
    with dg("gpu:0"):
        a = fc(u0, 4)
    u1 = paddle.nn.functional.relu(u0)  # unguarded, its producer u0 ends on stage 0
    with dg("gpu:1"):
        return paddle.mean(paddle.add(fc(a, 4), u1))


def test_unguarded_op_reading_an_unguarded_producer_follows_the_producer_rule():
    net = build(unguarded_chain, minimize=False)
    a = assign_stages(net.main)
    block = net.main.global_block()
    assert [(op.type, a.stage[i]) for i, op in enumerate(block.ops)][:4] == [
        ("scale", 0), ("mul", 0), ("elementwise_add", 0), ("relu", 0)]


def unguarded_reuse_of_stage0_weight():
    x = paddle.static.data("x", [None, 4], "float32")
    w = paddle.static.create_parameter([4, 4], "float32", name="w")
    u0 = paddle.scale(x, 2.0)  # unguarded, data only
    with dg("gpu:0"):
        a = paddle.matmul(u0, w)
    u1 = paddle.matmul(u0, w)  # unguarded; by the documented producer rule it joins u0 on stage 0
    with dg("gpu:1"):
        return paddle.mean(paddle.add(fc(a, 4), u1))


def test_unguarded_reuse_of_a_stage_weight_is_not_a_shared_parameter():
    net = build(unguarded_reuse_of_stage0_weight, minimize=False)
    a = assign_stages(net.main)
    weight, bias = [p.name for p in net.main.all_parameters() if p.name != "w"]  # the fc layer's, in creation order
    assert a.param_stage == {"w": 0, weight: 1, bias: 1}


# ============================================================================= errors

def backflow():
    x = paddle.static.data("x", [None, 4], "float32")
    with dg("gpu:0"):
        a = fc(x, 4)
    with dg("gpu:1"):
        b = fc(a, 4)
    with dg("gpu:0"):
        c = paddle.scale(b, 2.0)
    with dg("gpu:1"):
        return paddle.mean(c)


BACKFLOW = ("op #4 'scale' on stage 0 (gpu:0) reads variable '{cut}' produced on the later stage 1 "
            "(gpu:1) by op #3 'elementwise_add': forward data may only flow to later stages; move the op into "
            "a later device_guard or reorder the guards")


def test_forward_data_flowing_back_is_rejected():
    net = build(backflow, minimize=False)
    # the variable read back: the second fc layer's output (its bias add, op #3, on stage 1)
    message = BACKFLOW.format(cut=op_vars(net.main, "elementwise_add", "Out")[1])
    with pytest.raises(ValueError, match=re.escape(message)):
        build(backflow, pipeline=dict(num_microbatches=2))
    with pytest.raises(ValueError, match=re.escape(message)):
        assign_stages(net.main)


def shared_weight():
    x = paddle.static.data("x", [None, 4], "float32")
    w = paddle.static.create_parameter([4, 4], "float32", name="shared_w")
    with dg("gpu:0"):
        a = paddle.matmul(x, w)
    with dg("gpu:1"):
        return paddle.mean(paddle.matmul(a, w))


def test_parameter_used_on_two_stages_is_shared_with_its_first_stage_as_owner():
    net = build(shared_weight, pipeline=dict(num_microbatches=2))
    a = assign_stages(net.main)
    assert a.param_stage == {"shared_w": 0} and a.shared == {"shared_w": (0, 1)}
    plan = net.plan
    assert plan.stages[0].parameters == ("shared_w",) and plan.stages[1].parameters == ()
    # stage 1 accumulates its partial gradient itself and sends the sum once per step; the owner
    # adds it, updates, and sends the new value back
    partial = "shared_w@GRAD@RENAME@block0@0"
    assert plan.stages[1].grad_buffers == (partial + "@MERGED",)
    assert all(v.name != partial for r in plan.routes for v in r.vars)
    opt0, opt1 = ops(plan.stages[0].sections[OPTIMIZE]), ops(plan.stages[1].sections[OPTIMIZE])
    assert [(op.type, op.attr("peer")) for op in opt0 if op.type in ("send_v2", "recv_v2")] == [
        ("recv_v2", 1), ("send_v2", 1)]
    assert [(op.type, op.attr("peer")) for op in opt1 if op.type in ("send_v2", "recv_v2")] == [
        ("send_v2", 0), ("recv_v2", 0)]
    assert opt1[0].input("X") == [partial + "@MERGED"] and opt1[-1].output("Out") == ["shared_w"]


def fixed_batch():
    x = paddle.static.data("x", [8, 4], "float32")
    with dg("gpu:0"):
        a = fc(x, 4)
    with dg("gpu:1"):
        return paddle.mean(fc(a, 4))


def test_fixed_batch_dimension_needs_one_microbatch():
    net = build(fixed_batch)
    message = ("data variable 'x' has shape [8, 4] with a fixed batch dimension; declare it with None as dim 0 "
               "so it can be split into 4 micro-batches")
    with pytest.raises(ValueError, match=re.escape(message)):
        build_plan(net.main, net.loss.name, 4)
    plan = build_plan(net.main, net.loss.name, 1)
    assert plan.data_specs == {"x": ((8, 4), "float32")}
    cut = op_vars(net.main, "elementwise_add", "Out")[0]  # the first fc layer's output
    assert plan.routes[0].vars == (CutVar(cut, (8, 4), "float32", False),)


def test_unknown_schedule_is_rejected():
    message = ("unknown schedule 'Interleaved'; known schedules: F-then-B (aliases FThenB, GPipe), 1F1B, "
               "interleaved (aliases Interleaved1F1B, interleaved-1F1B), ZB-H1, ZB-V, V-Min, V-Half, ZB-2P, Eager1F1B, "
               "DualPipeV")
    with pytest.raises(ValueError, match=re.escape(message)):
        staticpipe.PipelineOptimizer(momentum(), num_microbatches=2, schedule="Interleaved")
    net = build(fixed_batch)
    with pytest.raises(ValueError, match=re.escape(message)):
        build_plan(net.main, net.loss.name, 1, "Interleaved")


@pytest.mark.parametrize("m", [0, -1, 2.5, True, None])
def test_bad_num_microbatches_is_rejected_by_the_constructor(m):
    message = f"num_microbatches must be an integer >= 1, got {m!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        staticpipe.PipelineOptimizer(momentum(), num_microbatches=m)
    net = build(fixed_batch)
    with pytest.raises(ValueError, match=re.escape(message)):
        build_plan(net.main, net.loss.name, m)


def test_pipeline_optimizer_checks_its_arguments():
    with pytest.raises(ValueError, match=re.escape(
            "optimizer must be a paddle.optimizer.Optimizer, or one decorated by Paddle's static AMP "
            "(paddle.static.amp.decorate, paddle.static.amp.bf16.decorate_bf16), got builtins.object")):
        staticpipe.PipelineOptimizer(object())
    opt = staticpipe.PipelineOptimizer(momentum(), num_microbatches=3, schedule="GPipe")
    assert (opt.num_microbatches, opt.schedule, opt.micro_batch_size, opt.plan) == (3, "F-then-B", None, None)


@pytest.mark.parametrize("mbs", [0, -4, 2.0, "8"])
def test_bad_micro_batch_size_is_rejected(mbs):
    net = build(mlp(MLP2))
    message = f"micro_batch_size must be a positive integer or None, got {mbs!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        build_plan(net.main, net.loss.name, 2, "1F1B", mbs)


# ============================================================================= sections and routes

def recv_summary(op):
    return (op.type, op.output("Out"), op.attr("peer"), list(op.attr("out_shape")), op.attr("dynamic_shape"),
            op.attr("op_device"), op.attr("op_role"))


def send_summary(op):
    return (op.type, op.input("X"), op.attr("peer"), op.attr("dynamic_shape"), op.attr("op_device"),
            op.attr("op_role"))


@pytest.mark.parametrize("mbs, dim0, mb", [(None, -1, "mb"), (8, 8, "8")])
def test_two_stage_sections_exchange_cut_vars(mbs, dim0, mb):
    net = build(mlp(MLP2), pipeline=dict(num_microbatches=4, micro_batch_size=mbs))
    plan = net.plan
    cut = op_vars(net.main, "relu", "Out")[2]  # the third layer's ReLU output, the last on stage 0
    grad = cut + "@GRAD"
    assert plan.micro_batch_size == mbs
    for st in plan.stages:
        assert list(st.sections) == SECTION_KINDS
        assert [(sec.stage, sec.kind) for sec in st.sections.values()] == [(st.index, k) for k in SECTION_KINDS]
    s0, s1 = plan.stages
    dynamic = mbs is None
    # activations: stage 0 forward ends by sending, stage 1 forward starts by receiving
    assert types(s0.sections[FORWARD]) == ["mul", "elementwise_add", "relu"] * 3 + ["send_v2"]
    assert send_summary(ops(s0.sections[FORWARD])[-1]) == ("send_v2", [cut], 1, dynamic, "gpu:0", 0)
    assert types(s1.sections[FORWARD]) == ["recv_v2", "mul", "elementwise_add", "relu", "mul", "elementwise_add",
                                           "softmax_with_cross_entropy", "reduce_mean"]
    assert recv_summary(ops(s1.sections[FORWARD])[0]) == (
        "recv_v2", [cut], 0, [dim0, 256], dynamic, "gpu:1", 0)
    # gradients of the cut variable go the other way
    assert send_summary(ops(s1.sections[BACKWARD])[-1]) == (
        "send_v2", [grad], 0, dynamic, "gpu:1", 1)
    assert recv_summary(ops(s0.sections[BACKWARD])[0]) == (
        "recv_v2", [grad], 1, [dim0, 256], dynamic, "gpu:0", 1)
    # no other communication anywhere
    comm = [(st.index, k, t) for st in plan.stages for k, sec in st.sections.items() for t in types(sec)
            if t in ("send_v2", "recv_v2")]
    assert comm == [(0, FORWARD, "send_v2"), (0, BACKWARD, "recv_v2"),
                    (1, FORWARD, "recv_v2"), (1, BACKWARD, "send_v2")]
    # routes
    assert [(r.index, r.src, r.dst, r.channel, r.vars) for r in plan.routes] == [
        (0, SectionRef(0, FORWARD), SectionRef(1, FORWARD), "F", (CutVar(cut, (-1, 256), "float32", True),)),
        (1, SectionRef(1, BACKWARD), SectionRef(0, BACKWARD), "B",
         (CutVar(grad, (-1, 256), "float32", True),)),
    ]
    assert [(st.sections[FORWARD].send_routes, st.sections[FORWARD].recv_routes,
             st.sections[BACKWARD].send_routes, st.sections[BACKWARD].recv_routes) for st in plan.stages] == [
        ((0,), (), (), (1,)), ((), (0,), (1,), ())]
    assert [r.vars[0].describe(mbs) for r in plan.routes] == [
        f"{cut} [{mb}, 256] float32", f"{grad} [{mb}, 256] float32"]
    # the printed sections show the comm ops
    text0, text1 = str(s0.sections[FORWARD]), str(s1.sections[FORWARD])
    assert text0.startswith("# stage 0 forward section\n") and "send_v2" in text0 and "recv_v2" not in text0
    assert text1.startswith("# stage 1 forward section\n") and "recv_v2" in text1 and "send_v2" not in text1
    assert f"{{Out=['{cut}']}} = recv_v2(" in text1
    lines = str(plan).splitlines()
    assert f"    {cut} [{mb}, 256] float32".ljust(48) + " stage 0 forward -> stage 1 forward" in lines
    assert f"    {grad} [{mb}, 256] float32".ljust(48) + " stage 1 backward -> stage 0 backward" in lines


# str.format fields: the loss, each stage's parameters and the cut variable's and its gradient's description
PLAN2_TEXT = """\
Plan: 2 stages, 4 micro-batches, schedule F-then-B, loss {loss}
  stage 0 on gpu:0: forward 9 ops, backward 15 ops, optimize 12 ops
    parameters: {params0}
    data fed here: features
  stage 1 on gpu:1: forward 7 ops, backward 12 ops, optimize 8 ops
    parameters: {params1}
    data fed here: label
  cut variables:
    {forward:<44} stage 0 forward -> stage 1 forward
    {backward:<44} stage 1 backward -> stage 0 backward
  predicted memory (parameters + optimizer state + gradients, activations kept F -> B x in flight):
    stage 0: 579.0 KiB + 579.0 KiB + 1.1 MiB, activations 6400 B/sample (+0 B) x 4
    stage 1: 267.0 KiB + 267.0 KiB + 534.1 KiB, activations 3164 B/sample (+0 B) x 4
  actions (F-then-B):
    rank 0 (gpu:0): 0F0 0SEND_F0>1 0F1 0SEND_F1>1 0F2 0SEND_F2>1 0F3 0SEND_F3>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 \
0RECV_B2<1 0B2 0RECV_B3<1 0B3 0OPT
    rank 1 (gpu:1): 1RECV_F0<0 1F0 1RECV_F1<0 1F1 1RECV_F2<0 1F2 1RECV_F3<0 1F3 1B0 1SEND_B0>0 1B1 1SEND_B1>0 \
1B2 1SEND_B2>0 1B3 1SEND_B3>0 1OPT"""


def test_printed_plan_exact():
    """The memory lines by hand (float32, Momentum): stage 0 holds fc 64->256->256->256, (16384 + 65536 x 2 +
    768) x 4 B = 579.0 KiB of parameters, as much velocity (+ the 4 B learning rate), twice that in gradient
    buffers; its forward keeps the features and each layer's matmul and ReLU outputs, (64 + 6 x 256) x 4 B =
    6400 B a sample. Stage 1 (256->256->10): 267.0 KiB; it keeps the received ReLU output, the matmul and
    ReLU outputs of its first layer, the last matmul's output (778 floats), the label (int64), the softmax
    (10) and the per-sample loss: 3164 B. F-then-B holds all 4 micro-batches."""
    net = build(mlp(MLP2), pipeline=dict(num_microbatches=4, schedule="FThenB"))
    layers = dense_layers(net.main)  # (weight, bias) of the 5 fc layers
    cut = op_vars(net.main, "relu", "Out")[2]  # the third layer's ReLU output, the last on stage 0
    text = PLAN2_TEXT.format(loss=net.loss.name,
                             params0=", ".join(name for layer in layers[:3] for name in layer),
                             params1=", ".join(name for layer in layers[3:] for name in layer),
                             forward=f"{cut} [mb, 256] float32", backward=f"{cut}@GRAD [mb, 256] float32")
    assert str(net.plan) == text
    assert staticpipe.plan_of(net.main) is net.opt.plan


def test_printed_plan_with_micro_batch_size():
    net = build(mlp(MLP3), pipeline=dict(num_microbatches=2, micro_batch_size=8))
    lines = str(net.plan).splitlines()
    assert lines[0] == f"Plan: 3 stages, 2 micro-batches of 8, schedule 1F1B, loss {net.loss.name}"
    relu = op_vars(net.main, "relu", "Out")  # relu[1] leaves stage 0, relu[2] stage 1
    start = lines.index("  cut variables:")
    assert lines[start + 1:start + 6] == [
        f"    {relu[1] + ' [8, 256] float32':<44} stage 0 forward -> stage 1 forward",
        f"    {relu[2] + ' [8, 256] float32':<44} stage 1 forward -> stage 2 forward",
        f"    {relu[2] + '@GRAD [8, 256] float32':<44} stage 2 backward -> stage 1 backward",
        f"    {relu[1] + '@GRAD [8, 256] float32':<44} stage 1 backward -> stage 0 backward",
        "  predicted memory (parameters + optimizer state + gradients, activations kept F -> B x in flight):",
    ]
    # at b = 8 (see test_printed_plan_exact): stage 0 keeps (64 + 4 x 256) x 4 B x 8 = 34.0 KiB a micro-batch,
    # stage 1 (256 + 2 x 256) x 4 x 8 = 24.0 KiB, stage 2 3164 x 8 B; 1F1B holds 2, 2 and 1 of them
    assert lines[start + 6:start + 12] == [
        "    stage 0: 322.0 KiB + 322.0 KiB + 644.0 KiB, activations 34.0 KiB/micro-batch x 2 = 68.0 KiB",
        "    stage 1: 257.0 KiB + 257.0 KiB + 514.0 KiB, activations 24.0 KiB/micro-batch x 2 = 48.0 KiB",
        "    stage 2: 267.0 KiB + 267.0 KiB + 534.1 KiB, activations 24.7 KiB/micro-batch x 1 = 24.7 KiB",
        "    device gpu:0: 1.3 MiB at peak (1.3 MiB + 68.0 KiB activations)",
        "    device gpu:1: 1.1 MiB at peak (1.0 MiB + 48.0 KiB activations)",
        "    device gpu:2: 1.1 MiB at peak (1.0 MiB + 24.7 KiB activations)",
    ]


# ============================================================================= data variables

def test_label_is_fed_to_the_last_stage_only():
    net = build(mlp(MLP3), pipeline=dict(num_microbatches=2))
    plan = net.plan
    assert plan.data_vars == {"features": (0,), "label": (2,)}
    assert plan.data_specs == {"features": ((-1, 64), "float32"), "label": ((-1, 1), "int64")}
    assert [st.sections[FORWARD].feeds for st in plan.stages] == [("features",), (), ("label",)]
    carried = [v.name for r in plan.routes for v in r.vars]
    relu = op_vars(net.main, "relu", "Out")  # relu[1] leaves stage 0, relu[2] stage 1
    assert carried == [relu[1], relu[2], relu[2] + "@GRAD", relu[1] + "@GRAD"]
    assert [line for line in str(plan).splitlines() if "data fed here" in line] == [
        "    data fed here: features", "    data fed here: -", "    data fed here: label"]


def data_on_stages_0_and_2():
    x = paddle.static.data("x", [None, 4], "float32")
    y = paddle.static.data("y", [None, 3], "float32")
    with dg("gpu:0"):
        a = fc(x, 5)
    with dg("gpu:1"):
        b = fc(a, 6, activation="relu")
    with dg("gpu:2"):
        c = paddle.add(fc(b, 3), fc(x, 3))
        return paddle.mean(paddle.square(paddle.subtract(c, y)))


def test_data_read_on_two_stages_is_fed_to_both_not_relayed():
    net = build(data_on_stages_0_and_2, pipeline=dict(num_microbatches=4))
    plan = net.plan
    a = op_vars(net.main, "elementwise_add", "Out")[0]  # the first fc layer's output (stage 0)
    b = op_vars(net.main, "relu", "Out")[0]  # the second's, after its ReLU (stage 1)
    assert plan.data_vars == {"x": (0, 2), "y": (2,)}
    assert [st.sections[FORWARD].feeds for st in plan.stages] == [("x",), (), ("x", "y")]
    assert [(r.src, r.dst, [v.name for v in r.vars]) for r in plan.routes] == [
        (SectionRef(0, FORWARD), SectionRef(1, FORWARD), [a]),
        (SectionRef(1, FORWARD), SectionRef(2, FORWARD), [b]),
        (SectionRef(2, BACKWARD), SectionRef(1, BACKWARD), [b + "@GRAD"]),
        (SectionRef(1, BACKWARD), SectionRef(0, BACKWARD), [a + "@GRAD"]),
    ]
    # stage 1 never sees x
    for sec in plan.stages[1].sections.values():
        assert not sec.program.global_block().has_var("x")
    # stages that read x in their backward keep the fed value
    assert "x" in plan.stages[0].sections[FORWARD].keep and "x" in plan.stages[2].sections[FORWARD].keep


def skip_activation():
    x = paddle.static.data("x", [None, 4], "float32")
    with dg("gpu:0"):
        a = fc(x, 5)
    with dg("gpu:1"):
        b = fc(a, 5, activation="relu")
    with dg("gpu:2"):
        return paddle.mean(fc(paddle.add(b, a), 3))


def test_skip_activation_gets_its_own_route_and_lowering():
    net = build(skip_activation, pipeline=dict(num_microbatches=2))
    plan = net.plan
    a = op_vars(net.main, "elementwise_add", "Out")[0]  # the first fc layer's output (stage 0), skipping stage 1
    b = op_vars(net.main, "relu", "Out")[0]  # the second's, after its ReLU (stage 1)
    assert [(r.index, str(r.src), str(r.dst), [v.name for v in r.vars]) for r in plan.routes] == [
        (0, "stage 0 forward", "stage 1 forward", [a]),
        (1, "stage 0 forward", "stage 2 forward", [a]),
        (2, "stage 1 forward", "stage 2 forward", [b]),
        (3, "stage 2 backward", "stage 1 backward", [b + "@GRAD", a + "@GRAD@RENAME@block0@0"]),
        (4, "stage 1 backward", "stage 0 backward", [a + "@GRAD"]),
    ]
    assert " ".join(map(str, plan.actions[2])) == (
        "2RECV_F0<0 2RECV_F0<1 2F0 2B0 2SEND_B0>1 2RECV_F1<0 2RECV_F1<1 2F1 2B1 2SEND_B1>1 2OPT")
    assert [op.output("Out") for op in ops(plan.stages[2].sections[FORWARD])[:2]] == [[a], [b]]


# ============================================================================= gradient accumulation

@pytest.mark.parametrize("m, value", [(4, 0.25), (1, 1.0), (2, 0.5), (8, 0.125)])
def test_loss_gradient_is_scaled_by_one_over_m(m, value):
    net = build(mlp(MLP2), pipeline=dict(num_microbatches=m))
    plan, loss_grad = net.plan, net.loss.name + "@GRAD"
    fills = [op for st in plan.stages for op in ops(st.sections[BACKWARD])
             if op.type == "fill_constant" and op.attr("op_role") == 257]
    assert [(op.output("Out"), op.attr("value")) for op in fills] == [([loss_grad], value)]
    first = ops(plan.stages[1].sections[BACKWARD])[0]  # the last stage's backward starts with it
    assert (first.type, first.output("Out"), first.attr("value")) == ("fill_constant", [loss_grad], value)


def test_gradients_merge_into_buffers_that_the_optimizer_reads():
    net = build(mlp(MLP2), pipeline=dict(num_microbatches=4))
    plan, layers = net.plan, dense_layers(net.main)  # (weight, bias) of the 5 fc layers
    # each stage's parameters, bias before weight layer by layer (the order Paddle's optimizer updates them in)
    expected = [[name for weight, bias in layers[:3] for name in (bias, weight)],
                [name for weight, bias in layers[3:] for name in (bias, weight)]]
    for st, params in zip(plan.stages, expected):
        # one buffer per parameter of the stage; the order is the rewrite's, the ops below follow it
        assert sorted(st.grad_buffers) == [p + "@GRAD" + MERGED_SUFFIX for p in params]
        merged = list(st.grad_buffers)
        grads = [m[:-len(MERGED_SUFFIX)] for m in merged]
        # backward: the copied ops, then one accumulation per gradient, then the sends
        bwd = [op for op in ops(st.sections[BACKWARD]) if op.type != "send_v2"]
        adds = bwd[-len(grads):]
        assert [(op.type, op.input("X"), op.output("Out"), op.attr("op_role")) for op in adds] == [
            ("sum", [m, g], [m], 1) for g, m in zip(grads, merged)]
        assert not any(op.type == "sum" and op.output("Out")[0].endswith(MERGED_SUFFIX)
                       for op in bwd[:-len(grads)])
        assert all(op.type != "send_v2" for op in ops(st.sections[BACKWARD])[:len(bwd)])
        block = st.sections[BACKWARD].program.global_block()
        assert all(block.var(m).persistable and block.var(g).persistable for g, m in zip(grads, merged))
        # optimize: momentum reads the merged gradient, then every buffer is reset to zero
        opt = ops(st.sections[OPTIMIZE])
        assert [(op.type, op.input("Param"), op.input("Grad")) for op in opt[:len(params)]] == [
            ("momentum", [p], [p + "@GRAD" + MERGED_SUFFIX]) for p in params]
        assert not any(name.endswith("@GRAD") for op in opt for name in op.input_arg_names)
        assert [(op.type, op.output("Out"), op.attr("value"), list(op.attr("shape"))) for op in opt[len(params):]] == [
            ("fill_constant", [m], 0.0, list(block.var(g).shape)) for g, m in zip(grads, merged)]
        # init: zero-fill once
        assert [(op.type, op.output("Out"), op.attr("value")) for op in ops(st.sections[INIT])] == [
            ("fill_constant", [m], 0.0) for m in merged]
        # the raw gradients are per-micro-batch scratch, not stage state
        assert not any(g in st.persistables for g in grads)


def test_learning_rate_ops_run_on_every_stage():
    net = build(mlp(MLP3, hidden=8), minimize=False)
    with paddle.static.program_guard(net.main, net.startup), paddle.utils.unique_name.guard("lr"):
        momentum().minimize(net.loss)
        with net.main._lr_schedule_guard():
            step = paddle.static.create_global_var([1], 0.0, "float32", persistable=True, name="step")
            paddle.increment(step)
    plan = build_plan(net.main, net.loss.name, 2)
    for st in plan.stages:
        assert [t for t in types(st.sections[OPTIMIZE]) if t != "momentum"] == (
            ["increment"] + ["fill_constant"] * len(st.grad_buffers))
    assert plan.stage_of_var("step") == [0, 1, 2]
    assert_every_op_in_one_section(net.main, plan, num_lr_ops=1)


# ============================================================================= op accounting

def _signature(op, strip_merged=False):
    def clean(names):
        return tuple(n[:-len(MERGED_SUFFIX)] if strip_merged and n.endswith(MERGED_SUFFIX) else n for n in names)
    return (op.type, clean(op.input_arg_names), clean(op.output_arg_names))


def _is_added(op, kind):
    out = op.output_arg_names
    merged = bool(out) and out[0].endswith(MERGED_SUFFIX)
    if kind == BACKWARD:
        return op.type == "sum" and merged
    if kind in (OPTIMIZE, INIT):
        return op.type == "fill_constant" and merged
    return False


def assert_every_op_in_one_section(main, plan, num_lr_ops=0):
    original = list(main.global_block().ops)
    copied, added = Counter(), 0
    for st in plan.stages:
        for kind, sec in st.sections.items():
            for op in ops(sec):
                if op.type in ("send_v2", "recv_v2"):
                    continue
                if _is_added(op, kind):
                    added += 1
                    continue
                assert kind != INIT, op.type
                copied[_signature(op, strip_merged=kind == OPTIMIZE)] += 1
    lr_sigs = Counter(_signature(op) for op in original if op.attr("op_role") & 16)
    assert sum(lr_sigs.values()) == num_lr_ops
    want = Counter(_signature(op) for op in original)
    for sig, n in lr_sigs.items():
        want[sig] += n * (plan.num_stages - 1)
    assert copied == want
    compute = sum(st.sections[k].num_compute_ops for st in plan.stages for k in (FORWARD, BACKWARD, OPTIMIZE))
    num_buffers = sum(len(st.grad_buffers) for st in plan.stages)
    assert added == 3 * num_buffers  # one accumulation, one reset and one init fill per buffer
    assert compute - 2 * num_buffers == len(original) + num_lr_ops * (plan.num_stages - 1)


@pytest.mark.parametrize("body", [mlp(MLP2), mlp(MLP3), data_on_stages_0_and_2, skip_activation, producer_rule,
                                  consumer_rule, two_stages_reversed],
                         ids=["mlp2", "mlp3", "data-0-2", "skip", "producer", "consumer", "reversed"])
def test_every_op_lands_in_exactly_one_section(body):
    net = build(body, pipeline=dict(num_microbatches=2))
    assert_every_op_in_one_section(net.main, net.plan)


# ============================================================================= the reference stays intact

def _snapshot(program):
    block = program.global_block()
    return ([(op.type, op.input_arg_names, op.output_arg_names,
              {n: str(op.attr(n)) for n in op.attr_names if n != "op_callstack"}) for op in block.ops],
            sorted((v.name, tuple(v.shape), str(v.dtype), v.persistable) for v in block.vars.values()),
            program.desc.serialize_to_string())


@pytest.mark.parametrize("body", [mlp(MLP2), skip_activation, producer_rule], ids=["mlp2", "skip", "producer"])
def test_rewrite_leaves_the_main_program_unchanged(body):
    net = build(body)
    before = _snapshot(net.main)
    plan = build_plan(net.main, net.loss.name, 4, "1F1B", 8)
    assert plan.num_stages >= 2
    after = _snapshot(net.main)
    assert after[0] == before[0]
    assert after[1] == before[1]
    assert after[2] == before[2]
    assert not any(op.type in ("send_v2", "recv_v2") for op in net.main.global_block().ops)


# ============================================================================= known bugs

def guarded_two_stages():
    x = paddle.static.data("x", [None, 4], "float32")
    with dg("gpu:0"):
        a = fc(x, 4)
    with dg("gpu:1"):
        return paddle.mean(fc(a, 4))


def test_minimize_inside_a_device_guard_keeps_stage_devices():
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        x = paddle.static.data("x", [None, 4], "float32")
        with dg("gpu:0"):
            a = fc(x, 4)
        with dg("gpu:1"):
            loss = paddle.mean(fc(a, 4))
            opt = staticpipe.PipelineOptimizer(momentum(), num_microbatches=2)
            opt.minimize(loss)  # called inside the last stage's guard
    stage0 = opt.plan.stages[0]
    tags = {(kind, op.type, op.attr("op_device")) for kind, sec in stage0.sections.items() for op in ops(sec)}
    assert {dev for _, _, dev in tags} == {"gpu:0"}, sorted(tags)


@pytest.mark.parametrize("clip, op_type", [(lambda: paddle.nn.ClipGradByNorm(1.0), "clip_by_norm"),
                                           (lambda: paddle.nn.ClipGradByValue(1.0), "clip")],
                         ids=["by-norm", "by-value"])
def test_per_parameter_gradient_clipping_is_planned(clip, op_type):
    # per-parameter clipping acts once per step on the merged gradient (once a bug: param_grads took the
    # clipped name from the last op_role_var pair, so the raw @GRAD was never merged and the clip rejected)
    net = build(guarded_two_stages, optimizer=lambda: paddle.optimizer.Momentum(0.1, momentum=0.9, grad_clip=clip()))
    plan = build_plan(net.main, net.loss.name, 2)
    layers = dense_layers(net.main)  # (weight, bias) of each stage's fc layer
    for st in plan.stages:
        weight, bias = layers[st.index]
        params = [bias, weight]
        assert sorted(st.grad_buffers) == [p + "@GRAD@MERGED" for p in params]
        opt = ops(st.sections[OPTIMIZE])
        clips = [op for op in opt if op.type == op_type]
        assert [op.input("X") for op in clips] == [[p + "@GRAD@MERGED"] for p in params]
        steps = [op for op in opt if op.type == "momentum"]
        assert [(op.input("Param"), op.input("Grad")) for op in steps] == [
            ([p], c.output("Out")) for p, c in zip(params, clips)]
        assert [op.output("Out")[0] for op in opt if op.type == "fill_constant"] == list(st.grad_buffers)

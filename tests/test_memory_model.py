"""The plan's memory model (``memory_model.py``, ``rewrite/memory.py``) against what a run holds.

Activations: the runtime counts the bytes each forward keeps for its backward, per stage and per device
(``Executor.memory_stats``, ``device_memory_stats``); the model must predict both exactly, for every
schedule (a device of a V or an interleaved layout holds two stages whose peaks need not meet), with
recompute, and on PIR programs. Parameters, optimizer state and gradient buffers: the bytes the stage's
variables hold in its device's scope after a step.
"""
from __future__ import annotations

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import minimize
from staticpipe._paddle import PADDLE_MAJOR, paddle
from staticpipe.ir import tensor_bytes
from staticpipe.memory_model import human_bytes
from staticpipe.schedule.registry import KINDS
from test_schedules_train import LAYOUTS

MICRO = 4


def trained(devices, schedule="1F1B", recompute=False, optimizer=None, steps=2, microbatches=None):
    """An MLP on ``devices`` (in 8, hidden 16, 6 layers), pipelined and trained ``steps`` steps."""
    m = microbatches or (8 if schedule in ("Eager1F1B", "DualPipeV") else 4)
    net = build_mlp(num_stages=len(devices), stage_devices=devices, in_dim=8, hidden=16, depth=6)
    opt = minimize(net, optimizer or paddle.optimizer.Adam(0.01),
                   dict(num_microbatches=m, schedule=schedule, recompute=recompute, micro_batch_size=MICRO))
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(net.startup)
    for k in range(steps):
        exe.run(net.main, feed=net.random_batch(MICRO * m, seed=k), fetch_list=[net.loss])
    return net, opt.plan, exe


def test_every_schedule_is_in_the_grid():
    assert set(LAYOUTS) == set(KINDS)


@pytest.mark.parametrize("schedule", sorted(LAYOUTS))
def test_activation_peaks_per_stage_and_device_are_predicted_exactly(schedule):
    net, plan, exe = trained(LAYOUTS[schedule], schedule)
    model = plan.memory
    measured = exe.memory_stats()
    assert {st.stage: st.activation_peak(MICRO) for st in model.stages} == \
        {s: m["peak_activation_bytes"] for s, m in measured.items()}
    assert {st.stage: st.peak_inflight for st in model.stages} == \
        {s: m["peak_inflight_microbatches"] for s, m in measured.items()}
    by_device = exe.device_memory_stats()
    assert {d.device: d.activation_bytes for d in model.devices(MICRO)} == \
        {dev: m["peak_activation_bytes"] for dev, m in by_device.items()}
    exe.close()


def test_a_v_devices_peak_is_below_the_sum_of_its_stages_peaks():
    """ZB-V on 2 devices: rank 1 holds stages 1 and 2, whose peaks come at different times."""
    net, plan, exe = trained(LAYOUTS["ZB-V"], "ZB-V")
    device1 = plan.memory.devices(MICRO)[1]
    stages = [plan.memory.stages[s] for s in plan.memory.stages_of(1)]
    assert [st.stage for st in stages] == [1, 2]
    assert device1.activation_bytes < sum(st.activation_peak(MICRO) for st in stages)
    assert device1.activation_bytes == exe.device_memory_stats()["gpu:1"]["peak_activation_bytes"]
    exe.close()


def test_recompute_keeps_only_the_inputs_and_is_predicted():
    _, plain, exe = trained(["gpu:0", "gpu:1"])
    exe.close()
    _, recomputed, exe = trained(["gpu:0", "gpu:1"], recompute=True)
    for before, after in zip(plain.memory.stages, recomputed.memory.stages):
        assert after.kept_bytes(MICRO) < before.kept_bytes(MICRO)
        assert after.static_bytes == before.static_bytes
    assert [st.activation_peak(MICRO) for st in recomputed.memory.stages] == \
        [m["peak_activation_bytes"] for m in exe.memory_stats().values()]
    exe.close()


@pytest.mark.parametrize("optimizer", ["SGD", "Momentum", "Adam"])
def test_parameters_state_and_gradients_are_the_bytes_the_device_holds(optimizer):
    make = {"SGD": lambda: paddle.optimizer.SGD(0.1), "Momentum": lambda: paddle.optimizer.Momentum(0.1, 0.9),
            "Adam": lambda: paddle.optimizer.Adam(0.01)}[optimizer]
    net, plan, exe = trained(["gpu:0", "gpu:1"], optimizer=make())
    for stage, predicted in zip(plan.stages, plan.memory.stages):
        scope = exe.scope_of(stage.device)
        params = sum(tensor_bytes(scope, n) for n in stage.parameters)
        grads = sum(tensor_bytes(scope, n) + tensor_bytes(scope, n[:-len("@MERGED")]) for n in stage.grad_buffers)
        state = sum(tensor_bytes(scope, n) for n in stage.persistables) - params - sum(
            tensor_bytes(scope, n) for n in stage.grad_buffers)
        assert (predicted.parameter_bytes, predicted.gradient_bytes, predicted.state_bytes) == (params, grads, state)
        assert predicted.state_bytes > 0  # at least the learning rate
    exe.close()


def test_print_plan_states_the_prediction():
    net, plan, exe = trained(["gpu:0", "gpu:1"])
    exe.close()
    text = str(plan)
    head = "  predicted memory (parameters + optimizer state + gradients, activations kept F -> B x in flight):"
    assert head in text
    for st in plan.memory.stages:
        assert (f"    stage {st.stage}: {human_bytes(st.parameter_bytes)} + {human_bytes(st.state_bytes)} + "
                f"{human_bytes(st.gradient_bytes)}, activations {human_bytes(st.kept_bytes(MICRO))}/micro-batch x "
                f"{st.peak_inflight} = {human_bytes(st.activation_peak(MICRO))}") in text
    for d in plan.memory.devices(MICRO):
        assert (f"    device {d.device}: {human_bytes(d.total)} at peak ({human_bytes(d.static_bytes)} + "
                f"{human_bytes(d.activation_bytes)} activations)") in text


def test_the_model_survives_a_saved_plan(tmp_path):
    net, plan, exe = trained(["gpu:0", "gpu:1"], steps=0)
    exe.close()
    staticpipe.save_plan(net.main, str(tmp_path / "plan"), net.startup)
    main, _ = staticpipe.load_plan(str(tmp_path / "plan"))
    assert staticpipe.plan_of(main).memory == plan.memory


@pytest.mark.skipif(PADDLE_MAJOR < 3, reason="PIR is Paddle 3's program IR")
def test_pir_programs_are_predicted_too():
    with paddle.pir_utils.IrGuard():
        net, plan, exe = trained(["gpu:0", "gpu:1", "gpu:1", "gpu:0"], "ZB-V")
        assert [st.activation_peak(MICRO) for st in plan.memory.stages] == \
            [m["peak_activation_bytes"] for m in exe.memory_stats().values()]
        assert [d.activation_bytes for d in plan.memory.devices(MICRO)] == \
            [m["peak_activation_bytes"] for m in exe.device_memory_stats().values()]
        exe.close()

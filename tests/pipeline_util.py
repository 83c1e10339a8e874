"""Shared by the runtime tests: train a pipelined network and its unguarded twin side by side."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Callable

import pytest

import staticpipe
from staticpipe import capabilities
from staticpipe._paddle import np, paddle
from staticpipe.ir import is_pir_program

# Tests that run bfloat16 kernels on CPU stages: they need a CPU (and oneDNN cap) with bfloat16 matmuls,
# which the process's probe decides (staticpipe.capabilities); elsewhere they skip, saying why.
needs_cpu_bf16 = pytest.mark.skipif(not capabilities.cpu_bf16().ok,
                                    reason="this CPU cannot run bfloat16 through Paddle's oneDNN (probe: "
                                           f"{capabilities.cpu_bf16().reason}); see staticpipe.capabilities")


@dataclass
class Twin:
    ref_losses: list[float]
    pipe_losses: list[float]
    ref_params: dict[str, np.ndarray]
    pipe_params: dict[str, np.ndarray]
    plan: staticpipe.Plan | None = None  # the pipeline's
    # per step, parameter -> squared L2 norm of its pre-clip gradient in the reference (global-norm clip only)
    ref_grad_squares: list[dict[str, float]] = field(default_factory=list)
    # per parameter, the reference's own rounding noise (train_twins(noise=True)): the largest difference
    # between the reference and the same training with another, equivalent reduction order
    ref_noise: dict[str, np.ndarray] | None = None


LEGACY_ONLY = {  # tests that train twins on the legacy IR only -> why they cannot run on a PIR program
    "test_adam_family_equals_single_device_up_to_its_own_rounding_noise":
        "its rounding-noise reference is Paddle's gradient merge, which builds legacy programs only",
    "test_tied_embedding_with_active_global_norm_clipping_where_every_stage_owns_parameters":
        "it reads the clip's per-parameter norms from the reference's legacy ops (squared_l2_norm)",
    "test_gpt_tied_embedding_adamw_clipping_over_four_stages":
        "AMP: Paddle 3.3.1 trains no PIR AMP program on a CPU (docs/pir.md)",
    "test_gpt_parity_fails_when_stages_clip_by_their_local_norm":
        "it reads the clip's norms from the reference's legacy ops, and its noise reference is gradient merge",
    "test_tied_embedding_parity_fails_when_stages_clip_by_their_local_norm":
        "it reads the clip's per-parameter norms from the reference's legacy ops (squared_l2_norm)",
    "test_adam_family_check_fails_on_a_wrong_tensor":
        "its twin (the adam_twin fixture) measures rounding noise with Paddle's gradient merge, legacy only",
}
current_test: tuple[str, bool] | None = None  # (the running test, whether it takes program_ir): conftest.py


def check_ir_coverage() -> None:
    """A test training twins runs on both IRs (``program_ir``) or says in ``LEGACY_ONLY`` why not."""
    if current_test is not None and not current_test[1] and current_test[0] not in LEGACY_ONLY:
        raise AssertionError(f"{current_test[0]} trains a pipeline against one device on one IR only: take the "
                             "program_ir fixture (conftest.py), or list the test in pipeline_util.LEGACY_ONLY with "
                             "the reason it cannot run on PIR")


def minimize(net, optimizer, pipeline: dict | None):
    """Apply ``optimizer`` (wrapped in a PipelineOptimizer when ``pipeline`` gives its options); fresh
    unique names, so that twins built in one process name their optimizer state alike."""
    with paddle.static.program_guard(net.main, net.startup), paddle.utils.unique_name.guard():
        if pipeline is not None:
            optimizer = staticpipe.PipelineOptimizer(optimizer, **pipeline)
        optimizer.minimize(net.loss)
    return optimizer


def clip_norm_squares(program) -> dict[str, str]:
    """Parameter -> the variable holding the squared L2 norm of its gradient that Paddle's
    ``ClipGradByGlobalNorm`` computes in a single-device ``program`` (before it scales the gradients in
    place); empty when the program has no global-norm clip, or is a PIR program (whose values have no
    names to fetch them by)."""
    if is_pir_program(program):
        return {}
    return {op.input("X")[0].split("@GRAD")[0]: op.output("Out")[0]
            for op in program.global_block().ops if op.type == "squared_l2_norm"}


def _clip_global_norm(program, squares: dict[str, str]) -> list[str]:
    """[the name of the clip's global norm, sqrt(sum of the squared norms)] in ``program``, or []."""
    block = program.global_block()
    total = [op.output("Out")[0] for op in block.ops if op.type == "sum" and set(op.input("X")) == set(squares.values())]
    return [op.output("Out")[0] for op in block.ops if op.type == "sqrt" and op.input("X") == total][:1]


def run_reference(program, scope, exe, batch: dict, fetch: list, microbatches: int = 1) -> list[np.ndarray]:
    """One single-device step of ``program``: the whole batch in one run, or ``microbatches`` runs of
    consecutive slices (for a program minimized by a GradientMergeOptimizer); returns the fetched
    values (of each run, averaged over the runs)."""
    size = len(next(iter(batch.values()))) // microbatches
    with paddle.static.scope_guard(scope):  # PIR's executor keeps a scheduled learning rate in the global scope
        runs = [exe.run(program, feed={k: v[m * size:(m + 1) * size] for k, v in batch.items()}, fetch_list=fetch)
                for m in range(microbatches)]
    return [np.mean([np.asarray(r[i], np.float64) for r in runs], axis=0) for i in range(len(fetch))]


def train_reference(builder: Callable, make_opt: Callable, initial: dict[str, np.ndarray], batches: list[dict],
                    microbatches: int = 1, reverse: bool = False) -> dict[str, np.ndarray]:
    """Single-device training of ``builder(guarded=False)`` from ``initial`` on ``batches``, the whole
    batch at once, or as Paddle's gradient merge over ``microbatches`` runs (legacy programs: Paddle's
    gradient merge builds no PIR), optionally with every batch's samples in reverse order: the same
    training with another order of the float32 sums."""
    net = builder(guarded=False)
    with paddle.static.program_guard(net.main, net.startup), paddle.utils.unique_name.guard():
        opt = make_opt()
        if microbatches > 1:
            opt = paddle.incubate.optimizer.GradientMergeOptimizer(opt, k_steps=microbatches, avg=True)
        opt.minimize(net.loss)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        exe.run(net.startup)
    for name, value in initial.items():
        scope.find_var(name).get_tensor().set(value, paddle.CPUPlace())
    for batch in batches:
        if reverse:
            batch = {k: np.ascontiguousarray(v[::-1]) for k, v in batch.items()}
        run_reference(net.main, scope, exe, batch, [net.loss], microbatches)
        if hasattr(net.main, "lr_scheduler"):
            net.main.lr_scheduler.step()
    return {name: np.array(scope.find_var(name).get_tensor()) for name in initial}


def train_twins(builder: Callable, make_opt: Callable, steps: int = 3, batch_size: int = 16,
                same_batch: bool = False, noise: bool = False, reload: Callable | None = None, **pipeline) -> Twin:
    """Train ``builder(guarded=False)`` on one device and ``builder()`` as a pipeline (minimized here, unless
    the builder pipelined it itself) from the same initial parameters on the same batches (one batch per
    step, or the same one every step); return both runs' losses and final parameters, the pipeline's plan and, where the optimizer clips by global norm,
    the reference's pre-clip gradient norms of every step. ``noise``: also measure the reference's own
    rounding noise, training it twice more (gradient merge over the pipeline's micro-batches; the
    samples of every batch reversed). ``reload(main, startup)``: the programs the pipeline trains instead of
    the minimized ones (``staticpipe.load_plan`` of their saved plan), its loss fetched by name."""
    check_ir_coverage()
    ref, pipe = builder(guarded=False), builder()
    pir = paddle.framework.in_pir_mode()
    assert is_pir_program(ref.main) == is_pir_program(pipe.main) == pir, "the twins were built on another IR"
    if noise and pir:
        raise ValueError("train_twins(noise=True) measures rounding noise with Paddle's gradient merge, which "
                         "builds legacy programs only")
    minimize(ref, make_opt(), None)
    if staticpipe.plan_of(pipe.main) is None:  # else its builder pipelined it (auto_plan)
        minimize(pipe, make_opt(), pipeline)
    if reload is not None:
        pipe.main, pipe.startup = reload(pipe.main, pipe.startup)
        pipe.loss = staticpipe.plan_of(pipe.main).loss
    ref_exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):  # PIR's executor keeps a scheduled learning rate in the global scope
        ref_exe.run(ref.startup)
    names = parameter_names(ref.main)
    initial = {n: np.array(scope.find_var(n).get_tensor()) for n in names}
    exe = staticpipe.Executor()
    exe.run(pipe.startup)
    exe.set_state_dict(pipe.main, initial)
    squares = clip_norm_squares(ref.main)
    global_norm = _clip_global_norm(ref.main, squares) if squares else []
    fetch = [ref.loss, *squares.values(), *global_norm]
    ref_losses, pipe_losses, grad_squares, batches = [], [], [], []
    for step in range(steps):
        batch = ref.random_batch(batch_size, seed=0 if same_batch else step)
        batches.append(batch)
        with paddle.static.scope_guard(scope):
            loss, *norms = ref_exe.run(ref.main, feed=batch, fetch_list=fetch)
        ref_losses.append(float(loss))
        if squares:
            grad_squares.append({p: float(np.asarray(v).item()) for p, v in zip(squares, norms)})
        if global_norm:  # the squares are the clip's: they add up to the global norm Paddle clipped by
            total = math.sqrt(sum(grad_squares[-1].values()))
            assert math.isclose(total, float(np.asarray(norms[-1]).item()), rel_tol=1e-5), (total, norms[-1])
        pipe_losses.append(float(exe.run(pipe.main, feed=batch, fetch_list=[pipe.loss])[0]))
        for program in (ref.main, pipe.main):  # learning-rate schedules advance once per global step
            if hasattr(program, "lr_scheduler"):
                program.lr_scheduler.step()
    state = exe.state_dict(pipe.main)
    exe.close()
    twin = Twin(ref_losses, pipe_losses, {n: np.array(scope.find_var(n).get_tensor()) for n in names},
                {n: state[n] for n in names}, staticpipe.plan_of(pipe.main), grad_squares)
    if noise:
        merged = pipeline.get("num_microbatches", 1)
        others = [train_reference(builder, make_opt, initial, batches, microbatches=merged),
                  train_reference(builder, make_opt, initial, batches, reverse=True)]
        twin.ref_noise = {n: np.max([np.abs(o[n] - twin.ref_params[n]) for o in others], axis=0) for n in names}
    return twin


def parameter_names(program) -> list[str]:
    """The parameters of a legacy or PIR program, in the program's order."""
    return [p.name for p in program.global_block().all_parameters()]


def evaluation_net(net, builder: Callable, **build):
    """``net`` (built by ``builder(**build)``, not yet minimized) as an evaluation network: its program in
    test mode (dropout passes values through, batch norm reads its running statistics and leaves them).
    Legacy IR: ``net.main.clone(for_test=True)``, its variables fetched by name. A PIR program has no such
    clone: the network built again (the same parameter names) with each op's ``is_test`` attribute set."""
    if not is_pir_program(net.main):
        return replace(net, main=net.main.clone(for_test=True))
    again = builder(**build)
    for op in again.main.global_block().ops:
        if op.has_attr("is_test"):
            op.set_bool_attr("is_test", True)
    return again


def assert_same_training(twin: Twin, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(twin.pipe_losses, twin.ref_losses, rtol=rtol)
    assert twin.pipe_params.keys() == twin.ref_params.keys()
    for name, ref in twin.ref_params.items():
        np.testing.assert_allclose(twin.pipe_params[name], ref, rtol=rtol, atol=atol, err_msg=name)


# ----------------------------------------------------------------------- global-norm clipping

def clip_norms(grad_squares: dict[str, float], plan: staticpipe.Plan) -> tuple[float, list[float]]:
    """The global gradient norm of one step and each stage's local norm (of the parameters it owns)."""
    local = [math.sqrt(sum(grad_squares.get(p, 0.0) for p in stage.parameters)) for stage in plan.stages]
    return math.sqrt(sum(grad_squares.values())), local


def assert_clipping_matters(grad_squares: list[dict[str, float]], plan: staticpipe.Plan, clip: float) -> None:
    """The global-norm clip is active on every step (the reference's pre-clip global norm exceeds
    ``clip``), every stage owns parameters with gradients, and on every step each stage's local norm is
    far enough from the global one that a stage clipping by its local norm would scale its gradients by
    a factor at least 0.1 % off (clip / max(local, clip) against clip / global)."""
    assert grad_squares, "no gradient norms: the reference program has no ClipGradByGlobalNorm"
    owned = [p for stage in plan.stages for p in stage.parameters]
    assert sorted(owned) == sorted(grad_squares[0]), "every parameter with a gradient has exactly one owner"
    for step, squares in enumerate(grad_squares):
        total, local = clip_norms(squares, plan)
        assert total > clip, f"step {step}: pre-clip global norm {total:.4g} <= clip {clip}: clipping is inactive"
        for stage, norm in enumerate(local):
            assert norm > 0, f"step {step}: stage {stage} owns no parameter with a gradient"
            assert total / max(norm, clip) > 1.001, (
                f"step {step}: stage {stage}'s local norm {norm:.4g} clips like the global norm {total:.4g}")


# ----------------------------------------------------------------------- Adam-family parity

def adam_family_mismatches(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], noise: dict[str, np.ndarray],
                           rtol: float = 1e-5, atol: float = 1e-6, noise_factor: float = 2.0,
                           max_noisy: float = 0.01) -> list[str]:
    """Why ``got`` is not the reference's training up to rounding, per tensor (empty: it is).

    Adam divides each update by sqrt(v) + eps: where a coordinate's gradient is as small as float32
    rounding, the order of the sums alone moves it by up to the learning rate. ``noise`` measures that per
    coordinate (the reference against itself with another reduction order). A coordinate may differ from
    the reference by ``atol + rtol * |ref|`` plus ``noise_factor`` times its noise, and in no tensor may
    more than ``max_noisy`` of the coordinates differ beyond ``atol + rtol * |ref|``: a wrong tensor
    cannot hide among noisy coordinates, nor in a tensor whose every coordinate is noisy."""
    problems = []
    if ref.keys() != got.keys():
        return [f"parameters differ: {sorted(ref.keys() ^ got.keys())}"]
    for name, r in ref.items():
        g, n = got[name], noise[name]
        tight = atol + rtol * np.abs(r)
        diff = np.abs(g.astype(np.float64) - r)
        beyond = diff > tight + noise_factor * n
        if beyond.any():
            i = np.unravel_index(np.argmax(np.where(beyond, diff, -1)), r.shape)
            problems.append(f"{name}: {int(beyond.sum())} of {r.size} coordinates differ beyond the reference's "
                            f"own rounding noise; worst at {tuple(map(int, i))}: pipeline {g[i]:.8g}, reference "
                            f"{r[i]:.8g}, reference noise {n[i]:.3g}")
        noisy = int((diff > tight).sum())
        if noisy > max_noisy * r.size:
            problems.append(f"{name}: {noisy} of {r.size} coordinates differ beyond rtol {rtol:g}, atol {atol:g} "
                            f"(at most {max_noisy:.0%} may)")
    return problems


def assert_adam_family_training(twin: Twin) -> None:
    """Losses match to rtol 1e-5 and every parameter tensor matches the reference up to the reference's
    own rounding noise (``adam_family_mismatches``); needs ``train_twins(noise=True)``."""
    assert twin.ref_noise is not None, "train the twins with noise=True"
    np.testing.assert_allclose(twin.pipe_losses, twin.ref_losses, rtol=1e-5)
    problems = adam_family_mismatches(twin.ref_params, twin.pipe_params, twin.ref_noise)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ batch norm and dropout

def gradient_merge_twins(builder, make_opt, microbatches=4, steps=3, batch_size=16, evaluate=True, **pipeline):
    """The exact single-device reference for layers that see micro-batches (batch norm, dropout): the
    unsplit program trained with Paddle's GradientMergeOptimizer, one executor run per micro-batch, the
    update applied every ``microbatches`` runs with averaged gradients. This is also what Paddle's own
    pipeline computes: batch-norm statistics per micro-batch. Asserts that every parameter and state
    (running statistics included) matches after ``steps`` steps; returns the evaluation loss of the
    reference and of the pipeline on a fresh batch (None when not ``evaluate``) and the trained state."""
    ref, pipe = builder(guarded=False), builder()
    with paddle.static.program_guard(ref.main, ref.startup), paddle.utils.unique_name.guard():
        ref_test = ref.main.clone(for_test=True)
        paddle.incubate.optimizer.GradientMergeOptimizer(make_opt(), k_steps=microbatches, avg=True).minimize(ref.loss)
    pipe_test = pipe.main.clone(for_test=True)
    minimize(pipe, make_opt(), dict(num_microbatches=microbatches, **pipeline))
    ref_exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    ref_exe.run(ref.startup, scope=scope)
    exe = staticpipe.Executor()
    exe.run(pipe.startup)
    initial = exe.state_dict(pipe.main)
    exe.set_state_dict(pipe.main, {k: np.array(scope.find_var(k).get_tensor()) for k in initial})
    initial = exe.state_dict(pipe.main)
    for step in range(steps):
        batch = ref.random_batch(batch_size, seed=step)
        run_reference(ref.main, scope, ref_exe, batch, [], microbatches)
        exe.run(pipe.main, feed=batch)
    trained = exe.state_dict(pipe.main)
    assert any(not np.array_equal(trained[k], v) for k, v in initial.items())
    for name, value in trained.items():
        np.testing.assert_allclose(value, np.array(scope.find_var(name).get_tensor()), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    if not evaluate:
        exe.close()
        return None, None, trained
    batch = ref.random_batch(batch_size, seed=99)
    return (ref_exe.run(ref_test, feed=batch, fetch_list=[ref.loss.name], scope=scope)[0],
            exe.run(pipe_test, feed=batch, fetch_list=[pipe.loss.name])[0], trained)


# ------------------------------------------------------------ Paddle's generated names, looked up
# Tests never hard-code the names Paddle's unique-name generator makes (a layer's parameters, its
# temporaries, the learning rate): they follow the order of creation and change across Paddle versions.

def dense_layers(program) -> list[tuple[str, str]]:
    """(weight, bias) of each fully connected layer of ``program`` (``paddle.static.nn.fc``), in op order:
    the parameter a ``mul``/``matmul`` op multiplies by and the parameter added to its product."""
    block = program.global_block()
    params = set(parameter_names(program))
    layers = []
    for op in block.ops:
        if op.type in ("mul", "matmul", "matmul_v2") and op.input("Y")[0] in params:
            product = op.output("Out")[0]
            bias = next(o.input("Y")[0] for o in block.ops if o.type == "elementwise_add"
                        and o.input("X") == [product] and o.input("Y")[0] in params)
            layers.append((op.input("Y")[0], bias))
    return layers


def parameter_owners(program) -> list[str]:
    """The layers owning ``program``'s parameters, in creation order, each once: the part of a parameter's
    name before its last dot (Paddle names a layer's parameters ``<layer>.<kind>_<k>``). A PIR program lists
    its parameters newest first (each one's op is inserted at the start of the block)."""
    names = parameter_names(program)
    return list(dict.fromkeys(n.rsplit(".", 1)[0] for n in (names[::-1] if is_pir_program(program) else names)))


def op_vars(program, op_type: str, slot: str) -> list[str]:
    """The (first) variable in input or output ``slot`` of each ``op_type`` op of ``program``'s global
    block, in op order: ``op_vars(main, "relu", "Out")[1]`` is the second ReLU's output."""
    ops = [op for op in program.global_block().ops if op.type == op_type]
    return [(op.input(slot) if slot in op.input_names else op.output(slot))[0] for op in ops]


def learning_rate_var(program) -> str:
    """The variable ``program``'s optimizer ops read their learning rate from (there must be one)."""
    names = {op.input("LearningRate")[0] for op in program.global_block().ops if "LearningRate" in op.input_names}
    assert len(names) == 1, names
    return names.pop()


def launch_script(tmp_path, template: str, nprocs: int):
    """Write ``template`` (formatted with ``repo``, ``tests`` and ``out``: tmp_path) as a script and run it as
    a job of ``nprocs`` processes (``staticpipe.launch``; 1: plainly); fail with its stderr if it fails."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "train.py"
    script.write_text(template.format(repo=repo, tests=os.path.join(repo, "tests"), out=str(tmp_path)))
    launcher = ["-m", "staticpipe.launch", "--nprocs", str(nprocs)] if nprocs > 1 else []
    result = subprocess.run([sys.executable, *launcher, str(script)], capture_output=True, text=True, timeout=240,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def fc_chain(devices=("gpu:0", "gpu:1"), seed: int | None = None):
    """x [-1, 4] -> an fc of 4 under each device's guard -> cross entropy: (main, startup, loss); parameters
    fc_<k>.* on device k (fresh names). ``seed``: the startup program's random seed."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    if seed is not None:
        startup.random_seed = seed
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        with contextlib.ExitStack() as stack:
            x = paddle.static.data("x", [-1, 4], "float32")
            y = paddle.static.data("y", [-1, 1], "int64")
            h = x
            for device in devices:
                stack.enter_context(staticpipe.device_guard(device))
                h = paddle.static.nn.fc(h, 4)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(h, y))
    return main, startup, loss

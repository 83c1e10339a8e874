"""``Executor.close()`` gives back every scope and tensor the executor made.

Why a test of its own: Paddle keeps a scope made by ``core.Scope()`` in its process-wide scope pool until
the process exits, whatever Python drops, so an executor that only let go of its workers left its device
scopes (parameters, optimizer state, gradient buffers, micro-batch scopes), the startup program's host
scope and its plain scope allocated: 13-15 MB per executor of the 4-stage GPT, in a process that makes
executor after executor. Checked on the pool itself (every root scope made is removed from it) and on
Paddle's allocation counters (exact byte counts, not the process's resident memory, which is noisy).
"""
from __future__ import annotations

import gc
import re

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import minimize
from staticpipe._paddle import core, np, paddle

pytestmark = pytest.mark.timeout(120)


def allocated() -> int:
    """Bytes Paddle's allocators hold now: the host's, and every GPU's. Paddle counts per thread and forgets
    a thread's count when it ends, so bytes a stage thread allocated and ``close`` frees (after stopping it)
    make this fall below what it was: the check is that it does not grow."""
    total = core.host_memory_stat_current_value("Allocated", 0)
    if core.is_compiled_with_cuda():
        total += sum(core.device_memory_stat_current_value("Allocated", d) for d in range(core.get_cuda_device_count()))
    return total


def pipelined():
    net = build_mlp(num_stages=2)
    test = net.main.clone(for_test=True)  # runs as plain Paddle in the executor's own scope
    minimize(net, paddle.optimizer.Momentum(0.1, momentum=0.9), dict(num_microbatches=2))
    return net, test


def use_once(net, test, batch) -> staticpipe.Executor:
    """An executor through its whole life: startup, two steps, an evaluation clone, close."""
    exe = staticpipe.Executor()
    exe.run(net.startup)
    for _ in range(2):
        assert np.isfinite(exe.run(net.main, feed=batch, fetch_list=[net.loss])[0])
    assert np.isfinite(exe.run(test, feed=batch, fetch_list=[net.loss.name])[0])
    exe.close()
    return exe


def tracked(monkeypatch) -> tuple[list[int], list[int]]:
    """(addresses of the root scopes made from now on, addresses of those removed from Paddle's pool)."""
    made, removed = [], []
    make, remove = core.Scope, core._Scope._remove_from_pool

    def tracked_scope():
        scope = make()
        made.append(scope.raw_address())
        return scope

    def tracked_remove(scope):
        removed.append(scope.raw_address())
        remove(scope)

    monkeypatch.setattr(core, "Scope", tracked_scope)
    monkeypatch.setattr(paddle.static, "Scope", tracked_scope)
    monkeypatch.setattr(core._Scope, "_remove_from_pool", tracked_remove)
    return made, removed


def test_close_removes_every_root_scope_it_made_from_paddles_pool(monkeypatch):
    """The roots ``core.Scope()`` made for the executor (its devices', the startup program's host scope,
    its plain scope) are all out of Paddle's pool, that is deleted with everything under them, once it is
    closed; not one before (a scope still in use is never freed)."""
    made, removed = tracked(monkeypatch)
    net, test = pipelined()
    batch = net.random_batch(8, seed=0)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    host = made[1]  # the executor's plain scope is made first, then the host scope of the startup program
    assert removed == [host]  # its values copied to the stages, the host scope goes at once
    for _ in range(2):
        exe.run(net.main, feed=batch, fetch_list=[net.loss])
    exe.run(test, feed=batch, fetch_list=[net.loss.name])
    assert removed == [host]
    exe.close()
    assert len(made) == 4 and sorted(removed) == sorted(made)  # plain, host, gpu:0, gpu:1


def test_executor_after_executor_does_not_grow_paddles_allocations():
    net, test = pipelined()
    batch = net.random_batch(8, seed=0)
    use_once(net, test, batch)  # what Paddle makes once per process is not the executor's
    gc.collect()
    before = allocated()
    for _ in range(3):
        use_once(net, test, batch)
        gc.collect()
        assert allocated() <= before


def test_a_closed_executor_refuses_its_scopes_and_closes_once():
    net, test = pipelined()
    exe = use_once(net, test, net.random_batch(8, seed=0))
    exe.close()  # again: nothing left to free, nothing freed twice
    message = "this staticpipe.Executor was closed"
    for call in (lambda: exe.scope_of("gpu:0"), lambda: exe.state_dict(test), lambda: exe.set_state_dict(test, {})):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call()


def test_profile_verify_and_export_free_the_scopes_they_make(monkeypatch, tmp_path):
    """Each holds a whole model's values in a scope of its own for the length of the call."""
    plain = build_mlp(num_stages=1, guarded=False)
    net, _ = pipelined()
    batches = [net.random_batch(8, seed=k) for k in range(4)]
    exe = staticpipe.Executor()
    exe.run(net.startup)
    made, removed = tracked(monkeypatch)
    staticpipe.profile(plain.main, plain.random_batch(8), startup=plain.startup)
    assert len(made) == 1 and removed == made
    staticpipe.verify(net.main, batches, net.startup, steps=2)
    assert len(made) > 1 and sorted(removed) == sorted(made)  # its executor's and its reference run's
    count = len(made)
    staticpipe.export_inference(net.main, [net.feeds[0]], [net.loss], str(tmp_path / "model"), exe)
    assert len(made) == count + 1 and sorted(removed) == sorted(made)
    exe.close()


@pytest.mark.parametrize("schedule", ["1F1B", "ZB-H1"])
def test_a_released_micro_batch_scope_holds_no_memory(program_ir, schedule):
    """What a micro-batch leaves in a borrowed scope (its feeds, the values kept for a later section, the
    values received) is let go of when the scope goes back: the legacy runs' dense tensors emptied (the
    variable kept: Paddle re-creates an erased one on the next run, at a cost), everything else erased.
    Checked after each step on every scope waiting to be reused: none of those values holds memory, and
    the steps train what they trained when every value was erased (``test_schedules_train``)."""
    from staticpipe.ir import tensor_bytes
    from staticpipe.runtime.jobs import RankProgram

    net = build_mlp(num_stages=2)
    minimize(net, paddle.optimizer.Momentum(0.1, momentum=0.9), dict(num_microbatches=4, schedule=schedule))
    plan = staticpipe.plan_of(net.main)
    programs = [RankProgram.of(plan, r) for r in range(len(plan.ranks))]
    names = {n for p in programs for left in list(p.leftovers.values()) + list(p.optimize_leftovers.values())
             for n in left.tensors + left.others}
    emptied = {n for p in programs for left in p.leftovers.values() for n in left.tensors}
    assert emptied if program_ir == "legacy" else not emptied  # PIR sections' values are all erased
    exe = staticpipe.Executor(worker_threads=1)
    try:
        exe.run(net.startup)
        for step in range(3):
            exe.run(net.main, feed=net.random_batch(16, seed=step), fetch_list=[net.loss])
            pooled = [s for w in exe._devices.workers.values() for s in w._free]
            assert pooled and all(tensor_bytes(s, n) == 0 for s in pooled for n in names), step
    finally:
        exe.close()

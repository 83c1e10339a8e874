"""Fetch lists that change from step to step, and fetched data variables, on both IRs, against one device.

On PIR, a section's interpreter is built for the values it fetches; a second fetch list used to build a
second interpreter of the same program beside the first, and going back to the first crashed the process
(SIGSEGV) or failed every later step ("Unsupported setting dims for 'Unknown'"). A data variable (``x``)
could not be fetched at all ("it is not computed by the pipelined program"): its value is the batch fed.
"""
from __future__ import annotations

import contextlib

import pytest

import staticpipe
from staticpipe._paddle import PADDLE_MAJOR, np, paddle

FEATURES, CLASSES, BATCH = 6, 3, 8
SEQUENCE = [["loss"], ["logits"], ["loss", "logits"], ["loss"], ["h"], ["x", "loss"], ["logits", "x", "y"], ["loss"]]
IRS = ["legacy"] + (["pir"] if PADDLE_MAJOR >= 3 else [])


def build(pipelined: bool):
    main, startup, values = paddle.static.Program(), paddle.static.Program(), {}
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [None, FEATURES], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        with staticpipe.device_guard("gpu:0"):
            h = paddle.nn.functional.relu(paddle.static.nn.fc(x, 8))
        with staticpipe.device_guard("gpu:1"):
            logits = paddle.static.nn.fc(h, CLASSES)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, y))
        opt = paddle.optimizer.SGD(0.1)
        (staticpipe.PipelineOptimizer(opt, num_microbatches=4) if pipelined else opt).minimize(loss)
        values.update(x=x, y=y, h=h, logits=logits, loss=loss)
    return main, startup, values


@pytest.mark.parametrize("ir", IRS)
def test_changing_fetch_lists_and_fetched_feeds_equal_one_device(ir):
    with paddle.pir_utils.IrGuard() if ir == "pir" else contextlib.nullcontext():
        rng = np.random.default_rng(3)
        batches = [{"x": rng.standard_normal((BATCH, FEATURES)).astype("float32"),
                    "y": rng.integers(0, CLASSES, (BATCH, 1)).astype("int64")} for _ in SEQUENCE]
        main, startup, ref = build(False)
        scope, exe = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
        with paddle.static.scope_guard(scope):
            exe.run(startup)
            params = [p.name for p in main.global_block().all_parameters()]
            init = [np.array(scope.find_var(n).get_tensor()) for n in params]
            expected = [exe.run(main, feed=b, fetch_list=[ref[n] for n in names]) for b, names in zip(batches, SEQUENCE)]
        main, startup, values = build(True)
        pipe = staticpipe.Executor(paddle.CPUPlace())
        pipe.run(startup)
        # by position: PIR's unique_name.guard does not reset the fc layers' names
        pipe.set_state_dict(main, dict(zip([p.name for p in main.global_block().all_parameters()], init)))
        for step, (b, names, want) in enumerate(zip(batches, SEQUENCE, expected)):
            got = pipe.run(main, feed=b, fetch_list=[values[n] for n in names])
            for name, mine, theirs in zip(names, got, want):
                np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6, err_msg=f"step {step}, {name}")
            if "x" in names:
                assert np.array_equal(got[names.index("x")], b["x"])
        per_mb = pipe.run(main, feed=batches[0], fetch_list=[values["x"]], return_merged=False)[0]
        assert [m.shape for m in per_mb] == [(BATCH // 4, FEATURES)] * 4
        np.testing.assert_array_equal(np.concatenate(per_mb), batches[0]["x"])
        pipe.close()

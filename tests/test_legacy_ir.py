"""Paddle 3.x's legacy-IR mode (``staticpipe/legacy_ir.py``): PIR programs by default; the opt-in
(``STATICPIPE_LEGACY_IR=1``, ``staticpipe.use_legacy_ir()``) gives legacy programs whatever the import order;
every API staticpipe's users and Paddle's own clipping call builds legacy ops; dygraph and PIR untouched.

The boundary check (``test_every_api_we_rely_on_builds_legacy_ops``) is the one to read after a Paddle
upgrade: it names each API that a new release moved to C++ without a legacy path here."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import staticpipe
from staticpipe._paddle import PADDLE_MAJOR, np, paddle

pytestmark = pytest.mark.timeout(120)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PADDLE3 = pytest.mark.skipif(PADDLE_MAJOR < 3, reason="Paddle 2.x builds legacy programs by itself")

# every moved API that our models, tests, examples and Paddle's own clipping call, with a call to try
RELIED_ON = {
    "sqrt": lambda x, y: paddle.sqrt(x),
    "tanh": lambda x, y: paddle.tanh(x),
    "sigmoid": lambda x, y: paddle.nn.functional.sigmoid(x),
    "gelu": lambda x, y: paddle.nn.functional.gelu(x),
    "exp": lambda x, y: paddle.exp(x),
    "log": lambda x, y: paddle.log(x),
    "abs": lambda x, y: paddle.abs(x),
    "matmul": lambda x, y: paddle.matmul(x, y, transpose_y=True),
    "multiply": lambda x, y: paddle.multiply(x, y),
    "maximum": lambda x, y: paddle.maximum(x, y),
    "minimum": lambda x, y: paddle.minimum(x, y),
    "sum": lambda x, y: paddle.sum(x, axis=1),
    "Variable.sum": lambda x, y: x.sum(),
    "isfinite": lambda x, y: paddle.isfinite(x),
    "all": lambda x, y: paddle.all(paddle.isfinite(x)),
    "argmax": lambda x, y: paddle.argmax(x, axis=1),
}
LEGACY_OPS = {"sqrt": "sqrt", "tanh": "tanh", "sigmoid": "sigmoid", "gelu": "gelu", "exp": "exp", "log": "log",
              "abs": "abs", "matmul": "matmul_v2", "multiply": "elementwise_mul", "maximum": "elementwise_max",
              "minimum": "elementwise_min", "sum": "reduce_sum", "Variable.sum": "reduce_sum",
              "isfinite": "isfinite_v2", "all": "reduce_all", "argmax": "arg_max"}


@pytest.mark.parametrize("api", sorted(RELIED_ON))
def test_every_api_we_rely_on_builds_legacy_ops(api):
    main = paddle.static.Program()
    with paddle.static.program_guard(main, paddle.static.Program()):
        x = paddle.static.data("x", [None, 4], "float32")
        y = paddle.static.data("y", [None, 4], "float32")
        try:
            RELIED_ON[api](x, y)
        except TypeError as exc:  # Paddle moved it to C++ and nothing here rebuilds it
            pytest.fail(f"paddle {paddle.__version__}: {api} builds no legacy op ({exc}); add a builder to "
                        "staticpipe/legacy_ir.py BUILDERS")
    assert LEGACY_OPS[api] in [op.type for op in main.global_block().ops], api


@PADDLE3
def test_the_legacy_builders_compute_what_paddle_computes():
    """Each builder's program gives the value the same API gives in dygraph."""
    rng = np.random.default_rng(0)
    xv, yv = rng.uniform(0.5, 2.0, (3, 4)).astype("float32"), rng.uniform(0.5, 2.0, (3, 4)).astype("float32")
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [None, 4], "float32")
        y = paddle.static.data("y", [None, 4], "float32")
        outs = {api: call(x, y) for api, call in RELIED_ON.items()}
    got = paddle.static.Executor(paddle.CPUPlace()).run(main, feed={"x": xv, "y": yv}, fetch_list=list(outs.values()))
    paddle.disable_static()
    try:
        xt, yt = paddle.to_tensor(xv), paddle.to_tensor(yv)
        for (api, call), value in zip(RELIED_ON.items(), got):
            np.testing.assert_allclose(value, call(xt, yt).numpy(), rtol=1e-6, err_msg=api)
    finally:
        paddle.enable_static()


@PADDLE3
def test_an_api_without_a_legacy_builder_names_itself():
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
        x = paddle.static.data("x", [None, 4, 4], "float32")
        with pytest.raises(NotImplementedError, match=r"^paddle\.triu builds only PIR ops in Paddle 3\.\S+, and "
                                                      r"staticpipe's legacy-IR mode has no builder for it"):
            paddle.triu(x)


@PADDLE3
def test_pir_programs_under_ir_guard_and_dygraph_are_untouched():
    with paddle.pir_utils.IrGuard():
        main = paddle.static.Program()
        with paddle.static.program_guard(main, paddle.static.Program()):
            x = paddle.static.data("x", [None, 4], "float32")
            paddle.sqrt(paddle.tanh(x))
        assert [op.name() for op in main.global_block().ops][-2:] == ["pd_op.tanh", "pd_op.sqrt"]
    assert not isinstance(paddle.static.Program(), paddle.pir.Program)  # back to legacy after the guard
    paddle.disable_static()
    try:
        assert float(paddle.sqrt(paddle.to_tensor(4.0))) == 2.0
    finally:
        paddle.enable_static()


SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    {imports}
    paddle.enable_static()
    {opt_in}
    main = paddle.static.Program()
    with paddle.static.program_guard(main, paddle.static.Program()):
        x = paddle.static.data("x", [None, 4], "float32")
        paddle.sqrt(x)
    print(type(main).__module__, [op.type if hasattr(op, "type") else op.name() for op in main.global_block().ops])
""")
IMPORTS = ["import paddle\nimport staticpipe", "import staticpipe\nimport paddle"]
LEGACY = "paddle.base.framework ['sqrt']"
PIR = "paddle.base.libpaddle.pir ['pd_op.data', 'pd_op.sqrt']"


def built(imports: str, opt_in: str = "", **env: str) -> str:
    """What a fresh process builds, with ``env`` over this one's (the conftest's opt-in taken out)."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("FLAGS_enable_pir_api", "STATICPIPE_LEGACY_IR")},
           **env}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(repo=REPO, imports=imports, opt_in=opt_in)],
                         env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@PADDLE3
@pytest.mark.parametrize("imports", IMPORTS)
@pytest.mark.parametrize("switch", [{}, {"STATICPIPE_LEGACY_IR": "0"}], ids=["no-flags", "opt-in-off"])
def test_pir_programs_by_default(imports, switch):
    assert built(imports, **switch) == PIR


@PADDLE3
@pytest.mark.parametrize("imports", IMPORTS)
@pytest.mark.parametrize("flag", [None, "1", "0"])
def test_the_opt_in_gives_legacy_programs_whatever_the_import_order_and_flag(imports, flag):
    env = {"STATICPIPE_LEGACY_IR": "1", **({} if flag is None else {"FLAGS_enable_pir_api": flag})}
    assert built(imports, **env) == LEGACY


@PADDLE3
@pytest.mark.parametrize("imports", IMPORTS)
def test_use_legacy_ir_in_a_script_opts_in(imports):
    assert built(imports, opt_in="staticpipe.use_legacy_ir()") == LEGACY


@PADDLE3
def test_a_legacy_program_under_paddles_old_ir_guard_gets_the_legacy_builders():
    """No opt-in: Paddle's own OldIrGuard builds a legacy program, and Paddle's clipping (which calls moved
    APIs) still appends legacy ops to it."""
    script = SCRIPT.replace("    paddle.sqrt(x)", "    paddle.nn.ClipGradByGlobalNorm(1.0)([(x, paddle.sqrt(x))])")
    script = script.replace("main = paddle.static.Program()", "guard = paddle.pir_utils.OldIrGuard(); guard.__enter__()"
                            "; main = paddle.static.Program()")
    env = {k: v for k, v in os.environ.items() if k not in ("FLAGS_enable_pir_api", "STATICPIPE_LEGACY_IR")}
    out = subprocess.run([sys.executable, "-c", script.format(repo=REPO, imports=IMPORTS[1], opt_in="")], env=env,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == ("paddle.base.framework ['sqrt', 'squared_l2_norm', 'sum', 'sqrt', "
                                                   "'fill_constant', 'elementwise_max', 'elementwise_div', "
                                                   "'elementwise_mul']")


def test_a_loss_that_is_no_program_variable_is_refused_naming_its_type():
    loss = np.float32(1.0)
    with pytest.raises(ValueError) as err:
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=2).minimize(loss)
    assert str(err.value) == ("minimize: the loss is a numpy.float32, not a variable of a Paddle static program "
                              "(legacy IR or PIR)")

"""A small GPT-style language model: pre-LayerNorm causal transformer blocks with a tied output projection.

Why this model: it is the zoo's case of a parameter shared across stages. The token embedding table is
read by the lookup on the first stage and, transposed, by the output projection on the last stage.
"""
from __future__ import annotations

import staticpipe  # noqa: F401  (settles Paddle's static-IR flag before paddle is used)
import numpy as np
import paddle

from .network import Network, Variable, _distinct_init_seeds, _on_stage, fresh_names, stage_of

F = paddle.nn.functional

MASK_VALUE = -1e4
"""Added to the attention scores of future positions: exp underflows to exactly 0 in float32, and the
value still fits float16."""


def _dropout(x: Variable, p: float) -> Variable:
    # No op at all when p == 0, so the default model has no random ops in its main program.
    return F.dropout(x, p=p, training=True) if p > 0 else x


def _fc(x: Variable, size: int, act: str | None = None, bias: bool = True) -> Variable:
    return paddle.static.nn.fc(x, size, num_flatten_dims=2, activation=act, bias_attr=None if bias else False)


def _layer_norm(x: Variable) -> Variable:
    return paddle.nn.LayerNorm(x.shape[-1])(x)  # builds both IRs (paddle.static.nn.layer_norm: legacy only)


def _attention(x: Variable, n_heads: int, dropout: float) -> Variable:
    """Causal multi-head self-attention of x [B, S, D] -> [B, S, D]."""
    seq_len, d_model = x.shape[1], x.shape[2]
    d_head = d_model // n_heads

    def split_heads(t: Variable) -> Variable:  # [B, S, D] -> [B, H, S, Dh]
        return paddle.transpose(paddle.reshape(t, [0, 0, n_heads, d_head]), [0, 2, 1, 3])

    q = split_heads(_fc(x, d_model))
    # No key bias: it adds the same score to every key of a query, which softmax cancels, so its true
    # gradient is zero and Adam would only amplify rounding noise in it.
    k = split_heads(_fc(x, d_model, bias=False))
    v = split_heads(_fc(x, d_model))
    scores = paddle.scale(paddle.matmul(q, k, transpose_y=True), scale=d_head ** -0.5)  # [B, H, S, S]
    # Built by each block under its own guard, so no stage reads another stage's constant.
    mask = paddle.assign(np.triu(np.full((seq_len, seq_len), MASK_VALUE, np.float32), k=1))
    probs = _dropout(F.softmax(paddle.add(scores, mask), axis=-1), dropout)
    context = paddle.transpose(paddle.matmul(probs, v), [0, 2, 1, 3])  # [B, S, H, Dh]
    return _fc(paddle.reshape(context, [0, 0, d_model]), d_model)


def _block(x: Variable, n_heads: int, d_ff: int, dropout: float) -> Variable:
    """Pre-LayerNorm transformer block: x + attn(LN(x)), then h + MLP(LN(h))."""
    d_model = x.shape[2]
    h = paddle.add(x, _dropout(_attention(_layer_norm(x), n_heads, dropout), dropout))
    return paddle.add(h, _dropout(_fc(_fc(_layer_norm(h), d_ff, "gelu"), d_model), dropout))


def build_gpt(
    num_stages: int = 2,
    guarded: bool = True,
    vocab: int = 64,
    seq_len: int = 16,
    d_model: int = 32,
    n_heads: int = 4,
    n_layers: int = 4,
    d_ff: int | None = None,
    dropout: float = 0.0,
    seed: int = 1,
) -> Network:
    """A GPT language model over ``seq_len`` tokens; feeds "tokens" [B, S] and "targets" [B, S, 1] (int64).

    The ``n_layers`` blocks are the units split over 1 to ``n_layers`` stages; the embeddings (token and
    learned position) join the first stage and the head (final LayerNorm, tied projection, loss) the last.
    The token table "tok_embedding" is read on both, so a pipeline treats it as a shared parameter.
    ``outputs["logits"]`` is [B, S, vocab]; the loss is the mean next-token cross entropy.
    """
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    stages = [stage_of(i, n_layers, num_stages) for i in range(n_layers)]
    d_ff = 4 * d_model if d_ff is None else d_ff
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = seed
    init = paddle.nn.initializer.Normal(0.0, 0.02)
    with paddle.static.program_guard(main, startup), fresh_names():
        with _on_stage(0, guarded):
            tokens = paddle.static.data("tokens", [None, seq_len], "int64")
            table = paddle.static.create_parameter([vocab, d_model], "float32", name="tok_embedding",
                                                   default_initializer=init)
            positions = paddle.static.create_parameter([seq_len, d_model], "float32", name="pos_embedding",
                                                       default_initializer=init)
            h = _dropout(paddle.add(F.embedding(tokens, table), positions), dropout)  # positions broadcast
        for stage in stages:
            with _on_stage(stage, guarded):
                h = _block(h, n_heads, d_ff, dropout)
        with _on_stage(num_stages - 1, guarded):
            targets = paddle.static.data("targets", [None, seq_len, 1], "int64")
            logits = paddle.matmul(_layer_norm(h), table, transpose_y=True)  # tied output projection
            loss = paddle.mean(F.cross_entropy(logits, targets, reduction="none"))
    _distinct_init_seeds(startup, seed)
    return Network(
        main=main,
        startup=startup,
        feeds=[tokens, targets],
        loss=loss,
        outputs={"logits": logits},
        devices=[f"gpu:{k}" for k in range(num_stages)] if guarded else [],
        value_ranges={"tokens": (0, vocab), "targets": (0, vocab)},
    )

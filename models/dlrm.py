"""A wide-and-deep / DLRM-style click model whose embedding tables live on the CPU.

Why this model: it is the zoo's heterogeneous placement. Stage 0 is "cpu" and holds the embedding
tables (large, sparse, memory-bound); the MLPs run on the GPU stages after it. Its cross-stage values
skip stages: the embeddings go from the CPU straight to the top MLP's stage, the wide logit to the last.
"""
from __future__ import annotations

from typing import Sequence

import staticpipe  # noqa: F401  (settles Paddle's static-IR flag before paddle is used)
import paddle

from .network import Network, Variable, _distinct_init_seeds, _on_device, fresh_names, stage_of

F = paddle.nn.functional


def _dense(x: Variable, size: int, act: str | None = "relu") -> Variable:
    return paddle.static.nn.fc(x, size, activation=act)


def build_dlrm(
    num_stages: int = 2,
    guarded: bool = True,
    num_dense: int = 8,
    sparse_fields: int = 4,
    vocab_size: int = 1000,
    embed_dim: int = 8,
    hidden: Sequence[int] = (64, 32),
    is_sparse: bool = False,
    seed: int = 1,
) -> Network:
    """Click logits from ``num_dense`` float features and ``sparse_fields`` categorical ids.

    Feeds: "dense" float32 [B, num_dense], "sparse_0" .. "sparse_{k-1}" int64 [B, 1] (ids below
    ``vocab_size``) and "label" float32 [B, 1] (0 or 1). Stage 0 ("cpu"): one embedding table per field
    ("sparse_embedding_i", [vocab_size, embed_dim]), the lookups, their concatenation and the wide linear
    logit over it. GPU stages "gpu:0", "gpu:1", ...: the bottom MLP over the dense features and the top
    MLP over [bottom output, embeddings]; these 2 * len(hidden) layers are the units split over the
    ``num_stages - 1`` GPU stages. The last adds the wide logit to the deep one; the loss is the mean
    sigmoid cross entropy. ``outputs`` holds "logits" and "probability" (both [B, 1]).
    """
    hidden = tuple(hidden)
    if not hidden:
        raise ValueError("hidden must name at least one layer width")
    num_units = 2 * len(hidden)
    if not 2 <= num_stages <= 1 + num_units:
        raise ValueError(f"num_stages must be between 2 (the CPU embedding stage and one GPU stage) and "
                         f"{1 + num_units} (one GPU stage per MLP layer), got {num_stages}")
    devices = ["cpu"] + [f"gpu:{k}" for k in range(num_stages - 1)]
    unit_device = [devices[1 + stage_of(i, num_units, num_stages - 1)] for i in range(num_units)]
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = seed
    bound = vocab_size ** -0.5
    with paddle.static.program_guard(main, startup), fresh_names():
        with _on_device(devices[0], guarded):
            ids = [paddle.static.data(f"sparse_{i}", [None, 1], "int64") for i in range(sparse_fields)]
            tables = [paddle.static.create_parameter(  # not static.nn.embedding: it builds legacy programs only
                [vocab_size, embed_dim], "float32", attr=paddle.ParamAttr(
                    name=f"sparse_embedding_{i}", initializer=paddle.nn.initializer.Uniform(-bound, bound)))
                for i in range(sparse_fields)]
            looked_up = [paddle.reshape(paddle.nn.functional.embedding(field_ids, table, sparse=is_sparse),
                                        [-1, embed_dim]) for field_ids, table in zip(ids, tables)]
            embeddings = paddle.concat(looked_up, axis=1)  # [B, sparse_fields * embed_dim]
            wide = _dense(embeddings, 1, act=None)
        with _on_device(unit_device[0], guarded):
            dense = paddle.static.data("dense", [None, num_dense], "float32")
        x = dense
        for i, size in enumerate(hidden):  # bottom MLP
            with _on_device(unit_device[i], guarded):
                x = _dense(x, size)
        for i, size in enumerate(hidden):  # top MLP
            with _on_device(unit_device[len(hidden) + i], guarded):
                x = _dense(paddle.concat([x, embeddings], axis=1) if i == 0 else x, size)
        with _on_device(devices[-1], guarded):
            label = paddle.static.data("label", [None, 1], "float32")
            logits = paddle.add(_dense(x, 1, act=None), wide)
            loss = F.binary_cross_entropy_with_logits(logits, label, reduction="mean")
            probability = F.sigmoid(logits)  # after the loss, so the loss's ops do not depend on it
    _distinct_init_seeds(startup, seed)
    return Network(
        main=main,
        startup=startup,
        feeds=[dense, *ids, label],
        loss=loss,
        outputs={"logits": logits, "probability": probability},
        devices=devices if guarded else [],
        value_ranges={**{v.name: (0, vocab_size) for v in ids}, "label": (0, 2)},
    )

"""GPT pretraining as Paddle 2.x static fleet scripts write it, ported to staticpipe by its imports alone.

What such a script holds, at a small size: a GPT whose word embedding is tied between the first stage
(the lookup) and the last (the output projection); layers under ``device_guard`` split over ``--pp``
stages; fleet's hybrid strategy (pipeline x data parallel x sharded optimizer state) with recompute at
every block's output; AdamW with linear warm-up then cosine decay and a global-norm clip; a masked
language-model loss, ``sum(loss * mask) / sum(mask)`` per micro-batch (fleet averages the micro-batches'
gradients, as Paddle's pipeline does: docs/migrating.md says when that equals the full batch); a
``DataLoader.from_generator`` fed by each data-parallel rank's own shard of the corpus; fleet's topology
calls for logging and the data shard; and the checkpoint line ``paddle.distributed.io.save_persistables``
(Paddle 3's PIR programs have none: there ``staticpipe.save`` writes the checkpoint). The
lines a port changes are marked ``# ported``. Launched, one process per stage and replica:

    python -m staticpipe.launch --nprocs 8 examples/pretrain_gpt_fleet.py --pp 2 --dp 2 --sharding 2
    python examples/pretrain_gpt_fleet.py --pp 2          # one process, the stages as threads

The processes are pp x dp x sharding (``sharding_configs``' degrees, as Paddle's static fleet reads
them); ``--accumulate`` micro-batches per step and replica. ``--out DIR`` writes each process's final state, losses and the saved persistables' directory (the
tests compare them with one device).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402
from paddle.distributed.fleet.base.topology import CommunicateTopology  # noqa: E402
import staticpipe  # noqa: E402  # ported: was nothing
from staticpipe import fleet  # noqa: E402  # ported: was import paddle.distributed.fleet as fleet

VOCAB, SEQ, D_MODEL, HEADS, LAYERS = 64, 16, 32, 4, 4
MICRO_BATCH_SIZE = 2
MASK_ID = 1


def corpus(shard: int, shards: int, steps: int, accumulate: int, seed: int = 0):
    """(tokens, labels, mask) samples: sequences of a fixed random bigram chain, 15 % of positions masked
    out of the loss (mask 0); data-parallel rank ``shard`` reads every ``shards``-th micro-batch."""
    rng = np.random.default_rng(seed)
    follow = rng.integers(2, VOCAB, size=VOCAB)

    def reader():
        rng = np.random.default_rng(seed + 1)
        for index in range(steps * accumulate * MICRO_BATCH_SIZE * shards):
            seq = np.empty(SEQ + 1, np.int64)
            seq[0] = rng.integers(2, VOCAB)
            for t in range(SEQ):
                seq[t + 1] = follow[seq[t]] if rng.random() < 0.8 else rng.integers(2, VOCAB)
            mask = (rng.random(SEQ) > 0.15).astype(np.float32)
            if index // MICRO_BATCH_SIZE % shards == shard:
                yield seq[:-1], seq[1:].reshape(SEQ, 1), mask
    return reader


def fc(x, size: int, activation: str | None = None, bias: bool = True):
    return paddle.static.nn.fc(x, size, num_flatten_dims=2, activation=activation, bias_attr=None if bias else False)


def layer_norm(x):
    return paddle.nn.LayerNorm(D_MODEL)(x)  # builds both IRs (paddle.static.nn.layer_norm: legacy only)


def block(h):
    """A pre-norm transformer block with causal self-attention."""
    def heads(t):  # [B, S, D] -> [B, H, S, D/H]
        return paddle.transpose(paddle.reshape(t, [0, 0, HEADS, D_MODEL // HEADS]), [0, 2, 1, 3])

    x = layer_norm(h)
    # no key bias: softmax cancels it, so its true gradient is zero and AdamW would only amplify rounding noise
    q, k, v = heads(fc(x, D_MODEL)), heads(fc(x, D_MODEL, bias=False)), heads(fc(x, D_MODEL))
    scores = paddle.scale(paddle.matmul(q, k, transpose_y=True), scale=(D_MODEL // HEADS) ** -0.5)
    causal = paddle.assign(np.triu(np.full((SEQ, SEQ), -1e4, np.float32), 1))  # no attention to later positions
    attn = paddle.transpose(paddle.matmul(F.softmax(scores + causal), v), [0, 2, 1, 3])
    h = h + fc(paddle.reshape(attn, [0, 0, D_MODEL]), D_MODEL)
    return h + fc(fc(layer_norm(h), 4 * D_MODEL, activation="gelu"), D_MODEL)


def checkpoint_name(value, layer: int) -> str:
    """A recompute checkpoint's name; a PIR value has none (staticpipe recomputes every stage's activations
    whatever the list names, so any name does there)."""
    try:
        return value.name
    except ValueError:
        return f"block_{layer}"


def build(args):
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 1
    init = paddle.nn.initializer.Normal(0.0, 0.02)
    checkpoints = []
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        with staticpipe.device_guard("gpu:0"):  # ported: was paddle.static.device_guard
            tokens = paddle.static.data("tokens", [-1, SEQ], "int64")
            labels = paddle.static.data("labels", [-1, SEQ, 1], "int64")
            mask = paddle.static.data("loss_mask", [-1, SEQ], "float32")
            loader = staticpipe.io.DataLoader.from_generator(  # ported: was paddle.io.DataLoader.from_generator
                feed_list=[tokens, labels, mask], capacity=8, iterable=False)
            word = paddle.static.create_parameter([VOCAB, D_MODEL], "float32", name="word_embeddings",
                                                  default_initializer=init)
            position = paddle.static.create_parameter([SEQ, D_MODEL], "float32", name="position_embeddings",
                                                      default_initializer=init)
            h = F.embedding(tokens, word) + position
        for layer in range(LAYERS):
            with staticpipe.device_guard(f"gpu:{layer * args.pp // LAYERS}"):  # ported: was paddle.static.device_guard
                h = block(h)
                checkpoints.append(checkpoint_name(h, layer))
        with staticpipe.device_guard(f"gpu:{args.pp - 1}"):  # ported: was paddle.static.device_guard
            logits = paddle.matmul(layer_norm(h), word, transpose_y=True)
            per_token = paddle.squeeze(F.cross_entropy(logits, labels, reduction="none"), -1)
            loss = paddle.sum(per_token * mask) / paddle.sum(mask)  # the masked LM loss

        strategy = fleet.DistributedStrategy()
        strategy.pipeline = True
        strategy.pipeline_configs = {"accumulate_steps": args.accumulate, "micro_batch_size": MICRO_BATCH_SIZE,
                                     "schedule_mode": "1F1B"}
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": checkpoints}
        strategy.sharding = True  # on in the shipped configs, whatever the degree
        strategy.sharding_configs = {"sharding_degree": args.sharding, "dp_degree": args.dp, "pp_degree": args.pp,
                                     "mp_degree": 1, "segment_broadcast_MB": 32}
        schedule = paddle.optimizer.lr.LinearWarmup(
            paddle.optimizer.lr.CosineAnnealingDecay(1e-3, T_max=max(1, args.steps - 2)), warmup_steps=2,
            start_lr=0.0, end_lr=1e-3)
        optimizer = paddle.optimizer.AdamW(schedule, weight_decay=0.01, grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
        optimizer = fleet.distributed_optimizer(optimizer, strategy)
        optimizer.minimize(loss)
    return main, startup, loader, loss, schedule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--sharding", type=int, default=1)
    ap.add_argument("--accumulate", type=int, default=4, help="micro-batches per step and replica")
    ap.add_argument("--out", help="write this process's state, losses and saved persistables here")
    args = ap.parse_args()
    paddle.enable_static()
    fleet.init(is_collective=True)
    main_program, startup, loader, loss, schedule = build(args)
    hcg = fleet.get_hybrid_communicate_group()
    # every replica (dp x sharding of them) reads its own shard of the corpus, worked out from the process
    # rank as Paddle's static GPT pretraining works it out (its topology: data, pipe, sharding, model)
    topology = CommunicateTopology(["data", "pipe", "sharding", "sep", "model"],
                                   [args.dp, args.pp, args.sharding, 1, 1])
    coord = topology.get_coord(fleet.worker_index())
    shard = coord.data * args.sharding + coord.sharding
    assert shard == hcg.get_data_parallel_rank() * args.sharding + hcg.get_sharding_parallel_rank()
    loader.set_sample_generator(corpus(shard, args.dp * args.sharding, args.steps, args.accumulate),
                                batch_size=MICRO_BATCH_SIZE)
    if fleet.is_first_worker():
        print(f"applied: {fleet._get_applied_meta_list()}; stage {hcg.get_stage_id()} of "
              f"{hcg.get_pipe_parallel_world_size()}, data-parallel rank {hcg.get_data_parallel_rank()}")

    exe = staticpipe.Executor(paddle.CPUPlace())  # ported: was paddle.static.Executor(place)
    exe.run(startup)
    loader.start()
    losses = []
    try:
        while True:
            value, = exe.run(main_program, fetch_list=[loss])
            losses.append(np.nan if value is None else float(np.asarray(value)))
            schedule.step()
    except paddle.base.core.EOFException:  # the loader's data is used up, as under Paddle
        loader.reset()
    if hcg.is_last_stage and shard == 0:  # the last stage computes the loss (of the global batch)
        print(f"trained {len(losses)} steps; last loss {losses[-1]:.4f}")
    if args.out:
        rank = fleet.worker_index()
        np.savez(os.path.join(args.out, f"state_{rank}.npz"), **exe.state_dict(main_program))
        np.save(os.path.join(args.out, f"losses_{rank}.npy"), np.array(losses))
        if staticpipe.ir.is_pir_program(main_program):  # Paddle 3's PIR has no save_persistables (for any program)
            staticpipe.save(main_program, os.path.join(args.out, "checkpoint"), exe)
        else:  # ported: was the same line
            paddle.distributed.io.save_persistables(exe, os.path.join(args.out, "persistables"), main_program)
    exe.close()


if __name__ == "__main__":
    main()

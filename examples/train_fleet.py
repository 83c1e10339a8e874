"""A Paddle 2.x fleet pipeline script, ported to staticpipe by its imports and executor alone.

The script is written as Paddle's static pipeline is written with fleet: layers under ``device_guard``,
``fleet.DistributedStrategy`` with ``pipeline_configs`` (a loader batch is one micro-batch of one
replica), ``fleet.distributed_optimizer``, a ``DataLoader.from_generator`` fed by a reader of
``paddle.dataset.mnist`` style (flat 784-float images, int labels, reshaped by the loader as Paddle's
DataFeeder does), ``loader.start()`` and ``exe.train_from_dataset``. The lines a port changes are marked
``# ported``. In one process the stages run as threads; launched, one process per device and replica,
each replica reading its own shard of the data (``fleet.worker_index()``), as under Paddle's launcher:

    python examples/train_fleet.py [--steps 20] [--amp]
    python -m staticpipe.launch --nprocs 4 examples/train_fleet.py --dp 2     # 2 replicas x 2 stages

``--out DIR`` writes each process's final parameters and losses (the tests compare them with one device).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import staticpipe  # noqa: E402  # ported: was nothing
from staticpipe import fleet  # noqa: E402  # ported: was import paddle.distributed.fleet as fleet

ACCUMULATE_STEPS, MICRO_BATCH_SIZE = 4, 8


def mnist_like_reader(shard: int, num_shards: int, steps: int, seed: int = 0):
    """``paddle.dataset.mnist.train()``'s form: (784 floats, int label); learnable (a fixed linear teacher).
    Every process of a replica reads the same shard; replicas read disjoint ones."""
    teacher = np.random.default_rng(seed).standard_normal((784, 10)).astype(np.float32)

    def reader():
        rng = np.random.default_rng(seed + 1)
        for index in range(steps * ACCUMULATE_STEPS * MICRO_BATCH_SIZE * num_shards):
            image = rng.standard_normal(784).astype(np.float32)
            if index // MICRO_BATCH_SIZE % num_shards == shard:  # micro-batches dealt to the replicas in turn
                yield image.tolist(), int(np.argmax(image @ teacher))
    return reader


def build(amp: bool, dp: int):
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 1
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        with staticpipe.device_guard("gpu:0"):  # ported: was paddle.static.device_guard
            image = paddle.static.data("pixel", [-1, 1, 28, 28], "float32")
            label = paddle.static.data("label", [-1, 1], "int64")
            loader = staticpipe.io.DataLoader.from_generator(  # ported: was paddle.io.DataLoader.from_generator
                feed_list=[image, label], capacity=8, iterable=False)
            hidden = paddle.static.nn.fc(paddle.flatten(image, 1), 256, activation="relu")
            hidden = paddle.static.nn.fc(hidden, 128, activation="relu")
        with staticpipe.device_guard("gpu:1"):  # ported: was paddle.static.device_guard
            hidden = paddle.static.nn.fc(hidden, 128, activation="relu")
            logits = paddle.static.nn.fc(hidden, 10)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, label))

        strategy = fleet.DistributedStrategy()
        strategy.pipeline = True
        strategy.pipeline_configs = {"accumulate_steps": ACCUMULATE_STEPS, "micro_batch_size": MICRO_BATCH_SIZE,
                                     "schedule_mode": "1F1B"}
        strategy.hybrid_configs = {"dp_degree": dp, "pp_degree": 2}
        if amp:
            strategy.amp = True
            strategy.amp_configs = {"init_loss_scaling": 1024.0, "use_dynamic_loss_scaling": True}
        optimizer = fleet.distributed_optimizer(paddle.optimizer.Momentum(0.05, momentum=0.9), strategy)
        optimizer.minimize(loss)
    return main, startup, loader, loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (launch 2 x dp processes)")
    ap.add_argument("--amp", action="store_true", help="strategy.amp (fp16 loss scaling)")
    ap.add_argument("--out", help="write this process's parameters and losses here")
    args = ap.parse_args()
    paddle.enable_static()
    fleet.init(is_collective=True)
    main_program, startup, loader, loss = build(args.amp, args.dp)
    replica = fleet.worker_index() // 2
    loader.set_sample_generator(mnist_like_reader(replica, args.dp, args.steps), batch_size=MICRO_BATCH_SIZE)

    exe = staticpipe.Executor(paddle.CPUPlace())  # ported: was paddle.static.Executor(place)
    exe.run(startup)
    loader.start()
    fetched = exe.train_from_dataset(main_program, fetch_list=[loss], print_period=5)
    losses = [np.nan if values[0] is None else float(values[0]) for values in fetched]  # None: another rank's
    if fleet.is_first_worker():
        print(f"trained {exe.global_step} steps of {args.dp} x {ACCUMULATE_STEPS} x {MICRO_BATCH_SIZE} samples")
    if args.out:
        rank = fleet.worker_index() if fleet.worker_num() > 1 else "single"
        np.savez(os.path.join(args.out, f"params_{rank}.npz"), **exe.state_dict(main_program))
        np.save(os.path.join(args.out, f"losses_{rank}.npy"), np.array(losses))
    exe.close()


if __name__ == "__main__":
    main()

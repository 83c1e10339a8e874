"""``python -m staticpipe.launch --nprocs N script.py [args]``: one pipeline rank per process on this machine.

Each process runs the same script with the ``paddle.distributed`` environment of its rank (gloo on
CPU, loopback ports chosen free); ``staticpipe.Executor`` sees it, joins the job and runs only its own
stages. If a process fails, the others are stopped and the launcher exits with the failed rank's code,
naming it (a rank stopped by its watchdog because of another one, exit code ``STOPPED_EXIT``, is not
the one named). ``python -m paddle.distributed.launch`` works as well; this is the thin local variant.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from .placement import cuda_device_count
from .runtime.watchdog import STOPPED_EXIT


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def rank_environments(nprocs: int) -> list[dict[str, str]]:
    """The ``paddle.distributed`` variables of each rank of a job on this machine (loopback ports)."""
    ports = free_ports(nprocs + 1)
    endpoints = ",".join(f"127.0.0.1:{p}" for p in ports[1:])
    gpus = cuda_device_count() >= nprocs  # a GPU per rank: NCCL, rank r on GPU r; else gloo on CPU
    return [dict(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(nprocs),
                 PADDLE_DISTRI_BACKEND="nccl" if gpus else "gloo", PADDLE_MASTER=f"127.0.0.1:{ports[0]}",
                 PADDLE_TRAINER_ENDPOINTS=endpoints, PADDLE_CURRENT_ENDPOINT=f"127.0.0.1:{ports[rank + 1]}",
                 **({"FLAGS_selected_gpus": str(rank)} if gpus else {})) for rank in range(nprocs)]


def launch(nprocs: int, argv: list[str], poll_s: float = 0.2, wait_origin_s: float = 5.0) -> int:
    procs = [subprocess.Popen([sys.executable] + argv, env=dict(os.environ, **env))
             for env in rank_environments(nprocs)]
    first_failure = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        # a rank that exits with STOPPED_EXIT was stopped by its watchdog because another one failed:
        # name the one that failed, when it exits within wait_origin_s
        origins = [(rank, code) for rank, code in failed if code != STOPPED_EXIT]
        if failed and first_failure is None:
            first_failure = time.monotonic()
        if origins or (failed and (None not in codes or time.monotonic() - first_failure > wait_origin_s)):
            rank, code = (origins or failed)[0]
            print(f"staticpipe.launch: rank {rank} exited with code {code}; stopping the other ranks",
                  file=sys.stderr, flush=True)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            return code if code > 0 else 1
        if all(code == 0 for code in codes):
            return 0
        time.sleep(poll_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nprocs", type=int, required=True, help="processes: one per pipeline device")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.nprocs < 1:
        ap.error(f"--nprocs must be >= 1, got {args.nprocs}")
    sys.exit(launch(args.nprocs, [args.script] + args.args))


if __name__ == "__main__":
    main()

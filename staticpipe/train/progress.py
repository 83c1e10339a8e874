"""Training progress: a tqdm bar in a terminal, plain lines every ``print_period`` steps otherwise."""
from __future__ import annotations

import sys
import time
from typing import Sequence

import numpy as np


class Progress:
    def __init__(self, labels: Sequence[str], print_period: int = 100, stream=None, done: str = "trained"):
        if not isinstance(print_period, int) or print_period < 1:
            raise ValueError(f"print_period must be an integer >= 1, got {print_period!r}")
        self.labels, self.print_period, self.done = list(labels), print_period, done  # done: the summary's verb
        self.stream = stream if stream is not None else sys.stderr
        self.step = self.samples = 0
        self.start = time.perf_counter()
        self._bar = None

    def __enter__(self) -> "Progress":
        if getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm
            self._bar = tqdm(unit="step", file=self.stream, dynamic_ncols=True)
        return self

    def update(self, samples: int, values: Sequence, seconds: float) -> None:
        self.step += 1
        self.samples += samples
        rate = samples / seconds if seconds > 0 else float("inf")
        shown = {label: float(np.mean(v)) for label, v in zip(self.labels, values)
                 if v is not None and np.size(v) > 0}  # None: computed in another process
        if self._bar is not None:
            self._bar.set_postfix({**{k: f"{v:.4g}" for k, v in shown.items()}, "samples/s": f"{rate:.1f}"})
            self._bar.update(1)
        elif self.step % self.print_period == 0 or self.step == 1:
            text = ", ".join(f"{k}={v:.6g}" for k, v in shown.items())
            print(f"step {self.step}: {text}{', ' if text else ''}{rate:.1f} samples/s", file=self.stream,
                  flush=True)

    def note(self, text: str) -> None:
        """A line of its own, above the progress bar if there is one."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:  # one write: the lines of several processes sharing a stream do not interleave
            self.stream.write(f"{text}\n")
            self.stream.flush()

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()
        elapsed = time.perf_counter() - self.start
        if self.step:
            print(f"{self.done} {self.step} steps, {self.samples} samples in {elapsed:.2f} s "
                  f"({self.samples / elapsed:.1f} samples/s)", file=self.stream, flush=True)

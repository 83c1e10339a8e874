"""Running one PIR section program: Paddle's executor, fed from a micro-batch's scope and fetched into it.

Why it differs from the legacy runs (``DeviceWorker.execute``): Paddle's executor runs a PIR program in a
private child scope and frees every non-persistable value when the run ends, and it takes feeds only for
data ops. So the rewrite makes every value a section reads from elsewhere a data op of the value's name
(``rewrite/pir_programs.py``), and this runner feeds those from the micro-batch's scope, runs the program
in the device's root scope (where parameters, optimizer state and gradient buffers live), and moves the
values later sections need into the micro-batch's scope (handed over through the device's scope, or, for
what an in-place op or a fetch list gives, fetched and copied). Everything else of the step machinery --
scopes per micro-batch, sends, receives, keep lists, memory accounting -- is the legacy runs' own.

Facts of Paddle 3.3 that shape it (``../shared/notes/pir-facts.md``, re-checked by ``tests/test_pir.py``):
- a fetched tensor aliases the executor's fetch buffer, which the program's next run overwrites: what is
  kept is a copy; an output a kernel leaves unallocated (batch norm's reserve space on CPU) is kept as an
  empty tensor, which the op reading it ignores as it would the unallocated one;
- building a program's interpreter (for a new fetch list too) goes through process-global PIR state, and
  two threads doing so at once fail: building takes a process-wide lock;
- whether Paddle's executor takes the PIR path is thread-local state: each run sets it (``pir_thread``);
- Paddle's PIR interpreter schedules ops on a thread pool of its own by default. Stage workers are already
  the parallelism here (one thread per device, each with its intra-op budget), and the pool on top of them
  made the PIR pipelines of ``bench/ir_compare.py`` 1.3-1.7x slower (a wide MLP on 2 stages: 36.9 ms a
  step against 28.1 ms on 2 cores). So the first PIR plan to run sets, for the process,
  ``FLAGS_new_executor_serial_run`` (Paddle reads it on every run; an interpreter built with it must not
  run without it) and ``FLAGS_enable_pir_in_executor_trace_run``, which runs the ops on the calling thread:
  the stage worker's, with its thread budget (``Executor(threads_per_stage=...)``), as the legacy runs do.
  Neither changes a number, only which thread runs each op;
- on a CPU place the interpreter's garbage collector hands every freed buffer to a thread of its own, one
  wake-up per freed tensor: two stage workers on 2 cores then lost the cores to it, and a narrow MLP's
  pipeline ran 1.7x slower than the legacy one (``bench/ir_compare.py``: 6.5 ms a step against 3.9 ms;
  batching the frees, ``FLAGS_eager_delete_tensor_gb`` = 0.001 or 0.064, left 1.4x and 1.2x). Paddle reads
  that flag when an interpreter first runs, so each section's first run, under the process-wide lock,
  has it at -1: its interpreter keeps its intermediate buffers from run to run and reuses them (no
  allocation, no free: 0.87x of the legacy step there). The price is memory: a section holds one
  micro-batch's intermediates between its runs (what the legacy runs free as they go; the values a
  section hands to later sections are moved out as before, and its fed inputs are let go after each run,
  so only the temporaries stay). GPU places keep Paddle's collector, which frees on the calling thread.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

from .._paddle import core, np, paddle
from ..ir import np_dtype, tensor_of
from ..pir_ir import EAGER_DELETION, FEEDS, HANDED_OVER, SERIAL_RUN, TRACE_RUN, flags_set, pir_thread, section_values
from ..plan import Run

_FIRST_RUNS = threading.Lock()


class PirRuns:
    """The PIR runs of one device: its executor, place and root scope."""

    def __init__(self, place: core.Place, scope: core._Scope):
        self.place, self.scope = place, scope
        paddle.set_flags({SERIAL_RUN: True, TRACE_RUN: True})
        self._exe = paddle.static.Executor(place)
        self._prepared: dict[Run, _Prepared] = {}  # the run's interpreter, for the fetch list it was built for

    def execute(self, run: Run, scope: core._Scope, fetch: tuple[str, ...] = ()) -> None:
        """Run ``run`` with its data ops fed from ``scope``; leave in ``scope`` the values it produces that
        ``run.keep`` or ``fetch`` name."""
        prepared = self._prepared.get(run)
        first = prepared is None or prepared.fetch != fetch
        if first:  # one interpreter per run: see _build
            prepared = self._prepared[run] = self._prepare(run, fetch, scope)
        feed = {name: tensor_of(scope, name, prepared.where) for name in prepared.feeds}
        mode = paddle.base.framework.global_var
        outside, mode._use_pir_api_ = mode._use_pir_api_, True  # pir_thread, inlined: 2 µs of a 40 µs run
        try:
            if first:  # the run that makes the interpreter's garbage collector
                with _FIRST_RUNS, self._buffers_kept():
                    out = prepared.run(feed)
            else:
                out = prepared.run(feed)
        finally:
            mode._use_pir_api_ = outside
        for name in prepared.feeds:  # the micro-batch's values: theirs to free, not the interpreter's to hold
            self.scope.find_var(name).get_tensor()._clear()
        for name, held in prepared.handed:  # to the micro-batch; the next run makes anew
            made = self.scope.find_var(held).get_tensor()
            scope.var(name).get_tensor()._share_data_with(made)
            made._clear()
        for name, tensor in zip(prepared.fetched, out):
            kept = scope.var(name).get_tensor()
            if tensor._is_initialized() and tensor._numel() > 0:
                kept._share_data_with(tensor._copy(self.place))
            else:  # an output the kernel left without memory (batch norm's reserve space on CPU): empty, as it is
                value = section_values(run.program)[name]
                kept.set(np.zeros((0,) * max(1, len(value.shape)), np_dtype(value.dtype)), self.place)

    def _buffers_kept(self) -> ContextManager[None]:
        """On a CPU place, the interpreter made in here keeps its buffers from run to run (module docstring)."""
        return flags_set({EAGER_DELETION: -1.0} if isinstance(self.place, core.CPUPlace) else {})

    def _prepare(self, run: Run, fetch: tuple[str, ...], scope: core._Scope) -> "_Prepared":
        """What every run of ``run`` fetching ``fetch`` repeats, worked out once; Paddle's interpreter built
        (under the process-wide lock) with the first run's feeds."""
        program = run.program
        values, feeds = section_values(program), tuple(getattr(program, FEEDS))
        fetched = self._fetched(run, fetch)
        where = f"the run of section program {id(program):#x}"
        first = {name: tensor_of(scope, name, where) for name in feeds}
        with pir_thread(), _FIRST_RUNS:
            built = self._build(program, first, [values[n] for n in fetched])
        return _Prepared(fetch, feeds, fetched, tuple(getattr(program, HANDED_OVER, {}).items()), built, where)

    def _fetched(self, run: Run, fetch: tuple[str, ...]) -> tuple[str, ...]:
        """The names of ``run.keep`` and ``fetch`` that its program computes and does not hand over (fed and
        persistable values are already where they are read)."""
        values, fed = section_values(run.program), set(getattr(run.program, FEEDS))
        return tuple(n for n in dict.fromkeys(run.keep + fetch)
                     if n in values and n not in fed and not values[n].persistable)

    def _build(self, program: Any, feed: dict, fetch_list: list) -> Callable[[dict], list]:
        """Paddle's interpreter of ``program`` for these feeds and fetches, as a function of the feeds.

        Why not ``Executor.run`` on every run: it looks its interpreter up by a key that holds the whole
        program printed as text (``str(program)``), 0.2-0.5 ms a run here, and keeps 8 interpreters per
        executor, fewer than a device with several stages runs. The interpreter Paddle builds on the first
        run is kept here and run directly, its feeds set as ``Executor.run`` sets them.

        One interpreter per run at a time: two interpreters of one program (built for two fetch lists)
        share the values' variables in the device's scope, and the older one, run again after the newer
        one, crashed the process (SIGSEGV in a kernel) or failed every later step ("Unsupported setting
        dims for 'Unknown'", "Tensor holds no memory"). A new fetch list builds the run's interpreter anew
        (a few ms), and the old one is dropped."""
        exe, cache = self._exe, getattr(self._exe, "_executor_cache", None)
        if cache is None or not hasattr(exe, "_pir_feed_data") or not hasattr(cache, "_get_pir_program_and_executor"):
            return lambda feeds: exe.run(program, feed=feeds, fetch_list=fetch_list, scope=self.scope,
                                         return_numpy=False)  # another Paddle: its own path, every run
        # Built past Paddle's cache (its uncached builder): the cache would hand back the interpreter it built
        # for this fetch list before, which another fetch list's interpreter has since invalidated (below).
        compiled, interpreter, data_ops = cache._get_pir_program_and_executor(cache._CachedData(
            program, dict(feed), fetch_list, "feed", "fetch", self.place, self.scope, exe.plan))

        exe._pir_feed_data(compiled, dict(feed), self.scope, data_ops)  # checks the feeds' shapes once

        def run(feeds: dict) -> list:
            for name, tensor in feeds.items():  # as _pir_feed_data sets them (cut values are checked when sent)
                core.set_feed_variable(self.scope, tensor, name, 0)
            return interpreter.run(list(feeds), False, False)
        return run


@dataclass(frozen=True)
class _Prepared:
    fetch: tuple[str, ...]  # the fetch list it was built for
    feeds: tuple[str, ...]  # data ops fed from the micro-batch's scope
    fetched: tuple[str, ...]  # values fetched and copied into it
    handed: tuple[tuple[str, str], ...]  # (value, its name in the device's scope): moved into it
    run: Callable[[dict], list]  # Paddle's interpreter, fed
    where: str  # the run, in an error

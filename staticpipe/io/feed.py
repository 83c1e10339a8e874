"""What a batch is: the spec of each feed variable, checked arrays, and the split into micro-batches."""
from __future__ import annotations

import functools
import numbers
import reprlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .._paddle import np, paddle
from ..ir import np_dtype
from ..pir_ir import is_pir_data

Batch = dict[str, np.ndarray]
# numpy dtype kinds a feed variable's kind accepts without losing meaning (ints widen to floats, never back)
_ACCEPTED_KINDS = {"f": "fiu", "i": "iu", "u": "iu", "c": "cfiu", "b": "b"}


@dataclass(frozen=True)
class FeedSpec:
    """What one feed variable expects: ``-1`` in ``shape`` marks a dim that may be anything (the batch)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def from_variable(cls, var: Any) -> FeedSpec:
        dtype = np.dtype(np_dtype(var))
        return cls(var.name, tuple(-1 if d is None else int(d) for d in var.shape), dtype)

    def convert(self, value: Any) -> np.ndarray:
        """Check ``value`` against the spec and return it as an array of the spec's dtype.

        Checked here rather than left to Paddle so that the error names the variable and both shapes.
        """
        array = _array(self.name, value, "received")
        if array.ndim != len(self.shape) or any(
            want != -1 and want != got for want, got in zip(self.shape, array.shape)
        ):
            raise ValueError(
                f"feed variable {self.name!r}: expected shape {list(self.shape)} (batch, ...), "
                f"received shape {array.shape}"
            )
        if array.dtype == self.dtype:  # (the usual case: nothing to convert)
            return array
        if array.dtype.kind not in _ACCEPTED_KINDS.get(self.dtype.kind, self.dtype.kind):
            raise ValueError(f"feed variable {self.name!r}: expected dtype {self.dtype}, received {array.dtype}")
        return np.asarray(array, dtype=self.dtype)


    def from_samples(self, values: list[Any]) -> np.ndarray:
        """The batch of a sample or sample-list generator's ``values`` (one per sample), made as Paddle's
        ``DataFeeder`` makes it: the samples are stacked and cast to the variable's dtype (as
        ``np.array(samples, dtype)``: a float label becomes an int64 one, truncated), then reshaped to the
        variable's shape when their dims differ in number (a flat 784-float image to [-1, 1, 28, 28], an int
        label to [-1, 1]); a shape with more than one unknown dim is left as stacked. Every reader of
        ``paddle.dataset.*`` relies on this. What Paddle refuses, this refuses, with Paddle's reason."""
        array = stack_samples(self.name, values)
        try:
            array = array.astype(self.dtype)
        except (ValueError, TypeError) as e:
            raise ValueError(f"feed variable {self.name!r}: samples of dtype {array.dtype} cannot be converted to "
                             f"its dtype {self.dtype} ({e})") from None
        if array.ndim != len(self.shape) and sum(d < 0 for d in self.shape) <= 1:
            try:
                array = array.reshape(self.shape)
            except ValueError:
                raise ValueError(f"feed variable {self.name!r}: Reshape error. What is defined in data layer is "
                                 f"{tuple(self.shape)}, but receive {array.shape} (a batch of {len(values)} samples; "
                                 "Paddle's DataFeeder reshapes a batch whose dims differ in number from the "
                                 "variable's, and fails alike)") from None
        return self.convert(array)


def feed_specs(feed_list: Any) -> list[FeedSpec]:
    """The specs of a loader's ``feed_list``, checked: a non-empty list of distinct ``paddle.static.data``
    variables (either IR's)."""
    if feed_list is None:
        raise ValueError("feed_list is required in static mode: pass the paddle.static.data variables the "
                         "loader feeds, e.g. feed_list=[image, label]")
    if not isinstance(feed_list, (list, tuple)) or not feed_list:
        raise ValueError(f"feed_list must be a non-empty list of paddle.static.data variables, got {feed_list!r}")
    for var in feed_list:
        if not isinstance(var, paddle.static.Variable) and not is_pir_data(var):
            raise ValueError(f"feed_list entries must be paddle.static.data variables, got {type(var).__name__}: {var!r}")
    names = [var.name for var in feed_list]
    if len(set(names)) != len(names):
        raise ValueError(f"feed_list names a variable twice: {names}")
    return [FeedSpec.from_variable(var) for var in feed_list]


def _array(name: str, value: Any, what: str) -> np.ndarray:
    """``value`` as an array of numbers, or an error naming the feed variable and the value (``what``: which
    value it is). Why: numpy's own errors (ragged lists) name neither, and ``None`` would become an object array
    that fails far from here."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"feed variable {name!r}: {what} {reprlib.repr(value)}, which is not an array of numbers "
                         f"({e})") from None
    if array.dtype.kind == "O":
        raise ValueError(f"feed variable {name!r}: {what} {reprlib.repr(value)}, which is not an array of numbers "
                         "(numpy reads it as objects: it holds a None or another value that is not a number)")
    return array


def stack_samples(name: str, values: list[Any]) -> np.ndarray:
    arrays = [_array(name, v, f"sample {i} of the batch is") for i, v in enumerate(values)]
    shapes = sorted({a.shape for a in arrays})
    if len(shapes) > 1:
        raise ValueError(f"feed variable {name!r}: samples of one batch have different shapes {shapes}")
    return np.stack(arrays)


def fields(names: Sequence[str], item: Any, what: str) -> Sequence[Any]:
    """``item``'s values in feed_list order: ``item`` (a ``what``: "sample" or "batch") is a dict keyed by
    feed variable name, a tuple/list with one value per variable, or, for a single variable, the bare value."""
    if isinstance(item, dict):
        missing = [n for n in names if n not in item]
        unknown = [k for k in item if k not in names]
        if missing or unknown:
            raise ValueError(
                f"{what} dict keys must be the feed variables {list(names)}: "
                f"missing {missing}, not feed variables {unknown}"
            )
        return [item[n] for n in names]
    if not isinstance(item, (tuple, list)):
        if len(names) == 1:
            return (item,)
        raise ValueError(f"expected a tuple/list of {len(names)} fields per {what} (feed variables {list(names)}) or "
                         f"a dict keyed by them, received {reprlib.repr(item)} of type {type(item).__name__}")
    if len(item) != len(names):
        raise ValueError(
            f"expected {len(names)} fields per {what} (feed variables {list(names)}), received {len(item)}"
        )
    return item


def collate(names: Sequence[str], samples: Sequence[Any]) -> list[np.ndarray]:
    """The default collate: ``samples`` (each as :func:`fields` reads it) stacked variable by variable.

    A plain function of the names, so that a dataset loader's worker processes run it too.
    """
    if not samples:
        raise ValueError("cannot make a batch of an empty list of samples")
    rows = [fields(names, sample, "sample") for sample in samples]
    return [stack_samples(name, [row[i] for row in rows]) for i, name in enumerate(names)]


def to_batch(specs: Sequence[FeedSpec], item: tuple[str, Any]) -> Batch:
    """The checked batch of a producer's item: ``("samples", list of samples)`` from a generator, made as
    Paddle's ``DataFeeder`` makes it (``FeedSpec.from_samples``), or ``("batch", one whole batch)``, checked
    as it is (Paddle feeds a batch as given); run on the consumer's thread so that errors reach the caller
    with their context."""
    names = [spec.name for spec in specs]
    kind, payload = item
    if kind == "samples":
        if not payload:
            raise ValueError("cannot make a batch of an empty list of samples")
        rows = [fields(names, sample, "sample") for sample in payload]
        return {spec.name: spec.from_samples([row[i] for row in rows]) for i, spec in enumerate(specs)}
    return {spec.name: spec.convert(value) for spec, value in zip(specs, fields(names, payload, "batch"))}


def checked_batch(specs: Mapping[str, tuple[tuple[int, ...], str]], batch: Any, what: str) -> Batch:
    """``batch`` with exactly the data variables of ``specs`` (name -> (shape, dtype)), each converted and
    checked against its spec; ``what`` names the batch in errors ("feed", "micro-batch 3")."""
    if not isinstance(batch, dict):
        raise ValueError(f"{what} must be a dict {{data variable name: array}}, got {type(batch).__name__}")
    missing = [n for n in specs if n not in batch]
    extra = [n for n in batch if n not in specs]
    if missing or extra:
        raise ValueError(f"{what} does not match the program's data variables: missing {missing}, "
                         f"unknown {extra}; expected {sorted(specs)}")
    return {n: _spec(n, tuple(specs[n][0]), specs[n][1]).convert(v) for n, v in batch.items()}


@functools.lru_cache(maxsize=1024)
def _spec(name: str, shape: tuple[int, ...], dtype: str) -> FeedSpec:
    """The ``FeedSpec`` of a data variable, made once: a frozen dataclass and a numpy dtype cost more to build
    than the check itself, on every step."""
    return FeedSpec(name, shape, np.dtype(dtype))


def batch_rows(batch: Batch) -> int:
    return len(next(iter(batch.values())))


def split_microbatches(batch: Batch, num_microbatches: int) -> list[Batch]:
    """Split every array of ``batch`` along axis 0 into ``num_microbatches`` equal contiguous views.

    Equal sizes because every microbatch runs the same compiled program, and the pipeline averages
    their gradients with equal weights.
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, numbers.Integral) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if not batch:
        raise ValueError("cannot split an empty batch (no feed variables)")
    arrays = {name: np.asarray(value) for name, value in batch.items()}
    first, size = None, 0
    for name, array in arrays.items():
        if array.ndim == 0:
            raise ValueError(f"feed variable {name!r} is a scalar; it has no batch dim to split")
        if first is None:
            first, size = name, array.shape[0]
        elif array.shape[0] != size:
            raise ValueError(
                f"feed variables {first!r} and {name!r} have different batch sizes ({size} and {array.shape[0]})"
            )
    if size % num_microbatches:
        lower, upper = size // num_microbatches * num_microbatches, (size // num_microbatches + 1) * num_microbatches
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"batch size {size} of feed variable {first!r} is not divisible by num_microbatches={num_microbatches}; "
            f"use a batch size that is a multiple of {num_microbatches} (e.g. {hint})"
        )
    step = size // num_microbatches
    return [
        {name: array[i * step : (i + 1) * step] for name, array in arrays.items()} for i in range(num_microbatches)
    ]

"""Files of ``{name: ndarray}`` pickled as ``paddle.static.save`` writes them (``model.pdparams``,
``model.pdopt``): written with their sha256, read back without running code.

Why an allow-list: unpickling calls whatever global a file names, so a crafted checkpoint would run its
code at load. Such a file needs only numpy's array reconstruction (``numpy.core.multiarray._reconstruct``,
``numpy.ndarray``, ``numpy.dtype``, ``numpy.core.multiarray.scalar`` for numpy scalars, the same under
``numpy._core`` as numpy 2 names them) and ``_codecs.encode``, through which protocol 2 (Paddle's
``protocol=2``) stores bytes; dicts, lists, tuples, strings, numbers, booleans and None need no global. The
unpickler resolves exactly those and refuses any other before it is called. Protocol 4, what staticpipe and
Paddle write by default, keeps the files readable by ``paddle.static.load``.
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Any

from ._paddle import np

ALLOWED = frozenset({(numpy, name) for numpy in ("numpy.core.multiarray", "numpy._core.multiarray")
                     for name in ("_reconstruct", "scalar")}
                    | {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")})
PROTOCOL = 4


class _Refused(pickle.UnpicklingError):
    """A global outside ``ALLOWED``; its ``args[0]`` is the global's dotted name."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


class _Hashing:
    """A binary file's ``write`` that also hashes and counts what passes through it."""

    def __init__(self, file: Any) -> None:
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return self.file.write(data)


def write(file: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Pickle ``arrays`` to ``file``; returns its ``{"sha256": hex digest, "bytes": size}``."""
    with open(file, "wb") as f:
        out = _Hashing(f)
        pickle.dump(arrays, out, protocol=PROTOCOL)
    return {"sha256": out.sha256.hexdigest(), "bytes": out.size}


def digest(file: str) -> dict[str, Any]:
    """``{"sha256": hex digest, "bytes": size}`` of ``file`` as it is on disk."""
    sha256, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            sha256.update(chunk)
            size += len(chunk)
    return {"sha256": sha256.hexdigest(), "bytes": size}


def read(file: str) -> dict[str, np.ndarray]:
    """The ``{name: ndarray}`` pickled in ``file``. ``ValueError`` naming ``file`` when it refers to any
    other global (naming it too; nothing was called), is truncated or corrupt, or holds anything but a
    dict of arrays keyed by name."""
    try:
        with open(file, "rb") as f:
            arrays = _Unpickler(f, encoding="latin1").load()  # latin1: as paddle.static.load reads Python 2 files
    except _Refused as exc:
        raise ValueError(f"{file!r} refers to the Python global {exc.args[0]}, which a file of arrays never "
                         "needs: refused before anything ran (a crafted or foreign pickle)") from None
    except Exception as exc:  # noqa: BLE001 - whatever a damaged pickle raises, the fault is the file's
        raise ValueError(f"{file!r} is truncated or corrupt: unpickling it raised {type(exc).__name__}: "
                         f"{exc}") from None
    if not isinstance(arrays, dict):
        raise ValueError(f"{file!r} holds a {type(arrays).__name__}, not a dict of arrays by name")
    wrong = [f"{k!r} ({type(v).__name__})" for k, v in arrays.items()
             if not isinstance(k, str) or not isinstance(v, np.ndarray)]
    if wrong:
        raise ValueError(f"{file!r} holds entries that are not arrays by name: {', '.join(wrong)}")
    return arrays

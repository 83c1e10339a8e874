"""Replacing a directory (a checkpoint, a saved plan) so that a crash at any moment leaves the old or the
new one whole, touching nothing the library did not create.

Why: such a directory is several files that are only meaningful together, and a training job is killed
(preempted, out of memory, Ctrl-C) at moments it does not choose. A replacement of ``path`` goes:

1. make a *staging directory* ``<path>.staticpipe-save-<pid>-<8 hex digits>`` beside ``path``, holding
   the marker file ``staticpipe-save.lock`` (locked with ``flock`` for as long as the save runs) and an
   empty ``new/``, which the caller fills;
2. fsync every file and directory under ``new/``;
3. rename the previous ``path`` (if any) to ``<staging>/previous``; fsync the staging and parent
   directories;
4. rename ``<staging>/new`` to ``path``; fsync the parent directory;
5. rename ``previous`` to ``<staging>/discarded`` and delete it, then the marker, then the staging
   directory; fsync the parent directory.

So there is always a whole directory to load: ``path`` itself, except between 3 and 4, when the previous
one is whole in ``<staging>/previous``; and ``previous`` is deleted only under another name, once the new
one is in place. ``recover_directory`` (called by every load and every save) puts ``previous`` back when
``path`` is missing, and removes what dead saves left behind. It touches a directory only when its name
is exactly a staging name of ``path`` and its marker's lock is free (the save that held it has died; the
kernel drops the lock with the process), or when such a directory is empty (``os.rmdir`` removes nothing
else). A user's ``run1.old/`` or ``run1.tmp/`` is never looked at, and an existing ``path`` is replaced only
when it is a directory that holds the caller's own file (``meta.json``, ``plan.json``) or nothing.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
from typing import Iterator

STAGING = ".staticpipe-save-"
MARKER, NEW, PREVIOUS, DISCARDED = "staticpipe-save.lock", "new", "previous", "discarded"


@contextlib.contextmanager
def atomic_directory(path: str, holds: str, what: str) -> Iterator[str]:
    """Yield an empty directory to write ``path``'s new content into; when the block ends, put it in the
    place of ``path`` as the module docstring describes. If the block raises, ``path`` is left as it was.

    ``holds``: a file every directory of this kind has; an existing ``path`` is replaced only when it is a
    directory holding it, or an empty one (anything else raises before anything moves). ``what`` names
    the kind in messages ("a checkpoint")."""
    recover_directory(path)
    target = os.path.abspath(path)
    _check_replaceable(path, target, holds, what)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = f"{target}{STAGING}{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(staging)
    lock = _create_marker(staging, target)
    try:
        new = os.path.join(staging, NEW)
        os.mkdir(new)
        yield new
        _fsync_tree(new)
        if os.path.lexists(target):
            os.rename(target, os.path.join(staging, PREVIOUS))
            _fsync(staging)
            _fsync(os.path.dirname(target))
        os.rename(new, target)
        _fsync(os.path.dirname(target))
    except OSError as exc:  # a full disk, a quota: say where (errno's own text names a staging file, if any)
        raise type(exc)(exc.errno, f"{exc.strerror or exc} while saving {what} to {path!r}; what was there "
                                   "before, if anything, is kept whole") from exc
    finally:
        _settle(staging, target, lock)


def recover_directory(path: str) -> None:
    """Finish what saves of ``path`` that died left behind: if ``path`` is missing, put back the directory
    one of them moved aside; delete their staging directories (see the module docstring)."""
    target = os.path.abspath(path)
    parent, base = os.path.split(target)
    pattern = re.compile(re.escape(base + STAGING) + r"\d+-[0-9a-f]{8}")
    try:
        names = sorted(n for n in os.listdir(parent) if pattern.fullmatch(n))
    except (FileNotFoundError, NotADirectoryError):
        return  # no parent directory: nothing was ever saved there
    for name in names:
        staging = os.path.join(parent, name)
        if os.path.islink(staging) or not os.path.isdir(staging):
            continue
        marker = os.path.join(staging, MARKER)
        try:
            lock = os.open(marker, os.O_RDWR)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                os.rmdir(staging)  # only if empty: a save died right after making it or before removing it
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)  # its save is running
            continue
        if not os.path.exists(marker):  # another process settled it between our open and our lock
            os.close(lock)
            continue
        _settle(staging, target, lock)


def _check_replaceable(path: str, target: str, holds: str, what: str) -> None:
    if os.path.islink(target):
        raise ValueError(f"cannot save {what} to {path!r}: it is a symbolic link (to "
                         f"{os.path.realpath(target)!r}); save to the directory itself. Nothing was changed")
    if os.path.lexists(target) and not os.path.isdir(target):
        raise NotADirectoryError(f"cannot save {what} to {path!r}: it is a file, and {what} is a directory. "
                                 "Nothing was changed")
    if os.path.isdir(target) and os.listdir(target) and not os.path.isfile(os.path.join(target, holds)):
        raise ValueError(f"cannot save {what} to {path!r}: the directory holds no {holds}, so it is not {what} "
                         "staticpipe wrote, and replacing it would delete its files. Choose another path or "
                         "delete it. Nothing was changed")


def _create_marker(staging: str, target: str) -> int:
    """The marker's descriptor, locked: the file says that staticpipe made the directory (in words, for a
    person who finds it), the lock that its save is alive."""
    lock = os.open(os.path.join(staging, MARKER), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.write(lock, f"staticpipe is saving {target} (process {os.getpid()}); removed when the save "
                   "ends\n".encode())
    os.fsync(lock)
    return lock


def _settle(staging: str, target: str, lock: int) -> None:
    """Close a staging directory whose save has ended (done, failed or died), holding its marker's lock:
    put ``previous`` back if nothing took its place, delete the rest, the marker last."""
    previous = os.path.join(staging, PREVIOUS)
    parent = os.path.dirname(target)
    if os.path.isdir(previous) and not os.path.lexists(target):
        os.rename(previous, target)
        _fsync(parent)
    for name in os.listdir(staging):
        if name == PREVIOUS:  # obsolete only now that the new directory is in place; never deleted as "previous"
            os.rename(previous, os.path.join(staging, DISCARDED))
            name = DISCARDED
        if name != MARKER:
            shutil.rmtree(os.path.join(staging, name))
    os.unlink(os.path.join(staging, MARKER))
    os.close(lock)
    with contextlib.suppress(FileNotFoundError):  # an empty one may be removed by a concurrent recovery
        os.rmdir(staging)
    _fsync(parent)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: str) -> None:
    """Every file's data, then every directory's entries, so a renamed tree is whole after a power loss."""
    for folder, _, files in os.walk(top, topdown=False):
        for name in files:
            _fsync(os.path.join(folder, name))
        _fsync(folder)

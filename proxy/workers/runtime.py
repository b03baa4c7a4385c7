"""The supervisor's runtime directory (TETHER_WORKERS > 1): private to this user, holding the
workers' admin sockets, locked for the supervisor's whole life, and removed when it ends.

A supervisor that is killed (SIGKILL, the OOM killer) cannot remove its directory. The next
one to start removes every such directory it finds: one whose lock nobody holds. The lock is
an `flock` on a file inside the directory, which the kernel releases when its holder dies,
however it dies, so no process ID is compared (a reused one cannot make a dead supervisor
look alive, nor a live one dead). Several tethers may run on one machine: a directory whose
lock is held belongs to a live supervisor and is left alone, and another user's directories
are never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator

import structlog

log = structlog.get_logger("tether.supervisor")

PREFIX = "tether-workers-"
LOCK_NAME = "supervisor.lock"
# The lock file's name until it is locked: a directory without `LOCK_NAME` is one still
# being made (or an older tether's), never taken for a dead supervisor's.
_PENDING_LOCK_NAME = ".supervisor.lock.pending"


@contextlib.contextmanager
def runtime_directory() -> Iterator[str]:
    """A new directory (mode 0700) in the temporary directory, locked while the block runs and
    removed at its end; the stale ones of dead supervisors are removed first."""
    parent = tempfile.gettempdir()
    remove_stale(parent)
    path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    try:
        with _locked(path):
            yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """`path`'s lock, held while the block runs. It is taken under another name, then given
    its own: a sweep never finds it unlocked."""
    pending = os.path.join(path, _PENDING_LOCK_NAME)
    # Not inherited by the workers (os.open's descriptors never are): the lock lives and dies
    # with the supervisor alone.
    lock = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.rename(pending, os.path.join(path, LOCK_NAME))
        yield
    finally:
        os.close(lock)


def remove_stale(parent: str) -> None:
    """Remove this user's runtime directories in `parent` whose supervisor is gone."""
    uid = os.getuid()
    with os.scandir(parent) as entries:
        candidates = [
            entry.path
            for entry in entries
            if entry.name.startswith(PREFIX) and _owned_directory(entry, uid)
        ]
    for path in candidates:
        if _remove_if_unlocked(path):
            log.info("stale_runtime_directory_removed", path=path)


def _owned_directory(entry: os.DirEntry[str], uid: int) -> bool:
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid


def _remove_if_unlocked(path: str) -> bool:
    """Remove `path` if its lock can be taken (its supervisor is dead), holding the lock
    meanwhile so that another starting supervisor skips it."""
    try:
        lock = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # no lock yet (still being made), or already removed
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live supervisor's
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(lock)

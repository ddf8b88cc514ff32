"""The record of a tree ptckpt restored, so that `ptckpt stop` ends only what ptckpt made.

A restore writes one small JSON file per tree, named after the root's pid (as seen
here), in a runtime directory only its user can enter (``/run/ptckpt/restored`` for
root, else ``$XDG_RUNTIME_DIR/ptckpt/restored``; directories 0700, files 0600):

    {"pid": 1234, "start_time": 5678901, "image": "/tmp/ckpt-1234"}

`start_time` is field 22 of /proc/PID/stat (clock ticks after boot), so a pid reused by
another process does not pass for the restored one.  A record whose process is gone, or
whose pid now names a process that started at another time, is stale: it is removed
when seen (each lookup, and every new record sweeps the directory).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import dataclass

from . import procfs
from .errors import PtckptError


@dataclass(frozen=True)
class Record:
    pid: int              # the tree's root, as seen here
    start_time: int       # (22) of /proc/PID/stat when it was restored
    image: str            # the image directory it was restored from


def record_dir() -> str:
    if os.geteuid() == 0:
        return "/run/ptckpt/restored"
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/ptckpt-{os.geteuid()}"
    return os.path.join(base, "ptckpt", "restored")


def _start_time(pid: int) -> int | None:
    try:
        return procfs.read_stat(pid).start_time
    except PtckptError:
        return None


def _private_dir(path: str) -> None:
    """Make `path` (and what is missing above it) 0700; refuse one that is not ours alone."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        _private_dir(parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{path} is not a directory of uid {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def record(pid: int, image: str) -> str | None:
    """Record `pid` as the root of a tree restored from `image`.  Never raises: None, or a
    warning saying why no record could be written (then `ptckpt stop` needs --force).
    A process already gone needs no record."""
    start = _start_time(pid)
    if start is None:
        return None
    directory = record_dir()
    prune()
    path = os.path.join(directory, str(pid))
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        _private_dir(directory)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": pid, "start_time": start, "image": os.path.abspath(image)}, f)
        os.replace(temp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        return (f"no record of restored process {pid} could be written in {directory} "
                f"({err.strerror or err}): `ptckpt stop` will need --force for it")
    return None


def recorded(pid: int) -> Record | None:
    """The record of `pid` if it is the live process that was restored; a stale record
    (the process gone, or the pid reused: another start time) is removed, and None."""
    path = os.path.join(record_dir(), str(pid))
    ino = None
    try:
        with open(path) as f:
            ino = os.fstat(f.fileno()).st_ino
            rec = Record(**json.load(f))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        rec = None                              # unreadable: as good as stale
    if rec is not None and rec.pid == pid and rec.start_time == _start_time(pid):
        return rec
    with contextlib.suppress(OSError):
        if ino is None or os.stat(path).st_ino == ino:     # not a record a restore just wrote
            os.unlink(path)
    return None


def forget(pid: int) -> None:
    """Remove the record of `pid` (the tree ended, or its restore failed)."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(record_dir(), str(pid)))


def prune() -> None:
    """Remove every stale record."""
    with contextlib.suppress(OSError):
        for name in os.listdir(record_dir()):
            if name.isdigit():
                recorded(int(name))

"""pidfds (pidfd_open(2), pidfd_getfd's source, CLONE_PIDFD): which process each refers to.

Dump half: :func:`dump_pidfds` reads, per open file description, the ``Pid:`` line of
the fdinfo (kernel/pid.c pidfd_show_fdinfo: the pid in the reader's namespace, -1 once
the process has exited and been reaped) and the description's flags (PIDFD_NONBLOCK is
O_NONBLOCK, PIDFD_THREAD is O_EXCL).  What it may refer to, and what is refused by name:

* a member of the tree, or a zombie of it: the restore makes the pidfd on the restored
  process, so it refers to the same process again (pidfd_send_signal reaches it,
  waitid(P_PIDFD) and poll see it end);
* a process that has exited and been reaped (``Pid: -1``): the restore makes a pidfd
  on a process of its own that exits at once, and reaps it, so the pidfd refers to a
  dead process again (poll says readable, pidfd_send_signal ESRCH, waitid ECHILD).
  pidfds of one dead process (one pidfs inode: pidfs, Linux 6.9+, gives each process
  one) come back referring to one dead process, so they still compare equal
  (statx's stx_ino), whichever members hold them;
* a live process outside the tree: refused.  A restore can only make a pidfd on a
  process that exists then; the one outside may be gone, or its pid another process's,
  and a pidfd that silently referred to some other process would be worse than none.
  The way out: dump the tree that holds both, or close the pidfd before the dump;
* a thread of the tree other than its process's leader (PIDFD_THREAD): refused; the
  restore makes the pidfds before the threads exist.

Restore half: :func:`create_pidfds` makes every pidfd in ptckpt once all the restored
processes (and zombies) exist as stubs, with the recorded flags; :func:`install_pidfds_frozen`
passes those a process holds to it over the stubs' channel (SCM_RIGHTS), at numbers
above every fd of the image, for files.restore_fds_frozen to dup3 into place like
the descriptions ptckpt hands over at the stubs' birth.  A description that several
fds or processes share is still one description.

Limits: the pidfd's inode number is a new one (pidfs numbers processes by boot);
on a kernel without pidfs (before 6.9) every pidfd of a dead process gets its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
from collections.abc import Iterable, Mapping

from ..errors import RestoreFailed, UnsupportedResource
from ..formats.model import Fd, FdKind, PidfdState
from .. import procfs
from .fdstate import fs_type

PIDFD_NONBLOCK = os.O_NONBLOCK
PIDFD_THREAD = os.O_EXCL
PIDFD_FLAGS = PIDFD_NONBLOCK | PIDFD_THREAD
PID_FS_MAGIC = 0x50494446           # include/uapi/linux/magic.h
DEAD = -1                           # fdinfo "Pid: -1": exited and reaped


# --- dump half -----------------------------------------------------------------

def dump_pidfds(fds: Mapping[int, Iterable[Fd]], tids: Mapping[int, Iterable[int]],
                zombies: Iterable[int]) -> list[PidfdState]:
    """A PidfdState per pidfd description of the frozen tree (`fds`: numbered; `tids`: each
    member's threads; `zombies`: the tree's zombies), pids as ptckpt sees them.

    Raises UnsupportedResource, naming the fd, for a pidfd of a process outside the
    tree or of a thread that is not its process's leader.
    """
    members = set(tids)
    zombie_set = set(zombies)
    leader_of = {t: p for p, ts in tids.items() for t in ts}
    pidfs = _on_pidfs()
    targets: dict[tuple, int] = {}
    out: list[PidfdState] = []
    seen: set[int] = set()
    for p, flist in fds.items():
        for f in flist:
            if f.kind is not FdKind.PIDFD or f.external or f.desc in seen:
                continue
            seen.add(f.desc)
            pid = _pid_of(p, f)
            if pid == DEAD:
                key: tuple = ("dead", f.dev, f.ino) if pidfs else ("desc", f.desc)
            elif pid in members or pid in zombie_set:
                key = ("pid", pid)
            elif pid in leader_of:
                raise UnsupportedResource(p, f"fd {f.fd} -> {f.path} (a pidfd of thread {pid} of process "
                                             f"{leader_of[pid]}, not its leader: a restore makes the "
                                             f"pidfds before the threads; close it before the dump)")
            else:
                raise UnsupportedResource(p, f"fd {f.fd} -> {f.path} (a pidfd of process {pid} "
                                             f"({procfs.comm_or_unknown(pid)}), which is outside the "
                                             f"tree: a restore cannot make it refer to that process; "
                                             f"dump a tree that holds both, or close the pidfd "
                                             f"before the dump)")
            target = targets.setdefault(key, len(targets) + 1)
            out.append(PidfdState(pid=pid, flags=f.flags & PIDFD_FLAGS, target=target, desc=f.desc))
    return out


def _pid_of(p: int, f: Fd) -> int:
    values = [v for k, v in f.details if k == "Pid"]
    try:
        return int(values[0])
    except (IndexError, ValueError):
        raise UnsupportedResource(p, f"fd {f.fd} -> {f.path} (a pidfd whose fdinfo shows no "
                                     f"'Pid:' line: a kernel older than 5.4?)") from None


def _on_pidfs() -> bool:
    """pidfds are pidfs files (Linux 6.9+: one inode per process) on this kernel."""
    fd = os.pidfd_open(os.getpid())
    try:
        return fs_type(fd) == PID_FS_MAGIC
    finally:
        os.close(fd)


# --- restore half ----------------------------------------------------------------

def create_pidfds(states: Iterable[PidfdState], real: Mapping[int, int]) -> dict[int, int]:
    """{desc: a pidfd in ptckpt} for each of `states`, close-on-exec; `real` maps the
    image's pids to the restored processes' (they must all exist: stubs, or zombies-to-be
    not yet ended).  The pidfds of a dead target are made on one process of ptckpt's that
    exits at once and is reaped before this returns."""
    made: dict[int, int] = {}
    dead: dict[int, list[PidfdState]] = {}
    try:
        for s in states:
            if s.dead:
                dead.setdefault(s.target, []).append(s)
                continue
            try:
                made[s.desc] = os.pidfd_open(real[s.pid], s.flags)
            except (KeyError, OSError) as err:
                why = getattr(err, "strerror", None) or "not restored"
                raise RestoreFailed(f"cannot make the pidfd of process {s.pid}: {why}") from None
        for group in dead.values():
            made.update(_dead_pidfds(group))
    except BaseException:
        for fd in made.values():
            os.close(fd)
        raise
    return made


def _dead_pidfds(group: list[PidfdState]) -> dict[int, int]:
    """pidfds on one process that has exited and been reaped, one per state of `group`."""
    true = shutil.which("true")
    argv = [true, "true"] if true else [sys.executable, sys.executable, "-c", ""]
    try:
        pid = os.posix_spawn(argv[0], argv[1:], {})
    except OSError as err:
        raise RestoreFailed(f"cannot start a process to make pidfds of an exited process: "
                            f"{err.strerror}") from None
    made: dict[int, int] = {}
    try:
        for s in group:                  # it may have exited already: a zombie takes pidfds too
            made[s.desc] = os.pidfd_open(pid, s.flags)
    except OSError as err:
        for fd in made.values():
            os.close(fd)
        raise RestoreFailed(f"cannot make a pidfd of an exited process: {err.strerror}") from None
    finally:
        os.waitpid(pid, 0)               # reaped: the pidfds refer to a dead process
    return made


def install_pidfds_frozen(remote, ours: int, theirs: int, made: Mapping[int, int], fds: Iterable[Fd],
                          above: int) -> dict[int, int]:
    """Inside a restored process (its stub): receive each pidfd description its `fds` hold
    from ptckpt (`made`, over the channel `ours` -> `theirs`), at numbers from `above` on.
    {desc: the number it is at}, for files.restore_fds_frozen; close them afterwards
    (:func:`close_received_frozen`)."""
    from ..plugins import receive_fd_frozen
    out: dict[int, int] = {}
    for f in fds:
        if f.desc not in made or f.desc in out or f.skipped or f.external:
            continue
        number = above + len(out)
        with socket.socket(fileno=os.dup(ours)) as sock:
            socket.send_fds(sock, [b"p"], [made[f.desc]])
        receive_fd_frozen(remote, theirs, number, cloexec=True)
        out[f.desc] = number
    return out


def close_received_frozen(remote, received: Mapping[int, int]) -> None:
    for number in received.values():
        remote.checked("close", number, step=f"close the pidfd received at {number}")


def close_all(made: Mapping[int, int]) -> None:
    for fd in made.values():
        with contextlib.suppress(OSError):
            os.close(fd)

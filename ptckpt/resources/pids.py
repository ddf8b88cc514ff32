"""Pids: the restored process gets its original pid (clone3 set_tid), optionally in a fresh pid namespace.

Dump half: :func:`pid_view` -- the tree's pids as the tree itself sees them.
An image records those (virtual) pids: a tree that lives in a pid namespace of
its own (one restored with --pidns, a container) knows itself by its pids in
that namespace, and glibc caches them in its memory, so they are what a restore
must give back; the pids ptckpt sees (the real ones) go into the inventory, for
the table ``ptckpt show`` prints.

Restore half:

* :func:`check_pids_free` -- before anything is created, name the process
  holding a pid the image needs;
* :func:`start_stub` -- create the process that becomes the restored one:
  clone3(set_tid=[pid]) from ptckpt (or from a minimal init in a new pid
  namespace), stop it, seize it, and let it exec the restorer stub, so that it
  sits at the exec event before running a single instruction of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import os
import resource
import select
import signal
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from .. import procfs, testhooks
from ..formats.model import MsgImage, PidfdState, ProcessImage, SemImage, ShmImage, Terminal, UnixSocket, Zombie
from ..errors import PidBusy, PrivilegeNeeded, PtckptError, TargetVanished, TraceeError, UnsupportedResource
from ..restorer.stub import stub_memfd
from ..tracee import StopKind, Task, TraceEvent, TraceOptions

NR_CLONE3 = 435
CLONE_PARENT = 0x00008000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CAP_SYS_ADMIN = 21
PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 47, 2
NR_CAPGET, NR_CAPSET = 125, 126
_CAP_V3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# The same libc, called with the GIL held: a clone must not happen while another thread of
# ptckpt (the page check of a restore) holds it, or the child, whose only thread is the
# caller's copy, would wait for it forever when it runs Python again.
_libc_gil = ctypes.PyDLL(None, use_errno=True)
_libc_gil.syscall.restype = ctypes.c_long


# --- dump: the tree's own view of its pids ---------------------------------------

@dataclass(frozen=True)
class PidView:
    """Pids as ptckpt sees them (real) -> as the tree sees them (virtual).

    `level` is how deep the tree's pid namespace is below ptckpt's (0: the same
    namespace, every pid is its own virtual pid).  A pid not visible in the tree's
    namespace (a parent or session leader outside it) is virtual 0, as the kernel
    itself shows it there (getppid() of a namespace's init, NSsid).
    """

    level: int = 0
    virtual: dict[int, int] = field(default_factory=dict)

    def of(self, pid: int) -> int:
        if not self.level or pid <= 0:
            return pid
        return self.virtual.get(pid, 0)

    def real(self, vpid: int) -> int:
        """The pid ptckpt sees of the tree's `vpid` (vpid itself if unknown)."""
        if not self.level:
            return vpid
        return next((r for r, v in self.virtual.items() if v == vpid), vpid)

    def pairs(self) -> tuple[tuple[int, int], ...]:
        """(virtual, real) of every process and thread of the tree, for the inventory."""
        return tuple(sorted((v, r) for r, v in self.virtual.items() if v > 0)) if self.level else ()


def pid_view(root: int, members: Iterable[int], zombies: Iterable[int] = ()) -> PidView:
    """Read the NSpid, NSpgid and NSsid lines of every member, thread and zombie (frozen).

    Every member must live in the root's pid namespace: a process in a namespace
    nested below it would need one of its own at restore, which is not done yet.
    """
    root_status = procfs.read_status(root)
    level = len(root_status.nspid) - 1
    virtual: dict[int, int] = {}
    if level == 0:
        for pid in members:                    # only the check: pids are their own virtual pids
            try:
                nested = len(procfs.read_status(pid).nspid) != 1
            except PtckptError:
                continue                       # gone: the freeze or the capture tells
            if nested:
                raise UnsupportedResource(pid, f"process {pid} lives in a pid namespace of its own "
                                               f"below the tree's root: not supported yet")
        return PidView()

    def note(status: procfs.Status, pid: int, what: str) -> None:
        if len(status.nspid) != level + 1:
            raise UnsupportedResource(pid, f"{what} {pid} lives in a pid namespace nested below the "
                                           f"tree's (NSpid {' '.join(map(str, status.nspid))}): "
                                           f"not supported yet")
        virtual[pid] = status.nspid[level]
        for numbers in (status.nspgid, status.nssid):     # 0 where the group is not visible
            if len(numbers) == level + 1:
                virtual.setdefault(numbers[0], numbers[level])

    for pid in members:
        try:
            status = procfs.read_status(pid)
            tids = procfs.list_tids(pid)
        except (PtckptError, OSError):
            continue                           # gone: the freeze or the capture tells
        note(status, pid, "process")
        for tid in tids:
            if tid != pid:
                with contextlib.suppress(PtckptError):     # a thread exiting as we read
                    note(procfs.read_status(pid, tid), tid, "thread")
        if status.ppid not in virtual:
            try:
                parent = procfs.read_status(status.ppid)
            except PtckptError:
                continue
            virtual[status.ppid] = parent.nspid[level] if len(parent.nspid) > level else 0
    for pid in zombies:
        with contextlib.suppress(PtckptError):
            note(procfs.read_status(pid), pid, "zombie")
    return PidView(level, virtual)


def virtual_process(view: PidView, image: ProcessImage) -> ProcessImage:
    """`image` with every pid it records as the tree sees it."""
    if not view.level:
        return image
    v = view.of
    t = image.task
    return dataclasses.replace(
        image,
        task=dataclasses.replace(t, pid=v(t.pid), ppid=v(t.ppid), pgid=v(t.pgid), sid=v(t.sid),
                                 tids=tuple(map(v, t.tids))),
        threads=tuple(dataclasses.replace(th, tid=v(th.tid)) for th in image.threads),
        pending=tuple(dataclasses.replace(s, tid=v(s.tid)) for s in image.pending),
        locks=tuple(dataclasses.replace(lk, pid=v(lk.pid)) for lk in image.locks),
        timers=tuple(dataclasses.replace(t, tid=v(t.tid) if t.tid else 0, clockid=_virtual_clock(v, t.clockid))
                     for t in image.timers),
        owners=tuple(dataclasses.replace(o, pid=v(o.pid)) for o in image.owners))


def _virtual_clock(v, clockid: int) -> int:
    """A CPU clock of a given pid or tid (clock_getcpuclockid: the pid encoded, negative,
    include/linux/posix-timers.h MAKE_PROCESS_CPUCLOCK) names it as the tree sees it."""
    if clockid >= 0:
        return clockid
    pid = ~clockid >> 3
    return clockid if pid == 0 else (~v(pid) << 3) | (clockid & 7)


def virtual_records(view: PidView, records: list) -> list:
    """The image-wide records with their pids as the tree sees them (plugin data is
    already keyed by the image's pids: plugins see those)."""
    if not view.level:
        return records
    v = view.of
    out = []
    for r in records:
        if isinstance(r, Zombie):
            r = dataclasses.replace(r, pid=v(r.pid), ppid=v(r.ppid), pgid=v(r.pgid), sid=v(r.sid))
        elif isinstance(r, Terminal):
            r = dataclasses.replace(r, fg_pgrp=v(r.fg_pgrp), sid=v(r.sid))
        elif isinstance(r, ShmImage):
            r = dataclasses.replace(r, cpid=v(r.cpid), lpid=v(r.lpid))
        elif isinstance(r, SemImage):
            r = dataclasses.replace(r, pids=tuple(map(v, r.pids)))
        elif isinstance(r, MsgImage):
            r = dataclasses.replace(r, lspid=v(r.lspid), lrpid=v(r.lrpid))
        elif isinstance(r, PidfdState):
            r = dataclasses.replace(r, pid=v(r.pid))
        elif isinstance(r, UnixSocket) and r.queue_creds:
            r = dataclasses.replace(r, queue_creds=tuple((v(p) if p else 0, u, g) for p, u, g in r.queue_creds))
        out.append(r)
    return out


def zombie_record(pid: int) -> Zombie:
    """A zombie of the tree: its parent, group, session and the status its parent will reap."""
    st = procfs.read_stat(pid)
    return Zombie(pid=pid, ppid=st.ppid, pgid=st.pgrp, sid=st.session, wait_status=st.exit_code)


def pid_holder(pid: int) -> str | None:
    """'process 123 (comm)' of whoever holds `pid` now (as a process or a thread), else None."""
    try:
        status = procfs.read_status(pid)
    except PtckptError:
        return None
    if status.state.startswith("Z"):
        return f"zombie {pid} ({status.name}), not yet reaped by its parent {status.ppid}"
    what = "process" if status.tgid == pid else f"a thread of process {status.tgid}"
    return f"{what} {pid} ({status.name})"


def pgrp_orphaned(pid: int, *, procfs_root: str = "/proc") -> bool:
    """Whether the process group of `pid` is orphaned (POSIX; the kernel's
    will_become_orphaned_pgrp): no member that is not a zombie has a parent outside the
    group but in its session, init aside.  The kernel discards SIGTSTP, SIGTTIN and SIGTTOU
    sent to a member of such a group."""
    stats = {}
    for other in procfs.list_pids(procfs=procfs_root):
        with contextlib.suppress(PtckptError):
            stats[other] = procfs.read_stat(other, procfs=procfs_root)
    pgrp = stats[pid].pgrp if pid in stats else procfs.read_stat(pid, procfs=procfs_root).pgrp
    for st in stats.values():
        if st.pgrp != pgrp or st.state in ("Z", "X") or st.ppid <= 1:
            continue
        parent = stats.get(st.ppid)
        if parent is not None and parent.pgrp != pgrp and parent.session == st.session:
            return False
    return True


ZOMBIE_WAIT = 5.0    # seconds a pid held by a zombie is waited for (its parent reaps it soon:
                     # the target of a `dump --kill`, a stub of a killed restore, both
                     # reparented to an init that reaps when it gets to it)


def _holder_after_zombies(pid: int, deadline: float) -> str | None:
    """Who holds `pid`, once any zombie holding it was reaped (waited for until `deadline`)."""
    while True:
        holder = pid_holder(pid)
        if holder is None or not holder.startswith("zombie") or time.monotonic() >= deadline:
            return holder
        time.sleep(0.01)


def check_pids_free(pids: list[int], zombie_wait: float = ZOMBIE_WAIT) -> None:
    deadline = time.monotonic() + zombie_wait
    for pid in pids:
        holder = _holder_after_zombies(pid, deadline)
        if holder is not None:
            raise PidBusy(pid, holder)


def clone_args(set_tid_ptr: int, *, flags: int = 0, exit_signal: int = signal.SIGCHLD) -> bytes:
    """struct clone_args (include/uapi/linux/sched.h) asking for one pid, read from set_tid_ptr.

    Fields: flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size,
    tls, set_tid, set_tid_size, cgroup.  No stack: the child starts on its
    parent's (it never runs before the tracer has set its registers, or it execs).
    """
    return struct.pack("<11Q", flags, 0, 0, 0, exit_signal, 0, 0, 0, set_tid_ptr, 1, 0)


def become_subreaper() -> None:
    """PR_SET_CHILD_SUBREAPER: orphans of what we restore (and --pidns inits) come back to us."""
    _libc.prctl(ctypes.c_int(36), ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                ctypes.c_ulong(0))


def clone3_with_pid(pid: int, flags: int = 0) -> int:
    """clone3(set_tid=[pid]) of ptckpt itself: the child's pid in the parent, 0 in the child.

    Like fork() but without Python's fork hooks, so the child must only exec or _exit,
    and its caller must be a process of one thread (see _clone_stub).  With CLONE_PARENT
    in `flags` the child is the caller's sibling (its exit signal is then the caller's).
    """
    tid = ctypes.c_int32(pid)
    args = clone_args(ctypes.addressof(tid), flags=flags,
                      exit_signal=0 if flags & CLONE_PARENT else signal.SIGCHLD)
    buf = ctypes.create_string_buffer(args, len(args))
    res = _libc_gil.syscall(ctypes.c_long(NR_CLONE3), ctypes.c_void_p(ctypes.addressof(buf)),
                        ctypes.c_size_t(len(args)))
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return res


NR_EXIT_GROUP = 231


def end_stub(task: Task, gadget: int, wait_status: int) -> None:
    """Make a stub that is not rebuilt (a zombie-to-be, a helper) end, so that its parent's
    wait(2) reports `wait_status`: exit_group(code) at the gadget, or death by the signal.

    The stub stays its parent's zombie: the tracer's wait only detaches it.
    A signal death dumps no core (RLIMIT_CORE 0), so WCOREDUMP is never set.
    """
    sig = 0
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        resource.prlimit(task.tgid, resource.RLIMIT_CORE, (0, 0))
        os.kill(task.tgid, sig)
    else:
        task.aim_syscall(gadget, NR_EXIT_GROUP, os.WEXITSTATUS(wait_status))
    try:
        if sig != signal.SIGKILL:                # SIGKILL ends even a stopped task: no resume
            task.resume(0)
        while True:
            st = task.wait()
            task.resume(st.signo if st.kind is StopKind.SIGNAL and st.signo == sig else 0)
    except TargetVanished:
        return                                   # it has exited: the parent can reap it now


PR_SET_PDEATHSIG = 1


def _exec_stub_stopped(stub_fd: int, parent: int = 0) -> None:
    """In the new child: stop until the tracer has seized us, then become the stub.

    With `parent` (ptckpt itself), the child dies with it (PR_SET_PDEATHSIG) should ptckpt
    be killed before it seized the child (then PTRACE_O_EXITKILL takes over); the restore
    sets the image's own parent-death signal in the end."""
    try:
        if parent:
            # the GIL kept (_libc_gil): nothing here waits for another thread (see _clone_stub)
            _libc_gil.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(127)
        os.kill(os.getpid(), signal.SIGSTOP)
        os.execve(stub_fd, ["ptckpt-restorer"], {})
    finally:
        os._exit(127)


@dataclass
class Stub:
    """The process being restored, while it is still the stub."""

    pid: int            # its pid as ptckpt sees it (outer namespace)
    vpid: int           # its pid inside its own namespace (the image's pid)
    task: Task
    init_pid: int = 0   # the minimal init of --pidns, 0 without
    guard: int = -1     # --pidns: ptckpt's end of the pipe the init watches (see _minimal_init)

    def release(self) -> None:
        """The tree is let go: the init of --pidns stops watching ptckpt."""
        if self.guard >= 0:
            with contextlib.suppress(OSError):
                os.write(self.guard, b"go")
            os.close(self.guard)
            self.guard = -1

    def kill(self) -> None:
        """Kill what was half-built (the init too: that ends the whole namespace)."""
        if self.guard >= 0:
            os.close(self.guard)
            self.guard = -1
        for pid in (self.pid, self.init_pid):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for pid in (self.pid, self.init_pid):
            if pid:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)


def _wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until the process shows its group stop (it need not be our child, so no waitpid)."""
    deadline = time.monotonic() + timeout
    state = "?"
    while time.monotonic() < deadline:
        try:
            state = procfs.read_stat(pid).state
        except PtckptError:
            raise TraceeError(pid, "the new process exited before it reached the restorer stub") from None
        if state == "T":
            return
        if state in ("Z", "X"):
            raise TraceeError(pid, "the new process exited before it reached the restorer stub")
        time.sleep(0.0005)
    raise TraceeError(pid, f"the new process did not stop before exec (state {state})")


def _seize_until_exec(pid: int, vpid: int, init_pid: int) -> Stub:
    _wait_stopped(pid)
    task = Task(pid, pid)
    # EXITKILL: should ptckpt die before it lets the process go, what it half-built dies too
    # (a traced stub would otherwise run on from wherever the rebuild was).  The resume
    # detaches, which ends it; a process kept traced for plugin breakpoints dies with
    # ptckpt either way (its int3s would trap).
    task.seize(TraceOptions.SYSGOOD | TraceOptions.CLONE | TraceOptions.FORK | TraceOptions.EXEC
               | TraceOptions.EXITKILL)
    os.kill(pid, signal.SIGCONT)
    while True:
        st = task.wait()
        if st.kind is StopKind.EVENT and st.event == TraceEvent.EXEC:
            # The exec event comes from inside execve(); step to its syscall
            # exit, so the next resume starts at the stub's first instruction.
            while True:
                task.syscall_step()
                if task.wait().kind is StopKind.SYSCALL:
                    testhooks.reached("restore-stub")
                    return Stub(pid=pid, vpid=vpid, task=task, init_pid=init_pid)
        # the group stop we were started in, SIGCONT's delivery: pass through
        task.resume(st.signo if st.kind is StopKind.SIGNAL and st.signo != signal.SIGSTOP else 0)


def start_stub(pid: int, *, pidns: bool = False) -> Stub:
    """Create the process that will be restored, with pid `pid`, stopped at its exec event."""
    stub_fd = stub_memfd()
    try:
        if not pidns:
            parent = os.getpid()
            deadline = time.monotonic() + ZOMBIE_WAIT
            while True:
                try:
                    child = _clone_stub(pid, stub_fd, parent)
                    break
                except OSError as err:
                    if err.errno == errno.EPERM:
                        raise PrivilegeNeeded(
                            f"restoring process {pid} with its own pid needs CAP_CHECKPOINT_RESTORE "
                            f"(clone3 with set_tid); without it, restore with --pidns: the tree gets "
                            f"a user and pid namespace of its own, where it has its pids") from None
                    if err.errno != errno.EEXIST:
                        failed = TraceeError(pid, f"clone3 with set_tid={pid} failed: {err.strerror}")
                        failed.errno = err.errno          # EAGAIN, ENOMEM: errors.exhausted()
                        raise failed from None
                    holder = _holder_after_zombies(pid, deadline)
                    if holder is not None or time.monotonic() >= deadline:
                        raise PidBusy(pid, holder or "a process that just exited") from None
            try:
                return _seize_until_exec(child, pid, 0)
            except BaseException:
                Stub(child, pid, Task(child, child)).kill()
                raise
        return _start_in_new_pidns(pid, stub_fd)
    finally:
        os.close(stub_fd)


def _clone_stub(pid: int, stub_fd: int, parent: int) -> int:
    """The stub, ptckpt's child with pid `pid`, stopped before its exec; its pid, or OSError
    as from clone3_with_pid.

    A helper forked for it (os.fork: one thread, and Python's after-fork care of the GIL
    and its locks) makes it with clone3(CLONE_PARENT): a child cloned straight from ptckpt
    would be a copy of every thread's state but one, and the Python it runs before its exec
    could wait forever for a GIL hand-off or a lock another thread had asked for or held
    (a restore run in a Dask worker's thread was seen to stop short so)."""
    r, w = os.pipe()
    helper = os.fork()
    if helper == 0:
        try:
            os.close(r)
            try:
                child = clone3_with_pid(pid, CLONE_PARENT)
            except OSError as err:
                os.write(w, b"E %d" % err.errno)
                os._exit(0)
            if child == 0:
                os.close(w)
                _exec_stub_stopped(stub_fd, parent)
            os.write(w, b"C %d" % child)
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as pipe:
            kind, _, value = pipe.read().partition(b" ")
    finally:
        os.waitpid(helper, 0)
    if kind == b"C":
        return int(value)
    err = int(value) if kind == b"E" else errno.EIO
    raise OSError(err, os.strerror(err))


def privileged() -> bool:
    """Whether ptckpt holds CAP_SYS_ADMIN in its user namespace (unshare(CLONE_NEWPID) needs it)."""
    return bool(procfs.read_status(os.getpid()).cap_eff >> CAP_SYS_ADMIN & 1)


def _enter_own_user_namespace() -> str | None:
    """In the middle child of an unprivileged --pidns restore: a user namespace of its own,
    where the restoring user's uid and gid map to themselves (the restored tree keeps its
    ids) and it holds every capability, so that the init can choose pids (clone3 set_tid
    needs CAP_CHECKPOINT_RESTORE in the namespace that owns the pid namespace).  None, or
    the step that failed."""
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(ctypes.c_int(CLONE_NEWUSER)) != 0:
        return "unshare(CLONE_NEWUSER)"
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as err:
        ctypes.set_errno(err.errno or errno.EPERM)
        return f"writing /proc/self/{name}"
    return None


def _keep_capabilities_across_exec() -> str | None:
    """Make every permitted capability inheritable and ambient, so that the stub this
    process's child execs (as a user that is not root in its namespace) keeps them; the
    restore sets the image's own capability sets in the end, which clears the ambient set.
    None, or the step that failed."""
    header = struct.pack("<Ii", _CAP_V3, 0)
    data = ctypes.create_string_buffer(24)
    if _libc.syscall(ctypes.c_long(NR_CAPGET), ctypes.c_char_p(header), data) != 0:
        return "capget"
    words = list(struct.unpack("<6I", data.raw))
    words[2], words[5] = words[1], words[4]          # inheritable := permitted
    if _libc.syscall(ctypes.c_long(NR_CAPSET), ctypes.c_char_p(header),
                     ctypes.c_char_p(struct.pack("<6I", *words))) != 0:
        return "capset"
    permitted = words[1] | words[4] << 32
    last = int(procfs.read_sysctl("kernel/cap_last_cap"))
    for cap in range(last + 1):
        if permitted >> cap & 1 and _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0) != 0:
            return f"raising ambient capability {cap}"
    return None


def _start_in_new_pidns(pid: int, stub_fd: int) -> Stub:
    """A fresh pid namespace: a minimal init (pid 1) creates the stub with the image's pid.

    An intermediate child unshares CLONE_NEWPID (so ptckpt's own namespace is
    untouched) and forks the init; it reports the init's outer pid and exits,
    and the init, reparented to ptckpt (a child subreaper), reaps everything in
    the namespace and exits with the restored process's status.

    A user without CAP_SYS_ADMIN gets a user namespace of its own first
    (:func:`_enter_own_user_namespace`), which owns the new pid namespace.
    """
    become_subreaper()
    own_userns = not privileged()
    r, w = os.pipe()
    guard_r, guard_w = os.pipe2(os.O_CLOEXEC)
    middle = os.fork()
    if middle == 0:
        os.close(r)
        os.close(guard_w)
        try:
            failed = _enter_own_user_namespace() if own_userns else None
            if failed:
                os.write(w, f"E {ctypes.get_errno()} {failed}\n".encode())
                os._exit(1)
            if _libc.unshare(ctypes.c_int(CLONE_NEWPID)) != 0:
                os.write(w, f"E {ctypes.get_errno()} unshare(CLONE_NEWPID)\n".encode())
                os._exit(1)
            init = os.fork()
            if init == 0:
                if own_userns:
                    failed = _keep_capabilities_across_exec()
                    if failed:
                        os.write(w, f"E {ctypes.get_errno()} {failed}\n".encode())
                        os._exit(1)
                _minimal_init(pid, stub_fd, w, guard_r)
            os.write(w, f"I {init}\n".encode())
        finally:
            os._exit(0)
    os.close(w)
    os.close(guard_r)
    os.waitpid(middle, 0)
    init_pid = 0
    created = False
    try:
        with os.fdopen(r, "rb") as pipe:
            # "I <pid>" from the middle child and "C" from the init, in either order.
            for line in pipe:
                kind, *rest = line.decode().split(maxsplit=2)
                if kind == "I":
                    init_pid = int(rest[0])
                elif kind == "E":
                    failed = TraceeError(pid, f"pid namespace setup: {rest[1].strip()} failed: "
                                              f"{os.strerror(int(rest[0]))}")
                    failed.errno = int(rest[0])
                    failed.name = rest[1].split("-")[0].split("(")[0]     # clone3, unshare ...
                    raise failed
                elif kind == "C":
                    created = True
                if init_pid and created:
                    break
        if not init_pid or not created:
            raise TraceeError(pid, "pid namespace setup: the init did not start")
        children = procfs.read_thread_children(init_pid, init_pid)
        if len(children) != 1:
            raise TraceeError(pid, "pid namespace setup: the init has no child")
        testhooks.reached("restore-pidns")
        stub = _seize_until_exec(children[0], pid, init_pid)
        stub.guard = guard_w
        return stub
    except BaseException:
        os.close(guard_w)
        if init_pid:
            Stub(0, pid, Task(0, 0), init_pid=init_pid).kill()
        raise


def _minimal_init(pid: int, stub_fd: int, report_fd: int, guard: int) -> None:
    """Pid 1 of the new namespace: create the stub with `pid`, then reap until it ends.

    Until ptckpt lets the tree go it writes "go" on `guard`: should ptckpt die before
    (killed outright, before it could seize the stub or once it had), the pipe ends
    without it and the init kills everything in the namespace, so nothing half-built
    is left."""
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_IGN)
        try:
            child = clone3_with_pid(pid)
        except OSError as err:
            os.write(report_fd, f"E {err.errno} clone3-set_tid\n".encode())
            os._exit(1)
        if child == 0:
            os.close(report_fd)
            _exec_stub_stopped(stub_fd)
        os.write(report_fd, b"C\n")
        # The init keeps nothing of ptckpt's: not the report pipe, not the stub, and
        # not the objects handed to the stub (a pipe end held here would never see EOF).
        os.closerange(3, guard)
        os.closerange(guard + 1, os.sysconf("SC_OPEN_MAX"))
        # The init needs none of ptckpt's stdio (the restored process has its own copies).
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        status = 0
        watched = os.pidfd_open(child)
        while True:
            ready, _, _ = select.select([guard, watched], [], [])
            if guard in ready:
                if os.read(guard, 8) == b"":
                    os.kill(-1, signal.SIGKILL)    # ptckpt died before it let the tree go
                break
            if watched in ready:
                break                              # the stub ended: reaped below
        os.close(guard)
        os.close(watched)
        while True:
            try:
                got, st = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if got == child:
                status = st
        if os.WIFSIGNALED(status):
            os._exit(128 + os.WTERMSIG(status))
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
    finally:
        os._exit(1)

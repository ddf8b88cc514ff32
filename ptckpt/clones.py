"""Template clones: an image restored once, each run a copy-on-write copy of it.

A campaign restarts one image many times.  Instead of a whole restore per run, the image
is restored once into a *template* (:func:`ptckpt.pipeline.restore.restore_held`): rebuilt
in a pid namespace of its own, held stopped under ptrace, never run.  A run is a copy of
it, made by syscalls injected into the template::

    template (pid P in namespace A)  unshare(CLONE_NEWPID), clone3      -> C1
    C1       (pid 1 in namespace B)  clone3 with set_tid = P             -> the copy
    the copy (pid P in namespace B)  its private state, the run's faults, then it runs

The copy has the template's pid in a namespace of its own (the pid glibc keeps in the
thread's TLS is right, and so is getpid()), init (C1, a second copy held stopped, which
never runs) as its parent as after a --pidns restore, and every page of the template's
memory shared copy-on-write until it writes it: a copy costs its page tables and the
pages it writes, and is made in milliseconds.

What a fork would share but a run must own is made the copy's own before it runs:

* its fds 0-2 are the run's (stdin /dev/null, stdout and stderr files), and every other
  fd (a file, directory or device, opened by path) is opened again at the offset the
  image recorded, so copies neither share offsets nor see each other's reads;
* what fork(2) does not copy is set again: its session or process group, the robust
  futex list and clear_child_tid, the parent-death signal; registers, extended state
  and signal mask are the image's.

What stays shared with the template: memory pages until written (copy-on-write), the
file contents on disk (as for any restore of one image), the mount, user, network and
time namespaces and the cgroup.  An image whose state a copy cannot own is not copied
(:func:`refusal` says why, and the caller restores it the whole way per run): more
than one process or thread, fds other than files, directories and devices, locks,
timers, pending signals, shared anonymous or System V memory, memory locked or marked
not to be copied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import select
import signal
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from . import procfs
from .campaign_types import Backend, RunSpec
from .errors import PtckptError
from .formats.model import GP_REG_NAMES, Fd, FdKind, ProcessImage, VmaKind
from .plugins import Plugin, Plugins, ProcessHandle, plugin_name
from .tracee import AddressSpace, find_syscall_insn, remote_syscalls

log = logging.getLogger("ptckpt.clones")

CLONE_NEWPID = 0x20000000
WNOHANG, WALL = 1, 0x40000000
SIG_DFL = 0
COPYABLE_FDS = frozenset({FdKind.REGULAR, FdKind.DIRECTORY, FdKind.CHARDEV})
STACK_KEPT = 4096          # the bytes under the stack pointer the injections use, put back


def refusal(image, procs: dict[int, ProcessImage]) -> str | None:
    """Why the runs of this image cannot be copies of one template (None: they can)."""
    if len(procs) != 1 or image.zombies:
        return f"the image holds {len(procs)} processes" + (" and zombies" if image.zombies else "")
    if image.sysv or image.inet_sockets or image.fd_states:
        return "the image holds System V objects, sockets or fds with kernel state"
    proc = next(iter(procs.values()))
    checks = (
        (len(proc.threads) != 1, f"process {proc.task.pid} has {len(proc.threads)} threads"),
        (proc.task.state == "T", f"process {proc.task.pid} was stopped"),
        (bool(proc.locks), "it holds file locks"),
        (bool(proc.timers or proc.itimers), "it has timers (a fork does not copy them)"),
        (bool(proc.pending), "it has pending signals"),
        (bool(proc.aio_rings), "it has AIO rings"),
        (bool(proc.owners), "it set owners of fds (F_SETOWN)"),
    )
    for failed, why in checks:
        if failed:
            return why
    for f in proc.fds:
        if f.fd > 2 and not f.skipped and not f.external and (f.kind not in COPYABLE_FDS
                                                               or f.path.endswith(" (deleted)")):
            return f"fd {f.fd} ({f.kind.name.lower()} {f.path}) is not a file to open again"
    for v in proc.vmas:
        flags = set(v.vmflags.split())
        if v.kind in (VmaKind.ANON_SHARED, VmaKind.SHMEM, VmaKind.DEVICE, VmaKind.OTHER):
            return f"mapping {v.start:#x}-{v.end:#x} ({v.path or 'anonymous'}) is memory the copies would share"
        if flags & {"dc", "wf", "lo"}:
            return f"mapping {v.start:#x}-{v.end:#x} is locked or not copied by fork (VmFlags {v.vmflags})"
    return None


CAP_SYS_ADMIN = 21


def _copies_take_creds(directory: str) -> bool:
    """Whether the image's credentials would keep its template from making copies (a pid
    namespace and clone3 with set_tid need CAP_SYS_ADMIN): then the template keeps
    ptckpt's, and each copy takes the image's before it runs."""
    from .formats.image import ImageReader
    with ImageReader(directory, verify_pages=False) as reader:
        creds = reader.process(reader.inventory.root_pid).creds
    return not creds.cap_eff >> CAP_SYS_ADMIN & 1


class TemplateSide(Plugin):
    """A campaign's plugin as the template sees it: its pre_restore only (the fds it claims,
    the changes it makes to the image); its restored and resumed events are each copy's,
    on an instance of its own, as each restore of the image would have it."""

    def __init__(self, plugin: Plugin):
        self.plugin = plugin
        self.name = plugin_name(plugin)
        self.version = plugin.version
        self.recorded = plugin.recorded

    def pre_restore(self, proc, ctx) -> None:
        self.plugin.pre_restore(proc, ctx)


class NullStdio(Plugin):
    """The template's fds 0-2 are /dev/null (each copy gets the run's own)."""

    name = "null-stdio"
    version = "1"
    recorded = False

    def __init__(self) -> None:
        self.null = -1

    def pre_restore(self, proc, ctx) -> None:
        proc.image = dataclasses.replace(proc.image, fds=tuple(
            dataclasses.replace(f, skipped=True) if f.fd <= 2 else f for f in proc.image.fds))
        if self.null < 0:
            self.null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        for number in (0, 1, 2):
            ctx.install_fd(proc.vpid, number, self.null)

    def close(self) -> None:
        if self.null >= 0:
            os.close(self.null)
            self.null = -1


@dataclass
class Copy:
    """One running copy: `pid` as ptckpt sees it, `init` the stopped pid 1 of its namespace."""

    pid: int
    init: object            # tracee.Task of C1
    pidfd: int

    def ended(self) -> int | None:
        """The copy's wait status once it has ended (a zombie its init never reaps), else None."""
        try:
            st = procfs.read_stat(self.pid)
        except PtckptError:
            return None
        return st.exit_code if st.state in ("Z", "X") else None

    def end(self) -> None:
        """Kill its namespace (its init, the copy and whatever it started) and let go of it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.init.tid, signal.SIGKILL)
        self.init.reap_end()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def _stdio(stdout: str, stderr: str) -> list[Fd]:
    """fds 0-2 of a run: records of files to open, as a restore opens an image's."""
    def fd(number: int, path: str, flags: int) -> Fd:
        return Fd(number, FdKind.REGULAR, path, flags, 0, False, 0, 0, 0, 0, 0, 0, 0)
    return [fd(0, os.devnull, os.O_RDONLY), fd(1, stdout, os.O_WRONLY), fd(2, stderr, os.O_WRONLY)]


class Template:
    """An image restored once and held; :meth:`copy` makes a run of it."""

    def __init__(self, directory: str, *, plugins: Sequence[Plugin] = (), file_policy=None):
        from .pipeline.restore import restore_held
        from .resources.filepolicy import FilePolicy
        self.copies: list[Copy] = []
        self._symbols = None
        self.plugin_specs: list[str] = []          # --plugin: loaded again for each copy
        self.null = NullStdio()
        self.creds_later = _copies_take_creds(directory)
        try:
            self.held = restore_held(directory, plugins=[*plugins, self.null], file_policy=file_policy or FilePolicy(),
                                     creds_later=self.creds_later)
        finally:
            self.null.close()
        self.image_path = self.held.run.image.path
        self.plugin_data = self.held.run.image.plugin_data
        self.proc = self.held.root
        self.task = self.held.task
        self.regs = self.task.get_regs()
        stat = procfs.read_stat(self.task.tgid)
        self.leads = "session" if stat.session == self.task.tgid else "group" if stat.pgrp == self.task.tgid else ""
        with AddressSpace(self.task.tgid) as mem:
            self.gadget = find_syscall_insn(mem, procfs.read_maps(self.task.tgid))
            low = (self.regs.rsp - 128 - STACK_KEPT) & ~0xF
            self.stack = (low, mem.read(low, STACK_KEPT))
        if self.gadget is None:
            self.close()
            raise PtckptError("the template has no [vdso] to inject its copies' syscalls from")

    def close(self) -> None:
        """Every copy still there ended (its init is traced by ptckpt: the template's
        namespace could not end before ptckpt took its end), then the template."""
        for copy in self.copies:
            copy.end()
        self.copies.clear()
        self.held.close()

    def symbols(self):
        """The template's symbol table (ptckpt.symbols), read once: every copy maps the same."""
        if self._symbols is None:
            from .symbols import SymbolTable
            self._symbols = SymbolTable.for_process(self.task.tgid)
        return self._symbols

    def copy(self, stdout: str, stderr: str, plugins: Sequence[Plugin] = ()) -> Copy:
        """A new copy with the run's stdio, `plugins` given the pre_restore and restored
        events on it (the faults: builtins.Inject), then let go."""
        init = self._new_namespace()
        made = [init]
        try:
            task = self._copy_from(init)
            made.append(task)
            events = Plugins(plugins, self.image_path, restore=True, data=self.plugin_data) if plugins else None
            with AddressSpace(task.tgid) as mem, \
                    remote_syscalls(task, mem, self.gadget, keep_regs=False) as remote:
                self._own_state(task, remote, _stdio(stdout, stderr))
                overrides = self._events(task, remote, events)
            self._finish(task, overrides)
        except BaseException:
            # both are ptckpt's tracees: the namespace's end waits until each one's is taken
            for traced in made:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(traced.tid, signal.SIGKILL)
            for traced in reversed(made):
                traced.reap_end()
            raise
        pid = task.tgid
        pidfd = os.pidfd_open(pid)
        task.detach()
        if events:
            events.run("resumed", [ProcessHandle(pid, self.proc.task.pid, self.proc)])
        self.copies = [c for c in self.copies if c.pidfd >= 0]
        self.copies.append(Copy(pid, init, pidfd))
        return self.copies[-1]

    def _new_namespace(self):
        """C1: the template's child, pid 1 of a new pid namespace; the template's ended
        copies reaped first."""
        from .resources import threads
        with AddressSpace(self.task.tgid) as mem, \
                remote_syscalls(self.task, mem, self.gadget, keep_regs=False) as remote:
            while remote.syscall("wait4", -1, 0, WNOHANG | WALL, 0) > 0:
                pass
            # the namespace of the last copy's children is the template's own again (unshare
            # refuses to make another while they differ), then a new one
            own = remote.checked("pidfd_open", self.proc.task.pid, 0, step="the template's pidfd")
            try:
                remote.checked("setns", own, CLONE_NEWPID, step="the template's own pid namespace")
            finally:
                remote.syscall("close", own)
            remote.checked("unshare", CLONE_NEWPID, step="a pid namespace for a copy")
            init = threads.create_process_frozen(remote, 1)
        self.task.set_regs(self.regs)
        return init

    def _copy_from(self, init):
        """The copy: C1's child with the template's pid; C1 keeps the copy's end for us to
        read (SIGCHLD at its default, so the copy stays a zombie)."""
        from .resources import threads
        with AddressSpace(init.tgid) as mem, remote_syscalls(init, mem, self.gadget, keep_regs=False) as remote:
            task = threads.create_process_frozen(remote, self.proc.task.pid)
            with remote.scratch(struct.pack("<QQQQ", SIG_DFL, 0, 0, 0)) as act:
                remote.checked("rt_sigaction", signal.SIGCHLD, int(act), 0, 8, step="SIGCHLD of a copy's init")
        return task

    def _own_state(self, task, remote, stdio: list[Fd]) -> None:
        """What the copy must own: session, fds, robust list, clear_child_tid, credentials
        (when the template kept ptckpt's), pdeath signal."""
        from .resources import creds, files, process, threads
        thread = self.proc.threads[0]
        if self.leads == "session":
            remote.checked("setsid", step="a session for a copy")
        elif self.leads == "group":
            remote.checked("setpgid", 0, 0, step="a process group for a copy")
        fds = stdio + [f for f in self.proc.fds if f.fd > 2]
        files.restore_fds_frozen(remote, fds, procfs.list_fds(task.tgid), keep={self.held.channel[1]})
        threads.restore_robust_list_frozen(remote, thread, step="robust list")
        remote.checked("set_tid_address", thread.clear_child_tid, step="clear_child_tid")
        if self.creds_later:                      # the template could not make copies with them
            creds.restore_seccomp_frozen(remote, self.proc.creds)
            for warning in creds.restore_creds_frozen(remote, self.proc.creds):
                log.warning("copy %d: %s", task.tgid, warning)
        process.restore_pdeath_signal_frozen(remote, self.proc.task)

    def _events(self, task, remote, events: Plugins | None) -> dict:
        """pre_restore and restored of the run's plugins on the copy (the fds they give it
        sent over the plugin channel the template kept), then the channel closed in the
        copy; {tid: registers} they set."""
        from .restore import install_fd_frozen
        overrides: dict = {}
        ours, theirs = self.held.channel
        if events:
            vpid = self.proc.task.pid
            install = functools.partial(install_fd_frozen, remote, ours, theirs, {f.fd: f.cloexec for f in self.proc.fds})
            events.run("pre_restore", [ProcessHandle(0, vpid, self.proc)])
            for pid, number, fd in events.installs():
                try:
                    install(pid, number, fd)
                finally:
                    os.close(fd)
            handle = ProcessHandle(task.tgid, vpid, self.proc, tasks={vpid: task}, reg_overrides=overrides,
                                   remote_scope=lambda: contextlib.nullcontext(remote), fd_installer=install)
            handle._symbols = self.symbols()             # the template's mappings are the copy's
            events.run("restored", [handle])
        if theirs >= 0:
            remote.checked("close", theirs, step="close the copy's plugin channel")
        return overrides

    def _finish(self, task, overrides: dict) -> None:
        """The injections' stack bytes put back, then registers, xstate and mask: the image's."""
        from .resources import threads
        with AddressSpace(task.tgid) as mem:
            mem.write(*self.stack)
        thread = self.proc.threads[0]
        if thread.tid in overrides:
            thread = dataclasses.replace(thread, regs=tuple(overrides[thread.tid][n] for n in GP_REG_NAMES))
        threads.set_final_state(task, thread)


# --- a campaign's runs as copies ---------------------------------------------------------

def _shell_status(wait_status: int) -> int:
    """A wait status as a shell shows it: 128+N for a signal."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


class CloneBackend(Backend):
    """A campaign's runs as copies of one template (ptckpt.campaign_types.Backend): `jobs`
    at a time, each with the run's faults (builtins.Inject, seeded by the run) made in the
    copy before it runs.  A copy that cannot be made is a run whose stderr holds the
    "ptckpt: error:" line, as a failed restore's would."""

    def __init__(self, template: Template, inject: Sequence[str], jobs: int = 1):
        self.template = template
        self.inject = list(inject)
        self.jobs = max(1, jobs)
        self.queue: list[RunSpec] = []
        self.running: dict[int, tuple[RunSpec, Copy, float]] = {}
        self.failed: list[tuple[int, int | None, float, bool, str]] = []
        self.host = socket.gethostname()
        self.runs_as = "copies of a template"

    def submit(self, run: RunSpec) -> None:
        self.queue.append(run)
        self._start()

    def _start(self) -> None:
        from .api import load_plugins
        from .builtins import Inject
        while self.queue and len(self.running) < self.jobs:
            run = self.queue.pop(0)
            os.makedirs(run.directory, mode=0o700, exist_ok=True)
            out, err = (os.path.join(run.directory, n) for n in ("stdout", "stderr"))
            for path in (out, err):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            started = time.monotonic()
            try:
                plugins = load_plugins(self.template.plugin_specs)    # each run's own, as each restore's
                if run.index:
                    plugins.append(Inject(self.inject, run.seed, os.path.join(run.directory, "faults.json")))
                copy = self.template.copy(out, err, plugins)
            except PtckptError as error:
                with open(err, "a") as f:
                    f.write(f"ptckpt: error: {error}\n")
                self.failed.append((run.index, int(error.exit_code), time.monotonic() - started, False, self.host))
                continue
            self.running[run.index] = (run, copy, started)

    def wait(self) -> list[tuple[int, int | None, float, bool, str]]:
        while True:
            done = self.collect()
            if done:
                return done
            if not self.running and not self.queue:
                return []
            self.sleep()

    def collect(self) -> list[tuple[int, int | None, float, bool, str]]:
        """Without blocking: the runs that ended (or failed to start, or reached their
        timeout: killed) since the last call, and the next ones started in their place."""
        done, self.failed = self.failed, []
        now = time.monotonic()
        for index, (run, copy, started) in list(self.running.items()):
            status = copy.ended()
            timed_out = status is None and now - started > run.timeout
            if status is not None or timed_out:
                copy.end()
                del self.running[index]
                done.append((index, None if timed_out else _shell_status(status), now - started, timed_out,
                             self.host))
        if done:
            self._start()
        return done

    def sleep(self, *fds: int) -> None:
        """Until a copy ends (its pidfd is readable), one of `fds` is, or the nearest
        timeout is due (a second at most)."""
        poller = select.poll()
        for fd in (*fds, *(copy.pidfd for _run, copy, _started in self.running.values())):
            poller.register(fd, select.POLLIN)
        now = time.monotonic()
        due = min((started + run.timeout - now for run, _copy, started in self.running.values()), default=1.0)
        poller.poll(max(1, min(1000, int(due * 1000) + 1)))

    def stop(self, index: int) -> None:
        """Run `index` ended now (or never started), reported as nothing."""
        self.queue = [r for r in self.queue if r.index != index]
        if index in self.running:
            self.running.pop(index)[1].end()

    def cancel(self) -> None:
        self.queue.clear()
        for _run, copy, _started in self.running.values():
            copy.end()
        self.running.clear()
        self.template.close()


def campaign_refusal(image: str, inject: Sequence[str], restore_args: Sequence[str]) -> str | None:
    """Why a campaign's runs cannot be copies of one template (None: they can): an option
    that must act per run (--plugin ...), a fault at a call (a breakpoint needs ptckpt
    beside the run), or what :func:`refusal` finds in the image."""
    from .faults import parse_spec
    from .formats.image import ImageReader
    options = set(restore_args[::2]) - set(TEMPLATE_OPTIONS)
    if options:
        return "the restore options " + " ".join(sorted(options))
    if any(parse_spec(text).kind == "call" for text in inject):
        return "a call: fault (its breakpoint needs ptckpt beside the run)"
    try:
        with ImageReader(image, verify_pages=False) as reader:
            return refusal(reader, {p: reader.process(p) for p in reader.pids})
    except PtckptError as err:
        return str(err)


TEMPLATE_OPTIONS = ("--plugin", "--file-policy", "--set-env", "--remap-path")


def template_for(image: str, restore_args: Sequence[str]) -> Template:
    """The template of a campaign whose runs restore with `restore_args`: --file-policy,
    --set-env and --remap-path made once, in the template, as a restore would; each
    --plugin's pre_restore there (TemplateSide), its other events in each copy."""
    from .api import load_plugins, parse_file_policy
    from .builtins import RemapPath, SetEnv
    pairs = list(zip(restore_args[::2], restore_args[1::2]))
    given = {o: [v for k, v in pairs if k == o] for o in TEMPLATE_OPTIONS}
    plugins: list[Plugin] = [TemplateSide(p) for p in load_plugins(given["--plugin"])]
    if given["--remap-path"]:
        plugins.insert(0, RemapPath(given["--remap-path"]))
    if given["--set-env"]:
        plugins.append(SetEnv(given["--set-env"]))
    template = Template(image, plugins=plugins, file_policy=parse_file_policy(given["--file-policy"]))
    template.plugin_specs = given["--plugin"]
    return template

"""The typed error hierarchy of ptckpt.

Every error a user can cause or meet is one of these classes.  Fields are
attributes, the message is built from them, and each class maps to one exit
code (``exit_code``) that the CLI passes through.  Lower layers translate
OSError / PtraceError into these at one choke point each; nothing else escapes.
"""

from __future__ import annotations

import errno as _errno
import os


class ExitCode:
    """Documented process exit codes of the ``ptckpt`` command (README lists them)."""

    OK = 0
    INTERNAL = 1          # a bug: an unexpected exception
    USAGE = 2             # bad command line (typer/click's own code)
    NO_SUCH_PROCESS = 3
    ACCESS_DENIED = 4
    ALREADY_TRACED = 5
    KERNEL_THREAD = 6
    TARGET_VANISHED = 7
    DESTINATION_EXISTS = 8
    IO_ERROR = 9          # disk full, unwritable directory ...
    REMOTE_SYSCALL = 10
    CORRUPT_IMAGE = 11
    UNSUPPORTED_VERSION = 12
    UNSUPPORTED_RESOURCE = 13
    PID_BUSY = 14
    INCOMPATIBLE = 15     # CPU or kernel cannot run the image
    NOT_AN_IMAGE = 16
    MISSING_FEATURE = 17  # `ptckpt check`: dump/restore cannot work here
    PLUGIN = 18           # a plugin failed, or one the image needs is not loaded
    CRITICAL_SECTION = 19  # the target stayed in a critical section (ptckpt.app) too long
    CONTROL = 20          # `ptckpt control`: no such run, or it does not answer
    CONNECTION = 21       # a TCP connection needs --tcp-established, --tcp-close or --external
    DIFFERENT = 22        # `ptckpt diff`: the images differ (beyond the fields expected to)
    EXHAUSTED = 23        # out of a resource: open files, memory, processes
    TRANSFER = 24         # page server, push, migrate: no connection, denied, broken, or it refused
    RUNS_FAILED = 25      # campaign: some runs could not be restored (outcome "error")
    NOT_RESTORED = 26     # `ptckpt stop`: the process is not a tree ptckpt restored
    REFERENCE_FAILED = 27  # campaign: the reference run's program failed, crashed or hung
    GROUP_FAILED = 28     # group dump/restore: a member failed (the others resumed, or killed)


class PtckptError(Exception):
    """Base of every error ptckpt reports to a user."""

    exit_code = ExitCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(PtckptError):
    """A bad argument given to the library (the CLI's usage errors, exit 2)."""

    exit_code = ExitCode.USAGE


# --- tracee errors ---------------------------------------------------------

class ProcessError(PtckptError):
    """Something about one process (pid) prevents the operation."""

    def __init__(self, pid: int, message: str):
        super().__init__(message)
        self.pid = pid


class NoSuchProcess(ProcessError):
    exit_code = ExitCode.NO_SUCH_PROCESS

    def __init__(self, pid: int, what: str = "process"):
        super().__init__(pid, f"no such {what}: {pid}")


class NotRestored(ProcessError):
    """`ptckpt stop` was given a process that ptckpt did not restore (no live record of it)."""

    exit_code = ExitCode.NOT_RESTORED

    def __init__(self, pid: int, record_dir: str):
        super().__init__(pid, f"process {pid} is not a tree ptckpt restored (no live record of it in "
                              f"{record_dir}): left alone; `ptckpt stop --force {pid}` or `kill {pid}` "
                              f"ends it anyway")
        self.record_dir = record_dir


class TargetVanished(ProcessError):
    """The target (or one of its threads) exited while we worked on it."""

    exit_code = ExitCode.TARGET_VANISHED

    def __init__(self, pid: int, during: str):
        super().__init__(pid, f"process {pid} exited during {during}")
        self.during = during


class AccessDenied(ProcessError):
    exit_code = ExitCode.ACCESS_DENIED

    def __init__(self, pid: int, what: str = "trace", why: str = ""):
        super().__init__(pid, f"not permitted to {what} process {pid}" + (f" ({why})" if why else ""))
        self.what = what


class OwnAncestor(AccessDenied):
    """The target is an ancestor of ptckpt: its tree holds ptckpt, which cannot trace itself."""

    def __init__(self, pid: int, name: str, how: str):
        ProcessError.__init__(self, pid, f"process {pid} ({name}) is ptckpt's own ancestor ({how}): a dump "
                                         f"takes its whole tree, ptckpt included, so it cannot be dumped "
                                         f"from inside; run ptckpt from another shell")
        self.what = "dump"
        self.name = name


class AlreadyTraced(ProcessError):
    exit_code = ExitCode.ALREADY_TRACED

    def __init__(self, pid: int, tracer_pid: int, tracer_name: str):
        super().__init__(
            pid,
            f"process {pid} is already traced by {tracer_pid} ({tracer_name})",
        )
        self.tracer_pid = tracer_pid
        self.tracer_name = tracer_name


class KernelThread(ProcessError):
    exit_code = ExitCode.KERNEL_THREAD

    def __init__(self, pid: int, name: str):
        super().__init__(pid, f"process {pid} ({name}) is a kernel thread and cannot be checkpointed")
        self.name = name


class RemoteSyscallError(ProcessError):
    """An injected syscall returned an error."""

    exit_code = ExitCode.REMOTE_SYSCALL

    def __init__(self, pid: int, name: str, args: tuple[int, ...], err: int,
                 step: str | None = None, detail: str = ""):
        args_text = ", ".join(hex(a) if a > 9 else str(a) for a in args)
        where = f"{step}: " if step else ""
        errname = _errno.errorcode.get(err, str(err))
        msg = (f"{where}injected {name}({args_text}) in {pid} failed: "
               f"{errname} ({os.strerror(err)})")
        if detail:
            msg += f" [{detail}]"
        super().__init__(pid, msg)
        self.name = name
        self.args_ = args
        self.errno = err
        self.step = step


class TraceeError(ProcessError):
    """A ptrace request failed in a way none of the classes above describes."""

    exit_code = ExitCode.INTERNAL


# --- image errors ----------------------------------------------------------

class ImageError(PtckptError):
    """Base for problems with an image directory or file."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


class NotAnImage(ImageError):
    exit_code = ExitCode.NOT_AN_IMAGE

    def __init__(self, path: str, reason: str = "not a ptckpt image"):
        super().__init__(path, f"{path}: {reason}")


class ImageAccessDenied(ImageError):
    exit_code = ExitCode.ACCESS_DENIED

    def __init__(self, path: str, owner: int | None = None):
        whose = f" (it belongs to uid {owner})" if owner is not None else ""
        super().__init__(path, f"{path}: permission denied{whose}: an image is readable by "
                               f"its owner only, who may restore it or give it to you")


class BadMagic(ImageError):
    exit_code = ExitCode.CORRUPT_IMAGE

    def __init__(self, path: str, found: bytes):
        super().__init__(path, f"{path}: bad magic {found!r}, not a ptckpt image file")
        self.found = found


class CorruptImage(ImageError):
    exit_code = ExitCode.CORRUPT_IMAGE

    def __init__(self, path: str, reason: str):
        super().__init__(path, f"{path}: corrupt image: {reason}")
        self.reason = reason


class ParentMissing(CorruptImage):
    """An incremental image whose parent image is gone or is another image."""

    def __init__(self, path: str, parent: str, why: str):
        ImageError.__init__(self, path, f"{path}: an incremental image whose parent {parent} "
                                        f"cannot be used: {why}")
        self.reason, self.parent = why, parent


class UnsupportedVersion(ImageError):
    exit_code = ExitCode.UNSUPPORTED_VERSION

    def __init__(self, path: str, found: int, supported: int):
        super().__init__(
            path,
            f"{path}: image format version {found} is newer than this ptckpt "
            f"understands (up to {supported}); upgrade ptckpt",
        )
        self.found = found
        self.supported = supported


class DestinationExists(ImageError):
    exit_code = ExitCode.DESTINATION_EXISTS

    def __init__(self, path: str, what: str = "exists and is not empty"):
        super().__init__(path, f"{path} {what}; choose another -D directory")


class ImageWriteError(ImageError):
    exit_code = ExitCode.IO_ERROR

    def __init__(self, path: str, err: OSError):
        super().__init__(path, f"cannot write image {path}: {err.strerror or err}")
        self.errno = err.errno


class OutputError(PtckptError):
    """A file ptckpt writes besides images (a core file ...) could not be written."""

    exit_code = ExitCode.IO_ERROR

    def __init__(self, path: str, err: OSError):
        super().__init__(f"cannot write {path}: {err.strerror or err}")
        self.path = path
        self.errno = err.errno


# --- resources and environment ---------------------------------------------

class UnsupportedResource(PtckptError):
    """Process `pid` holds `what`, which ptckpt cannot dump or restore.

    The message reads "process PID: WHAT is not supported", then ": WHY" (what would go
    wrong) and "; WAY_OUT" (what the user can do instead) when given: give a refusal
    with a way out as the three parts rather than one sentence in `what`, which the
    words "is not supported" would end in the middle."""

    exit_code = ExitCode.UNSUPPORTED_RESOURCE

    def __init__(self, pid: int, what: str, why: str = "", way_out: str = ""):
        super().__init__(f"process {pid}: {what} is not supported" + (f": {why}" if why else "")
                         + (f"; {way_out}" if way_out else ""))
        self.pid = pid
        self.what = what
        self.why = why
        self.way_out = way_out


class ConnectionNotAllowed(PtckptError):
    """An established TCP connection that the dump was not asked to take (--tcp-established)."""

    exit_code = ExitCode.CONNECTION

    def __init__(self, pid: int, fd: int, connection: str, why: str = ""):
        super().__init__(f"process {pid} fd {fd}: TCP connection {connection}{why} is dumped only with "
                         f"--tcp-established; or --tcp-close (it comes back closed) or --external fd:{fd} "
                         f"(re-made at restore: --reconnect or a plugin)")
        self.pid = pid
        self.fd = fd
        self.connection = connection


class SharedOutside(PtckptError):
    """A member shares a pipe or socket with a process outside the dumped tree (dump)."""

    exit_code = ExitCode.UNSUPPORTED_RESOURCE

    def __init__(self, pid: int, fd: int, what: str, peer: str,
                 way_out: str = "dump the common ancestor, or end the connection first"):
        super().__init__(f"process {pid} fd {fd} ({what}) is connected outside the tree: {peer}; {way_out}")
        self.pid = pid
        self.fd = fd
        self.what = what
        self.peer = peer


class PluginError(PtckptError):
    """A plugin could not be loaded, or one of its events failed (named)."""

    exit_code = ExitCode.PLUGIN

    def __init__(self, plugin: str, event: str, reason: str):
        super().__init__(f"plugin {plugin}: {event}: {reason}")
        self.plugin = plugin
        self.event = event
        self.reason = reason


class PluginMissing(PtckptError):
    """The image was made with a plugin that this restore has not loaded."""

    exit_code = ExitCode.PLUGIN

    def __init__(self, name: str, version: str):
        super().__init__(f"the image needs plugin {name} (version {version}), which is not loaded; "
                         f"give it with --plugin module:Class or a file path")
        self.name = name
        self.version = version


class PrivilegeNeeded(PtckptError):
    """What was asked needs a capability the user lacks (named, with the way that needs none)."""

    exit_code = ExitCode.ACCESS_DENIED


class PidBusy(PtckptError):
    """A pid the image needs is held by another process (restore)."""

    exit_code = ExitCode.PID_BUSY

    def __init__(self, pid: int, holder: str):
        super().__init__(f"pid {pid} is taken by {holder}; stop it, or restore with --pidns "
                         "into a fresh pid namespace")
        self.pid = pid
        self.holder = holder


class RestoreFailed(PtckptError):
    """A restore step failed after the process was created (it has been killed)."""

    exit_code = ExitCode.REMOTE_SYSCALL


class Incompatible(PtckptError):
    """This machine (CPU, kernel) cannot run what the image holds."""

    exit_code = ExitCode.INCOMPATIBLE


class CriticalSection(ProcessError):
    """The program stayed inside a critical section (ptckpt.app / ptckpt.h) past the timeout."""

    exit_code = ExitCode.CRITICAL_SECTION

    def __init__(self, pid: int, section: str, timeout: float):
        super().__init__(pid, f"process {pid} stayed in critical section {section!r} for {timeout:g} s: not dumped, "
                              f"it runs on (a longer --critical-timeout waits more)")
        self.section = section


class TransferError(PtckptError):
    """An image sent to (or a restore asked of) a page server did not get there."""

    exit_code = ExitCode.TRANSFER


class PagesOnServer(UsageError):
    """An image whose memory pages a dump sent to a page server (dump --page-server) was
    asked for them, but the restore was not told where that server is."""

    def __init__(self, image: str, address: str, path: str):
        super().__init__(f"{image}: its memory pages are on the page server it was dumped to ({address}, "
                         f"as {path} there): restore with --page-server ADDRESS (and --lazy to take them "
                         f"as they are touched)")
        self.image, self.address, self.path = image, address, path


class ReferenceFailed(PtckptError):
    """A campaign's reference run (no faults) did not succeed, so no run can be judged.

    When the restore itself failed, the exit code is that restore's own (read from the
    run's exit status: 15 for files changed under a strict --file-policy ...); when the
    program failed, crashed or hung, REFERENCE_FAILED."""

    exit_code = ExitCode.REFERENCE_FAILED

    def __init__(self, why: str, directory: str, restore_code: int | None = None):
        super().__init__(f"the reference run (no faults) did not succeed: {why}; its output is in {directory} "
                         f"(stdout, stderr); run the campaign again once fixed (-o is reused)")
        self.why, self.directory = why, directory
        if restore_code is not None:
            self.exit_code = restore_code


class GroupFailed(PtckptError):
    """A member of a group dump or restore failed: which (WORKER:PID), at what phase, why,
    and what became of the others (resumed as they were, or killed)."""

    exit_code = ExitCode.GROUP_FAILED

    def __init__(self, operation: str, member: str, phase: str, why: str, others: str):
        at = f" at {phase}" if phase else ""
        super().__init__(f"group {operation} failed: member {member} failed{at}: {why}; {others}")
        self.operation, self.member, self.phase, self.why, self.others = operation, member, phase, why, others


class ControlError(PtckptError):
    """`ptckpt control`: the run cannot be found or does not answer."""

    exit_code = ExitCode.CONTROL


# --- one choke point per layer ---------------------------------------------------

class OSErrorTranslator:
    """How a layer turns an OSError into its own errors: `unavailable` (built as
    cls(what, "<unavailable_text> (<reason>)", errno)) for the errnos that mean the kernel
    cannot or will not, `error` (cls(what, reason, errno)) for the others.  Its `wrap(what)`
    decorator is the choke point on a layer's public functions."""

    def __init__(self, error: type, unavailable: type, errnos: frozenset[int], unavailable_text: str):
        self.error, self.unavailable = error, unavailable
        self.errnos, self.unavailable_text = errnos, unavailable_text

    def translate(self, err: OSError, what: str, errnos: frozenset[int] | None = None) -> PtckptError:
        reason = err.strerror or str(err) or type(err).__name__
        if err.errno in (self.errnos if errnos is None else errnos):
            return self.unavailable(what, f"{self.unavailable_text} ({reason})", err.errno)
        return self.error(what, reason, err.errno)

    def wrap(self, what: str, errnos: frozenset[int] | None = None):
        import functools

        def decorate(fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                try:
                    return fn(*args, **kwargs)
                except OSError as err:
                    raise self.translate(err, what, errnos) from err
            return wrapper
        return decorate


def exhausted(err: BaseException) -> str | None:
    """What ran out, with the way out, when `err` (or what caused it) is a resource running
    out: too many open files (ptckpt's or the system's), memory, processes.  None otherwise."""
    seen = 0
    while err is not None and seen < 8:
        code = getattr(err, "errno", None)
        name = getattr(err, "name", "")
        if code in (_errno.EMFILE, _errno.ENFILE, _errno.ENOMEM) or (
                code == _errno.EAGAIN and (name in ("clone", "clone3", "fork", "vfork")
                                           or type(err) is BlockingIOError)):   # os.fork, clone3
            break
        err = err.__cause__ or err.__context__
        seen += 1
    else:
        return None
    if err is None:
        return None
    if code == _errno.EMFILE:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (f"out of open files: ptckpt may hold {soft} (RLIMIT_NOFILE {soft}/{hard}); raise the "
                f"limit (ulimit -n) and try again")
    if code == _errno.ENFILE:
        return "the system's table of open files is full (fs.file-max); close files and try again"
    if code == _errno.ENOMEM:
        return ("out of memory (the machine's, or the memory cgroup's limit); free memory or "
                "raise the limit and try again")
    return ("no more processes may be made (RLIMIT_NPROC, the pids cgroup's pids.max, or "
            "kernel.pid_max); raise the limit and try again")

"""System V IPC objects (shared memory, semaphore sets, message queues): dump and restore.

Everything here works on the IPC namespace of the calling process, through
libc (ctypes) and /proc; nothing is injected into a tracee except by
:func:`attach_shm_frozen`.

Dump half: :func:`list_shm`, :func:`list_sem`, :func:`list_msg` parse
/proc/sysvipc/*; :func:`used_by` picks the objects a process tree uses;
:func:`dump_shm`, :func:`dump_sem`, :func:`dump_msg` read one object into an
image record.  Reading is non-destructive: message queues are copied with
``msgrcv(MSG_COPY)`` (needs CONFIG_CHECKPOINT_RESTORE), segments are read
through a read-only attach of our own.

Restore half: :func:`restore_shm`, :func:`restore_sem`, :func:`restore_msg`
make the object exist again with the same id, key, contents, permission
bits, owner and creator.  A free id is obtained by writing it to
/proc/sys/kernel/{shm,sem,msg}_next_id just before the ``*get(IPC_CREAT |
IPC_EXCL)``; the id obtained is checked.  The kernel uses the value once and
sets it back to -1 itself; the sysctl refuses -1 (its range is 0..INT_MAX),
so when the ``*get`` failed before using it, a throwaway private object
uses it up (:func:`_clear_next_id`).  An object that already has the image's id
*and* key is taken to be the original, which survived the checkpointed
processes (SysV objects outlive them, e.g. after ``dump --kill``): it is
reused and its contents are set back to the checkpoint (segment bytes
rewritten, semaphore values SETALL, queue emptied and refilled), because a
restart must begin from the checkpointed state, not from whatever happened
afterwards.

What cannot be restored (the kernel offers no way to set it): the pid and
time fields (cpid/lpid, sempid, lspid/lrpid, *time), a semaphore's waiters
and per-process SEM_UNDO adjustments (SETALL clears them), SHM_HUGETLB
(segments come back with normal pages).  The dump itself changes a
segment's lpid, atime and dtime (its own shmat/shmdt); the images keep the
values read before that.

Errors: a failed libc call raises ``_CallFailed`` (an OSError) internally;
every public function translates it at one choke point, :func:`_naming`,
into :class:`SysvIpcError` subclasses (dump) or :class:`IpcRestoreFailed`
subclasses (restore), with a message naming the object.

Struct layouts are those of the x86_64 kernel ABI (ipc64_perm, shmid64_ds,
semid64_ds, msqid64_ds of arch/x86/include/uapi/asm and
include/uapi/asm-generic), which glibc passes through unchanged there.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import errno as _errno
import functools
import os
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from .. import procfs
from ..errors import ExitCode, PtckptError, RestoreFailed
from ..formats.model import MsgImage, SemImage, ShmImage

# --- constants (include/uapi/linux/ipc.h, shm.h, sem.h, msg.h) ---------------

IPC_PRIVATE = 0
IPC_CREAT = 0o1000
IPC_EXCL = 0o2000
IPC_NOWAIT = 0o4000
IPC_RMID = 0
IPC_SET = 1
IPC_STAT = 2

SHM_RDONLY = 0o10000       # shmat: attach read-only
SHM_RND = 0o20000
SHM_REMAP = 0o40000        # shmat: replace what is mapped at the address
SHM_EXEC = 0o100000        # shmat: executable mapping
SHM_LOCK = 11              # shmctl commands
SHM_UNLOCK = 12
SHM_DEST = 0o1000          # shm_perm.mode: IPC_RMID done while still attached
SHM_LOCKED = 0o2000        # shm_perm.mode: SHM_LOCK in force

GETPID = 11                # semctl commands
GETVAL = 12
GETALL = 13
SETALL = 17

MSG_NOERROR = 0o10000
MSG_COPY = 0o40000         # msgrcv: copy message number msgtyp, leave it queued

S_IRWXUGO = 0o777
_MAX_SNAPSHOT_TRIES = 3


class IpcKind(enum.Enum):
    """The three object kinds; the value names their /proc/sysvipc file and *_next_id sysctl."""

    SHM = "shm"
    SEM = "sem"
    MSG = "msg"

    @property
    def noun(self) -> str:
        """Human name used in messages."""
        return {"shm": "shared memory segment", "sem": "semaphore set",
                "msg": "message queue"}[self.value]

    @property
    def id_name(self) -> str:
        """What the kernel calls the id of this kind (shmid, semid, msqid)."""
        return {"shm": "shmid", "sem": "semid", "msg": "msqid"}[self.value]

    @property
    def next_id_path(self) -> str:
        return f"/proc/sys/kernel/{self.value}_next_id"


# --- errors ------------------------------------------------------------------

def _key_text(key: int) -> str:
    """A key as ipcs shows it: 0x-hex of the 32-bit value, or IPC_PRIVATE."""
    return "IPC_PRIVATE" if key == IPC_PRIVATE else f"{key & 0xFFFFFFFF:#010x}"


def _object_text(kind: IpcKind, ipc_id: int | None, key: int | None) -> str:
    """'message queue msqid 3 (key 0x0000abcd)'; the parts not known are left out."""
    if ipc_id is None:
        return f"{kind.noun} with key {_key_text(key)}" if key is not None else f"{kind.noun}s"
    if key is None:
        return f"{kind.noun} {kind.id_name} {ipc_id}"
    return f"{kind.noun} {kind.id_name} {ipc_id} (key {_key_text(key)})"


def _errno_text(err: int) -> str:
    return f"{_errno.errorcode.get(err, str(err))} ({os.strerror(err)})"


class _NamesObject:
    """What every SysV IPC error carries: the object (kind, id, key) and the errno."""

    def __init__(self, kind: IpcKind, ipc_id: int | None, key: int | None, message: str,
                 err: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.ipc_id = ipc_id
        self.key = key
        self.errno = err


class SysvIpcError(_NamesObject, PtckptError):
    """A System V IPC object could not be listed or read (dump side)."""


class IpcObjectGone(SysvIpcError):
    """The object was removed between listing it and reading it."""

    exit_code = ExitCode.TARGET_VANISHED


class IpcAccessDenied(SysvIpcError):
    """Not permitted to read the object (or to use MSG_COPY / the *_next_id sysctls)."""

    exit_code = ExitCode.ACCESS_DENIED


class IpcRestoreFailed(_NamesObject, RestoreFailed):
    """Re-creating or refilling an object failed."""


class IpcIdTaken(IpcRestoreFailed):
    """The image's id is held by an object with another key."""

    def __init__(self, kind: IpcKind, ipc_id: int, key: int, holder_id: int, holder_key: int):
        where = (f"id {ipc_id}" if holder_id == ipc_id
                 else f"the slot of id {ipc_id} (as {kind.id_name} {holder_id})")
        super().__init__(kind, ipc_id, key,
                         f"cannot restore {_object_text(kind, ipc_id, key)}: {where} is taken by "
                         f"another {kind.noun} with key {_key_text(holder_key)}; remove it "
                         f"(ipcrm) or restore into a fresh IPC namespace")
        self.holder_id = holder_id
        self.holder_key = holder_key


class IpcKeyTaken(IpcRestoreFailed):
    """The image's key is held by an object with another id."""

    def __init__(self, kind: IpcKind, ipc_id: int, key: int, holder_id: int):
        super().__init__(kind, ipc_id, key,
                         f"cannot restore {_object_text(kind, ipc_id, key)}: key "
                         f"{_key_text(key)} is used by {kind.id_name} {holder_id}; remove it "
                         f"(ipcrm) or restore into a fresh IPC namespace")
        self.holder_id = holder_id


class _CallFailed(OSError):
    """A libc call or /proc write failed; ``call`` says which (internal, see _naming)."""

    def __init__(self, err: int, call: str):
        super().__init__(err, os.strerror(err))
        self.call = call


@contextlib.contextmanager
def _naming(kind: IpcKind, ipc_id: int | None, key: int | None, *,
            restoring: bool) -> Iterator[None]:
    """The choke point: _CallFailed inside becomes a ptckpt error naming the object."""
    try:
        yield
    except _CallFailed as err:
        raise _translate(err, kind, ipc_id, key, restoring) from err


def _translate(err: _CallFailed, kind: IpcKind, ipc_id: int | None, key: int | None,
               restoring: bool) -> PtckptError:
    """The ptckpt error for a failed call on one object."""
    what = _object_text(kind, ipc_id, key)
    if restoring:
        return IpcRestoreFailed(kind, ipc_id if ipc_id is not None else -1,
                                key if key is not None else IPC_PRIVATE,
                                f"cannot restore {what}: {err.call} failed: "
                                f"{_errno_text(err.errno)}", err.errno)
    message = f"cannot read {what}: {err.call} failed: {_errno_text(err.errno)}"
    if err.errno in (_errno.EINVAL, _errno.EIDRM) and err.call.split("(")[0] in _ID_CALLS:
        return IpcObjectGone(kind, ipc_id, key, f"{what} was removed while being dumped "
                             f"({err.call}: {_errno_text(err.errno)})", err.errno)
    if err.errno in (_errno.EACCES, _errno.EPERM):
        return IpcAccessDenied(kind, ipc_id, key, message, err.errno)
    return SysvIpcError(kind, ipc_id, key, message, err.errno)


# --- libc --------------------------------------------------------------------

_c = ctypes
# name -> (restype, argtypes).  semctl is variadic; its union semun argument is
# passed as one integer register on x86_64, so a fixed c_ulong is the same call.
_PROTOTYPES = {
    "shmget": (_c.c_int, [_c.c_int, _c.c_size_t, _c.c_int]),
    "shmat": (_c.c_ssize_t, [_c.c_int, _c.c_void_p, _c.c_int]),
    "shmdt": (_c.c_int, [_c.c_void_p]),
    "shmctl": (_c.c_int, [_c.c_int, _c.c_int, _c.c_void_p]),
    "semget": (_c.c_int, [_c.c_int, _c.c_int, _c.c_int]),
    "semctl": (_c.c_int, [_c.c_int, _c.c_int, _c.c_int, _c.c_ulong]),
    "msgget": (_c.c_int, [_c.c_int, _c.c_int]),
    "msgsnd": (_c.c_int, [_c.c_int, _c.c_void_p, _c.c_size_t, _c.c_int]),
    "msgrcv": (_c.c_ssize_t, [_c.c_int, _c.c_void_p, _c.c_size_t, _c.c_long, _c.c_int]),
    "msgctl": (_c.c_int, [_c.c_int, _c.c_int, _c.c_void_p]),
}
# Calls whose EINVAL/EIDRM means "no object with this id" (not "bad argument").
_ID_CALLS = frozenset({"shmat", "shmctl", "semctl", "msgctl", "msgrcv"})


@functools.cache
def _func(name: str) -> Callable[..., int]:
    """The libc function `name`, with its prototype (bound on first use)."""
    fn = getattr(_libc(), name)
    fn.restype, fn.argtypes = _PROTOTYPES[name]
    return fn


@functools.cache
def _libc() -> ctypes.CDLL:
    """Our own handle on libc, so these prototypes clash with nobody's."""
    return ctypes.CDLL(None, use_errno=True)


def _sys(name: str, *args, call: str | None = None) -> int:
    """Call libc `name`; -1 raises _CallFailed naming `call` (default: the function name)."""
    res = _func(name)(*args)
    if res == -1:
        raise _CallFailed(ctypes.get_errno(), call or name)
    return res


def _addr(buf: ctypes.Array | ctypes.Structure) -> int:
    return ctypes.addressof(buf)


# --- kernel structs (x86_64) -------------------------------------------------

class _IpcPerm(ctypes.Structure):
    """struct ipc64_perm (include/uapi/asm-generic/ipcbuf.h)."""

    _fields_ = [("key", _c.c_int), ("uid", _c.c_uint), ("gid", _c.c_uint),
                ("cuid", _c.c_uint), ("cgid", _c.c_uint), ("mode", _c.c_uint),
                ("seq", _c.c_ushort), ("_pad2", _c.c_ushort),
                ("_unused1", _c.c_ulong), ("_unused2", _c.c_ulong)]


class _ShmidDs(ctypes.Structure):
    """struct shmid64_ds (arch/x86/include/uapi/asm/shmbuf.h, 64-bit)."""

    _fields_ = [("perm", _IpcPerm), ("segsz", _c.c_size_t), ("atime", _c.c_long),
                ("dtime", _c.c_long), ("ctime", _c.c_long), ("cpid", _c.c_int),
                ("lpid", _c.c_int), ("nattch", _c.c_ulong),
                ("_unused4", _c.c_ulong), ("_unused5", _c.c_ulong)]


class _SemidDs(ctypes.Structure):
    """struct semid64_ds (arch/x86/include/uapi/asm/sembuf.h, 64-bit)."""

    _fields_ = [("perm", _IpcPerm), ("otime", _c.c_long), ("_unused1", _c.c_ulong),
                ("ctime", _c.c_long), ("_unused2", _c.c_ulong), ("nsems", _c.c_ulong),
                ("_unused3", _c.c_ulong), ("_unused4", _c.c_ulong)]


class _MsqidDs(ctypes.Structure):
    """struct msqid64_ds (include/uapi/asm-generic/msgbuf.h, 64-bit)."""

    _fields_ = [("perm", _IpcPerm), ("stime", _c.c_long), ("rtime", _c.c_long),
                ("ctime", _c.c_long), ("cbytes", _c.c_ulong), ("qnum", _c.c_ulong),
                ("qbytes", _c.c_ulong), ("lspid", _c.c_int), ("lrpid", _c.c_int),
                ("_unused4", _c.c_ulong), ("_unused5", _c.c_ulong)]


assert (ctypes.sizeof(_IpcPerm), ctypes.sizeof(_ShmidDs), ctypes.sizeof(_SemidDs),
        ctypes.sizeof(_MsqidDs)) == (48, 112, 104, 120)


def _shm_stat(shmid: int) -> _ShmidDs:
    buf = _ShmidDs()
    _sys("shmctl", shmid, IPC_STAT, _addr(buf), call="shmctl(IPC_STAT)")
    return buf


def _sem_stat(semid: int) -> _SemidDs:
    buf = _SemidDs()
    _sys("semctl", semid, 0, IPC_STAT, _addr(buf), call="semctl(IPC_STAT)")
    return buf


def _msg_stat(msqid: int) -> _MsqidDs:
    buf = _MsqidDs()
    _sys("msgctl", msqid, IPC_STAT, _addr(buf), call="msgctl(IPC_STAT)")
    return buf


_STAT = {IpcKind.SHM: _shm_stat, IpcKind.SEM: _sem_stat, IpcKind.MSG: _msg_stat}


def _stat_or_none(kind: IpcKind, ipc_id: int) -> ctypes.Structure | None:
    """IPC_STAT of the object with this id, or None if there is none (EINVAL/EIDRM)."""
    try:
        return _STAT[kind](ipc_id)
    except _CallFailed as err:
        if err.errno in (_errno.EINVAL, _errno.EIDRM):
            return None
        raise


# --- listing: /proc/sysvipc ----------------------------------------------------

@dataclass(frozen=True, slots=True)
class ShmSegment:
    """One line of /proc/sysvipc/shm (ipc/shm.c, sysvipc_shm_proc_show).

    ``perms`` is shm_perm.mode as printed: the permission bits plus SHM_DEST
    (0o1000) and SHM_LOCKED (0o2000).  pids are in the reader's pid
    namespace, times in seconds since the epoch (0: never).
    """

    key: int
    shmid: int
    perms: int
    size: int
    cpid: int
    lpid: int
    nattch: int
    uid: int
    gid: int
    cuid: int
    cgid: int
    atime: int = 0
    dtime: int = 0
    ctime: int = 0
    rss: int = 0          # bytes
    swap: int = 0         # bytes

    @property
    def mode(self) -> int:
        """The permission bits alone."""
        return self.perms & S_IRWXUGO

    @property
    def destroyed(self) -> bool:
        """IPC_RMID was done while attached: it goes away at the last detach."""
        return bool(self.perms & SHM_DEST)

    @property
    def locked(self) -> bool:
        return bool(self.perms & SHM_LOCKED)


@dataclass(frozen=True, slots=True)
class SemSet:
    """One line of /proc/sysvipc/sem (ipc/sem.c, sysvipc_sem_proc_show); no pids there."""

    key: int
    semid: int
    perms: int
    nsems: int
    uid: int
    gid: int
    cuid: int
    cgid: int
    otime: int = 0        # last semop
    ctime: int = 0

    @property
    def mode(self) -> int:
        return self.perms & S_IRWXUGO


@dataclass(frozen=True, slots=True)
class MsgQueue:
    """One line of /proc/sysvipc/msg (ipc/msg.c, sysvipc_msg_proc_show)."""

    key: int
    msqid: int
    perms: int
    cbytes: int           # bytes of message text queued
    qnum: int             # messages queued
    lspid: int            # last msgsnd
    lrpid: int            # last msgrcv (MSG_COPY does not count)
    uid: int
    gid: int
    cuid: int
    cgid: int
    stime: int = 0
    rtime: int = 0
    ctime: int = 0

    @property
    def mode(self) -> int:
        return self.perms & S_IRWXUGO


_Row = TypeVar("_Row", ShmSegment, SemSet, MsgQueue)


def _parse_table(kind: IpcKind, text: str, cls: type[_Row]) -> list[_Row]:
    """Rows of a /proc/sysvipc file as `cls`, by the header's column names.

    Columns the class does not know are ignored; ``perms`` is octal, every
    other column decimal.  A missing required column raises SysvIpcError.
    """
    lines = text.splitlines()
    if not lines:
        return []
    header = lines[0].split()
    known = {f.name for f in dataclasses.fields(cls)}
    rows = []
    for line in lines[1:]:
        words = line.split()
        if not words:
            continue
        values = {name: int(word, 8 if name == "perms" else 10)
                  for name, word in zip(header, words) if name in known}
        try:
            rows.append(cls(**values))
        except TypeError as err:
            raise SysvIpcError(kind, None, None,
                               f"/proc/sysvipc/{kind.value}: unexpected columns {header}: {err}")
    return rows


def _read_table(kind: IpcKind, cls: type[_Row], procfs_root: str) -> list[_Row]:
    path = f"{procfs_root}/sysvipc/{kind.value}"
    try:
        text = procfs.read_sysvipc(kind.value, procfs=procfs_root)
    except FileNotFoundError as err:
        raise SysvIpcError(kind, None, None, f"cannot list {kind.noun}s: {path} does not exist "
                           "(kernel without CONFIG_SYSVIPC?)", err.errno) from err
    except OSError as err:
        raise SysvIpcError(kind, None, None, f"cannot list {kind.noun}s: {path}: "
                           f"{err.strerror or err}", err.errno) from err
    return _parse_table(kind, text, cls)


def list_shm(*, procfs_root: str = "/proc") -> list[ShmSegment]:
    """Every shared memory segment of our IPC namespace, from /proc/sysvipc/shm."""
    return _read_table(IpcKind.SHM, ShmSegment, procfs_root)


def list_sem(*, procfs_root: str = "/proc") -> list[SemSet]:
    """Every semaphore set of our IPC namespace, from /proc/sysvipc/sem."""
    return _read_table(IpcKind.SEM, SemSet, procfs_root)


def list_msg(*, procfs_root: str = "/proc") -> list[MsgQueue]:
    """Every message queue of our IPC namespace, from /proc/sysvipc/msg."""
    return _read_table(IpcKind.MSG, MsgQueue, procfs_root)


# --- which objects a tree uses -------------------------------------------------

def mapped_shmids(pid: int, *, procfs_root: str = "/proc") -> set[int]:
    """Shmids of the SysV segments `pid` has attached.

    Such a mapping shows in /proc/PID/maps as "/SYSV<key, 8 hex digits>
    (deleted)" and its inode column is the shmid (ipc/shm.c, newseg).
    """
    return {m.inode for m in procfs.read_maps(pid, procfs=procfs_root)
            if m.path.startswith("/SYSV")}


def sem_pids(semid: int) -> tuple[int, ...]:
    """sempid of each semaphore of the set (semctl GETPID): the last process that
    changed it with semop, SETVAL or SETALL; 0 if none ever did."""
    with _naming(IpcKind.SEM, semid, None, restoring=False):
        nsems = _sem_stat(semid).nsems
        return tuple(_sys("semctl", semid, i, GETPID, 0, call=f"semctl({i}, GETPID)")
                     for i in range(nsems))


def used_by(pids: set[int], sysv_shmids: set[int], *, procfs_root: str = "/proc"
            ) -> tuple[list[ShmSegment], list[SemSet], list[MsgQueue]]:
    """The SysV objects of our IPC namespace that the processes `pids` use (a heuristic).

    The kernel records no users of an object, only its creator and the last
    operator, so:

    * shared memory: segments whose shmid is in `sysv_shmids` (the caller
      collects them from the tree's maps, see :func:`mapped_shmids`: this
      is exact for attached segments), plus those whose cpid (creator) or
      lpid (last shmat/shmdt) is in `pids` (created or detached but kept);
    * semaphore sets: /proc/sysvipc/sem has no pid column; a set counts when
      the sempid (semctl GETPID: last semop/SETVAL/SETALL) of any of its
      semaphores is in `pids`.  A set the tree created but never operated
      on, or only waits on, is missed (the kernel keeps no creator pid, and
      sem_otime is a time, not a pid); neither are SEM_UNDO lists visible;
    * message queues: lspid (last msgsnd) or lrpid (last msgrcv) in `pids`.
      A queue the tree only created, or last used before another process
      did, is missed.

    Sets and queues removed while we look are skipped, and so are sets the dumper may not
    read (a user's dump meeting root's sets: the tree, whose rights a dumper without
    privileges shares, cannot use them either).  Each list is sorted by id.
    Note that dumping a segment makes the dumper its lpid.
    """
    shms = [s for s in list_shm(procfs_root=procfs_root)
            if s.shmid in sysv_shmids or s.cpid in pids or s.lpid in pids]
    sems = []
    for s in list_sem(procfs_root=procfs_root):
        try:
            if pids.intersection(sem_pids(s.semid)):
                sems.append(s)
        except IpcObjectGone:
            continue
        except IpcAccessDenied:
            if os.geteuid() == 0:
                raise                            # root reads every set: something else is wrong
            continue
    msgs = [q for q in list_msg(procfs_root=procfs_root) if q.lspid in pids or q.lrpid in pids]
    return (sorted(shms, key=lambda s: s.shmid), sorted(sems, key=lambda s: s.semid),
            sorted(msgs, key=lambda q: q.msqid))


# --- images --------------------------------------------------------------------

# ShmImage, SemImage and MsgImage are image records: formats/model.py.


# --- dump ----------------------------------------------------------------------

def _read_segment(shmid: int, size: int) -> bytes:
    """The first `size` bytes of a segment, through a read-only attach of ours.

    Reading faults in every page (shmem allocates a page even for a read of
    a hole), so a sparse segment becomes fully resident.
    """
    addr = _sys("shmat", shmid, None, SHM_RDONLY, call="shmat(SHM_RDONLY)")
    try:
        return ctypes.string_at(addr, size)
    finally:
        _sys("shmdt", addr, call="shmdt")


def dump_used_frozen(images: dict) -> list:
    """The System V IPC objects a frozen tree ({pid: ProcessImage}) uses: segments it has
    attached or made, semaphore sets and message queues it operated on last (used_by),
    with their contents."""
    shmids = {v.inode for im in images.values() for v in im.vmas if v.path.startswith("/SYSV")}
    shms, sems, msgs = used_by(set(images), shmids)     # before our own attach changes lpid
    return [dump_shm(s) for s in shms] + [dump_sem(s) for s in sems] + [dump_msg(q) for q in msgs]


def dump_shm(seg: ShmSegment) -> ShmImage:
    """Attributes (IPC_STAT) and contents of a segment.  It may be marked destroyed
    (Linux allows attaching such a segment); its lpid/atime/dtime change."""
    with _naming(IpcKind.SHM, seg.shmid, seg.key, restoring=False):
        st = _shm_stat(seg.shmid)
        data = _read_segment(seg.shmid, st.segsz)
    p = st.perm
    return ShmImage(key=p.key, shmid=seg.shmid, perms=p.mode & S_IRWXUGO, size=st.segsz,
                    uid=p.uid, gid=p.gid, cuid=p.cuid, cgid=p.cgid, cpid=st.cpid,
                    lpid=st.lpid, nattch=st.nattch, atime=st.atime, dtime=st.dtime,
                    ctime=st.ctime, destroyed=bool(p.mode & SHM_DEST),
                    locked=bool(p.mode & SHM_LOCKED), data=data)


def dump_sem(sem: SemSet) -> SemImage:
    """Attributes (IPC_STAT), values (GETALL) and sempids (GETPID) of a semaphore set."""
    with _naming(IpcKind.SEM, sem.semid, sem.key, restoring=False):
        st = _sem_stat(sem.semid)
        values = (ctypes.c_ushort * st.nsems)()
        _sys("semctl", sem.semid, 0, GETALL, _addr(values), call="semctl(GETALL)")
        pids = tuple(_sys("semctl", sem.semid, i, GETPID, 0, call=f"semctl({i}, GETPID)")
                     for i in range(st.nsems))
    p = st.perm
    return SemImage(key=p.key, semid=sem.semid, perms=p.mode & S_IRWXUGO, uid=p.uid,
                    gid=p.gid, cuid=p.cuid, cgid=p.cgid, values=tuple(values), pids=pids,
                    otime=st.otime, ctime=st.ctime)


def _msgmax() -> int:
    """kernel.msgmax: the largest message (and the most MSG_COPY copies into a buffer)."""
    try:
        return int(procfs.read_sysctl("kernel/msgmax"))
    except (OSError, ValueError):
        return 8192


def _msg_buffer(size: int) -> ctypes.Array:
    """A struct msgbuf for `size` bytes of text (a long mtype, then mtext)."""
    return ctypes.create_string_buffer(ctypes.sizeof(ctypes.c_long) + size)


def _copy_message(msqid: int, index: int, buf: ctypes.Array) -> tuple[int, bytes] | None:
    """Message number `index` of the queue, left queued (MSG_COPY); None past the end."""
    size = len(buf) - ctypes.sizeof(ctypes.c_long)
    try:
        n = _sys("msgrcv", msqid, _addr(buf), size, index, MSG_COPY | IPC_NOWAIT,
                 call=f"msgrcv({index}, MSG_COPY)")
    except _CallFailed as err:
        if err.errno == _errno.ENOMSG:
            return None
        raise
    mtype = ctypes.c_long.from_buffer(buf).value
    return mtype, buf.raw[ctypes.sizeof(ctypes.c_long):ctypes.sizeof(ctypes.c_long) + n]


def _copy_queue(msqid: int, largest: int) -> tuple[tuple[int, bytes], ...]:
    """Every message of the queue in order, none consumed.

    The buffer starts at `largest` bytes and grows to kernel.msgmax on
    E2BIG; MSG_COPY fails with E2BIG (MSG_NOERROR or not) when it is
    smaller than the message, and never copies more than msgmax.
    """
    size = max(1, min(largest, _msgmax()))
    buf = _msg_buffer(size)
    out: list[tuple[int, bytes]] = []
    while True:
        try:
            msg = _copy_message(msqid, len(out), buf)
        except _CallFailed as err:
            if err.errno != _errno.E2BIG:
                raise
            if size >= _msgmax():
                raise _CallFailed(err.errno, f"{err.call} into a buffer of kernel.msgmax = "
                                  f"{size} bytes (message {len(out)} is bigger)") from err
            size = _msgmax()
            buf = _msg_buffer(size)
            continue
        if msg is None:
            return tuple(out)
        out.append(msg)


def dump_msg(queue: MsgQueue) -> MsgImage:
    """Attributes (IPC_STAT) and messages of a queue, read without consuming them.

    msgrcv(MSG_COPY | IPC_NOWAIT) copies the message at index msgtyp and
    changes nothing (not even lrpid or rtime).  If the queue changes while
    it is copied (a process outside the frozen tree used it), the copy is
    retried; SysvIpcError after a few tries.
    """
    with _naming(IpcKind.MSG, queue.msqid, queue.key, restoring=False):
        for _ in range(_MAX_SNAPSHOT_TRIES):
            before = _msg_stat(queue.msqid)
            messages = _copy_queue(queue.msqid, before.cbytes)
            after = _msg_stat(queue.msqid)
            if _same_queue_state(before, after) and len(messages) == after.qnum:
                break
        else:
            raise SysvIpcError(IpcKind.MSG, queue.msqid, queue.key,
                               f"cannot read {_object_text(IpcKind.MSG, queue.msqid, queue.key)}"
                               ": it keeps changing while being copied")
    p = after.perm
    return MsgImage(key=p.key, msqid=queue.msqid, perms=p.mode & S_IRWXUGO, uid=p.uid,
                    gid=p.gid, cuid=p.cuid, cgid=p.cgid, qbytes=after.qbytes,
                    messages=messages, lspid=after.lspid, lrpid=after.lrpid,
                    stime=after.stime, rtime=after.rtime, ctime=after.ctime)


def _same_queue_state(a: _MsqidDs, b: _MsqidDs) -> bool:
    """No msgsnd/msgrcv happened between two IPC_STATs (at one-second time resolution,
    so the counters are compared too)."""
    return ((a.qnum, a.cbytes, a.stime, a.rtime, a.lspid, a.lrpid)
            == (b.qnum, b.cbytes, b.stime, b.rtime, b.lspid, b.lrpid))


# --- restore: placing an object at its id --------------------------------------

def _write_sysctl(path: str, value: int) -> None:
    """Write one /proc/sys value; _CallFailed if it cannot be written."""
    try:
        with open(path, "w") as f:
            f.write(str(value))
    except OSError as err:
        hint = " (kernel without CONFIG_CHECKPOINT_RESTORE?)" if err.errno == _errno.ENOENT else ""
        raise _CallFailed(err.errno or _errno.EIO, f"write {value} to {path}{hint}") from err


def _ipcmni_shift() -> int:
    """Bits of the slot index in an id: 15, or 24 with the ipcmni_extend boot option."""
    try:
        return 24 if "ipcmni_extend" in procfs.read_kernel_cmdline() else 15
    except OSError:
        return 15


def _get_existing(kind: IpcKind, key: int) -> int | None:
    """The id of the object with this (non-private) key, or None: *get(key, 0, 0)."""
    try:
        if kind is IpcKind.SHM:
            return _sys("shmget", key, 0, 0)
        if kind is IpcKind.SEM:
            return _sys("semget", key, 0, 0)
        return _sys("msgget", key, 0)
    except _CallFailed as err:
        if err.errno == _errno.ENOENT:
            return None
        raise


def _slot_holder(kind: IpcKind, ipc_id: int) -> tuple[int, int] | None:
    """(id, key) of an object in the slot (index) of `ipc_id`, from /proc/sysvipc."""
    mask = (1 << _ipcmni_shift()) - 1
    rows = {IpcKind.SHM: lambda: [(s.shmid, s.key) for s in list_shm()],
            IpcKind.SEM: lambda: [(s.semid, s.key) for s in list_sem()],
            IpcKind.MSG: lambda: [(q.msqid, q.key) for q in list_msg()]}[kind]()
    for other_id, other_key in rows:
        if other_id & mask == ipc_id & mask:
            return other_id, other_key
    return None


@contextlib.contextmanager
def _as_creator(cuid: int, cgid: int) -> Iterator[None]:
    """Run the block with effective uid/gid cuid/cgid, so the kernel records them as creator.

    Only when we are root and they differ from ours; back to root afterwards
    (the saved uid stays 0, so the capabilities come back).  This changes
    the credentials of every thread of the process for a moment.
    """
    euid, egid = os.geteuid(), os.getegid()
    if euid != 0 or (cuid, cgid) == (euid, egid):
        yield
        return
    try:
        os.setegid(cgid)
    except OSError as err:
        raise _CallFailed(err.errno or _errno.EPERM, f"setegid({cgid}) for the creator") from err
    try:
        try:
            os.seteuid(cuid)
        except OSError as err:
            raise _CallFailed(err.errno or _errno.EPERM, f"seteuid({cuid}) for the creator") from err
        try:
            yield
        finally:
            os.seteuid(euid)
    finally:
        os.setegid(egid)


def _read_next_id(kind: IpcKind) -> int:
    """The current *_next_id value (-1: unset)."""
    try:
        return int(procfs.read_sysctl(f"kernel/{kind.value}_next_id"))
    except (OSError, ValueError) as err:
        raise _CallFailed(getattr(err, "errno", None) or _errno.EIO,
                          f"read {kind.next_id_path}") from err


def _create_throwaway(kind: IpcKind) -> int:
    """A private object of `kind` (mode 0600), to be removed at once."""
    if kind is IpcKind.SHM:
        return _sys("shmget", IPC_PRIVATE, 1, IPC_CREAT | 0o600, call="shmget(throwaway)")
    if kind is IpcKind.SEM:
        return _sys("semget", IPC_PRIVATE, 1, IPC_CREAT | 0o600, call="semget(throwaway)")
    return _sys("msgget", IPC_PRIVATE, IPC_CREAT | 0o600, call="msgget(throwaway)")


def _clear_next_id(kind: IpcKind) -> None:
    """Make sure *_next_id is unset again (-1).

    The sysctl accepts only 0..INT_MAX, so -1 cannot be written back: the
    kernel resets it when it allocates an id.  A *get that failed before
    that (EEXIST, EINVAL ...) leaves it set, and the next object anybody
    creates would get our id; so it is used up by a throwaway object.
    """
    if _read_next_id(kind) < 0:
        return
    _remove(kind, _create_throwaway(kind))


def _create_at(kind: IpcKind, ipc_id: int, key: int, creator: tuple[int, int],
               create: Callable[[int], int]) -> None:
    """Create the object with exactly `ipc_id` via *_next_id; `create(flags)` does the *get.

    The kernel takes the next id from the sysctl once (the id's sequence
    number, and its slot or the next free slot above it) and resets the
    sysctl to -1 itself; :func:`_clear_next_id` makes sure of that whatever
    happens.  An object created with another id is removed again.
    """
    _write_sysctl(kind.next_id_path, ipc_id)
    try:
        with _as_creator(*creator):
            got = create(IPC_CREAT | IPC_EXCL | 0o600)
    except BaseException:
        # The *get's error is the one to report; a failure to clear comes second.
        with contextlib.suppress(_CallFailed):
            _clear_next_id(kind)
        raise
    _clear_next_id(kind)
    if got == ipc_id:
        return
    _remove(kind, got)
    holder = _slot_holder(kind, ipc_id)
    if holder is not None:
        raise IpcIdTaken(kind, ipc_id, key, *holder)
    raise IpcRestoreFailed(kind, ipc_id, key,
                           f"cannot restore {_object_text(kind, ipc_id, key)}: the kernel gave "
                           f"{kind.id_name} {got} instead (another process created a "
                           f"{kind.noun} at the same moment?)")


def _place(kind: IpcKind, ipc_id: int, key: int, creator: tuple[int, int],
           create: Callable[[int], int]) -> bool:
    """Make an object with `ipc_id` and `key` exist; True if created, False if reused.

    Reused: an object with the same id and key is there (the original).
    Raises IpcIdTaken / IpcKeyTaken if another object holds the id or key.
    """
    existing = _stat_or_none(kind, ipc_id)
    if existing is not None:
        if existing.perm.key != key:
            raise IpcIdTaken(kind, ipc_id, key, ipc_id, existing.perm.key)
        return False
    if key != IPC_PRIVATE:
        holder = _get_existing(kind, key)
        if holder is not None:
            raise IpcKeyTaken(kind, ipc_id, key, holder)
    try:
        _create_at(kind, ipc_id, key, creator, create)
    except _CallFailed as err:
        if err.errno == _errno.EEXIST and key != IPC_PRIVATE:
            holder = _get_existing(kind, key)
            raise IpcKeyTaken(kind, ipc_id, key, holder if holder is not None else -1) from err
        raise
    return True


def _remove(kind: IpcKind, ipc_id: int) -> None:
    """IPC_RMID; an object already gone is fine."""
    try:
        if kind is IpcKind.SHM:
            _sys("shmctl", ipc_id, IPC_RMID, None, call="shmctl(IPC_RMID)")
        elif kind is IpcKind.SEM:
            _sys("semctl", ipc_id, 0, IPC_RMID, 0, call="semctl(IPC_RMID)")
        else:
            _sys("msgctl", ipc_id, IPC_RMID, None, call="msgctl(IPC_RMID)")
    except _CallFailed as err:
        if err.errno not in (_errno.EINVAL, _errno.EIDRM):
            raise


def remove_object(kind: IpcKind, ipc_id: int) -> None:
    """IPC_RMID one object (nothing if it is already gone)."""
    with _naming(kind, ipc_id, None, restoring=False):
        _remove(kind, ipc_id)


def _set_owner(buf: ctypes.Structure, uid: int, gid: int, perms: int) -> None:
    """Fill the IPC_SET fields of a stat buffer (uid, gid, the low 9 mode bits)."""
    buf.perm.uid, buf.perm.gid = uid, gid
    buf.perm.mode = perms & S_IRWXUGO


# --- restore: shared memory ----------------------------------------------------

def _write_segment(shmid: int, data: bytes, fresh: bool) -> None:
    """Copy `data` to the start of the segment through a writable attach of ours.

    A fresh segment is all zeros already: only its non-zero pages are
    written, so holes stay unallocated.
    """
    addr = _sys("shmat", shmid, None, 0, call="shmat")
    try:
        if not fresh:
            ctypes.memmove(addr, data, len(data))
            return
        page = procfs.PAGE_SIZE
        view = memoryview(data)
        zero = bytes(page)
        for off in range(0, len(data), page):
            chunk = view[off:off + page]
            if chunk != zero[:len(chunk)]:
                ctypes.memmove(addr + off, bytes(chunk), len(chunk))
    finally:
        _sys("shmdt", addr, call="shmdt")


def restore_shm(img: ShmImage) -> int:
    """Make the segment exist with the image's shmid, key, size, contents, owner,
    permissions, creator and lock state; returns the shmid.

    An existing segment with the same shmid and key is the original: its
    contents are overwritten with the dump (a restart must start from the
    checkpoint; processes outside the tree still attached see that too).  Its
    size must match (SysV segments cannot be resized).

    A segment that was marked destroyed (img.destroyed) comes back alive:
    the restored processes must attach it first, then the caller calls
    :func:`mark_destroyed` (IPC_RMID), as the kernel would free a segment
    marked before anyone attached it.
    """
    kind = IpcKind.SHM
    with _naming(kind, img.shmid, img.key, restoring=True):
        created = _place(kind, img.shmid, img.key, (img.cuid, img.cgid),
                         lambda flags: _sys("shmget", img.key, img.size, flags, call="shmget"))
        st = _shm_stat(img.shmid)
        if st.segsz != img.size:
            raise IpcRestoreFailed(kind, img.shmid, img.key,
                                   f"cannot restore {_object_text(kind, img.shmid, img.key)}: it "
                                   f"exists with size {st.segsz}, the image has {img.size}")
        _write_segment(img.shmid, img.data, fresh=created)
        _set_owner(st, img.uid, img.gid, img.perms)
        _sys("shmctl", img.shmid, IPC_SET, _addr(st), call="shmctl(IPC_SET)")
        was_locked = bool(st.perm.mode & SHM_LOCKED)
        if img.locked != was_locked:
            cmd, name = (SHM_LOCK, "SHM_LOCK") if img.locked else (SHM_UNLOCK, "SHM_UNLOCK")
            _sys("shmctl", img.shmid, cmd, None, call=f"shmctl({name})")
    return img.shmid


def mark_destroyed(shmid: int) -> None:
    """IPC_RMID a restored segment that was marked destroyed at dump time.

    Call it after the restored processes have attached the segment: the
    kernel then sets SHM_DEST, drops the key, and frees the segment at the
    last detach.  Called with nothing attached, it frees it at once.
    """
    with _naming(IpcKind.SHM, shmid, None, restoring=True):
        _sys("shmctl", shmid, IPC_RMID, None, call="shmctl(IPC_RMID)")


def attach_shm_frozen(remote, shmid: int, addr: int, readonly: bool, *,
                      executable: bool = False, remap: bool = False) -> int:
    """Attach segment `shmid` at `addr` inside a stopped tracee (injected shmat).

    `remote` is a :class:`ptckpt.tracee.RemoteSyscalls`.  The whole segment
    is mapped (shmat cannot map part of it): a tracee that had unmapped or
    mprotected part of it needs munmap/mprotect afterwards.  `remap` adds
    SHM_REMAP, to attach over a mapping already at `addr` (a placeholder);
    `executable` adds SHM_EXEC.  Returns the address; RestoreFailed if the
    kernel put it elsewhere.
    """
    flags = ((SHM_RDONLY if readonly else 0) | (SHM_EXEC if executable else 0)
             | (SHM_REMAP if remap else 0))
    got = remote.checked("shmat", shmid, addr, flags,
                         step=f"attach SysV shm {shmid} at {addr:#x}")
    if got != addr:
        raise RestoreFailed(f"attach SysV shm {shmid}: shmat put it at {got:#x}, not {addr:#x}")
    return got


# --- restore: semaphores -------------------------------------------------------

def restore_sem(img: SemImage) -> int:
    """Make the set exist with the image's semid, key, nsems, values, owner,
    permissions and creator; returns the semid.

    An existing set with the same semid and key is the original: its values
    are set back with SETALL (which wakes waiters and clears every process's
    SEM_UNDO adjustments for the set).  Every sempid becomes ours.
    """
    kind = IpcKind.SEM
    with _naming(kind, img.semid, img.key, restoring=True):
        _place(kind, img.semid, img.key, (img.cuid, img.cgid),
               lambda flags: _sys("semget", img.key, img.nsems, flags, call="semget"))
        st = _sem_stat(img.semid)
        if st.nsems != img.nsems:
            raise IpcRestoreFailed(kind, img.semid, img.key,
                                   f"cannot restore {_object_text(kind, img.semid, img.key)}: it "
                                   f"exists with {st.nsems} semaphores, the image has {img.nsems}")
        values = (ctypes.c_ushort * img.nsems)(*img.values)
        _sys("semctl", img.semid, 0, SETALL, _addr(values), call="semctl(SETALL)")
        _set_owner(st, img.uid, img.gid, img.perms)
        _sys("semctl", img.semid, 0, IPC_SET, _addr(st), call="semctl(IPC_SET)")
    return img.semid


# --- restore: message queues ---------------------------------------------------

def _drain_queue(msqid: int) -> None:
    """Receive (and drop) every message: msgrcv(0, IPC_NOWAIT | MSG_NOERROR) until ENOMSG."""
    buf = _msg_buffer(16)
    while True:
        try:
            _sys("msgrcv", msqid, _addr(buf), 16, 0, IPC_NOWAIT | MSG_NOERROR,
                 call="msgrcv (emptying the queue)")
        except _CallFailed as err:
            if err.errno == _errno.ENOMSG:
                return
            raise


def _send(msqid: int, index: int, mtype: int, text: bytes) -> None:
    """msgsnd one message, never blocking."""
    buf = _msg_buffer(len(text))
    ctypes.c_long.from_buffer(buf).value = mtype
    ctypes.memmove(_addr(buf) + ctypes.sizeof(ctypes.c_long), text, len(text))
    _sys("msgsnd", msqid, _addr(buf), len(text), IPC_NOWAIT,
         call=f"msgsnd of message {index} (type {mtype}, {len(text)} bytes)")


def restore_msg(img: MsgImage) -> int:
    """Make the queue exist with the image's msqid, key, messages (in order), owner,
    permissions, qbytes and creator; returns the msqid.

    An existing queue with the same msqid and key is the original: it is
    emptied first, then refilled.  qbytes is raised while refilling if the
    messages exceed it (IPC_SET may have lowered it under a full queue).
    lspid and stime become ours.
    """
    kind = IpcKind.MSG
    with _naming(kind, img.msqid, img.key, restoring=True):
        created = _place(kind, img.msqid, img.key, (img.cuid, img.cgid),
                         lambda flags: _sys("msgget", img.key, flags, call="msgget"))
        if not created:
            _drain_queue(img.msqid)
        st = _msg_stat(img.msqid)
        _set_owner(st, img.uid, img.gid, img.perms)
        total = sum(len(text) for _, text in img.messages)
        st.qbytes = max(img.qbytes, total)
        _sys("msgctl", img.msqid, IPC_SET, _addr(st), call="msgctl(IPC_SET)")
        for i, (mtype, text) in enumerate(img.messages):
            _send(img.msqid, i, mtype, text)
        if st.qbytes != img.qbytes:
            st.qbytes = img.qbytes
            _sys("msgctl", img.msqid, IPC_SET, _addr(st), call="msgctl(IPC_SET qbytes)")
    return img.msqid


__all__ = [
    "IpcKind", "ShmSegment", "SemSet", "MsgQueue", "ShmImage", "SemImage", "MsgImage",
    "SysvIpcError", "IpcObjectGone", "IpcAccessDenied", "IpcRestoreFailed", "IpcIdTaken",
    "IpcKeyTaken", "list_shm", "list_sem", "list_msg", "mapped_shmids", "sem_pids", "used_by",
    "dump_shm", "dump_sem", "dump_msg", "restore_shm", "restore_sem", "restore_msg",
    "mark_destroyed", "remove_object", "attach_shm_frozen",
]

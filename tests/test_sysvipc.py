"""Tests of ptckpt.resources.sysvipc on real kernel objects (no mocks).

Objects are created with this file's own ctypes calls and checked through
/proc/sysvipc and this file's own reads, so the module's struct layouts are
checked, not trusted.  Every object a test creates (or restores) is removed
at teardown, every child killed.  Needs root (the *_next_id sysctls).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import struct
import subprocess
import sys
import textwrap

import pytest

from ptckpt.errors import RestoreFailed
from ptckpt.resources import sysvipc
from ptckpt.resources.sysvipc import IpcKind

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (*_next_id sysctls)")

IPC_PRIVATE, IPC_CREAT, IPC_EXCL, IPC_NOWAIT = 0, 0o1000, 0o2000, 0o4000
IPC_RMID, IPC_SET, IPC_STAT = 0, 1, 2
SHM_RDONLY, SHM_LOCK = 0o10000, 11
GETVAL, SETVAL = 12, 16
MSG_NOERROR = 0o10000
PAGE = os.sysconf("SC_PAGE_SIZE")

# --- this file's own libc calls ---------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
for _name, _res, _args in [
    ("shmget", ctypes.c_int, [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]),
    ("shmat", ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]),
    ("shmdt", ctypes.c_int, [ctypes.c_void_p]),
    ("shmctl", ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]),
    ("semget", ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int]),
    ("semctl", ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_ulong]),
    ("msgget", ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
    ("msgctl", ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]),
    ("msgsnd", ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
    ("msgrcv", ctypes.c_ssize_t,
     [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_int]),
]:
    getattr(_libc, _name).restype = _res
    getattr(_libc, _name).argtypes = _args


def ck(res: int) -> int:
    """A libc result, or OSError for -1."""
    if res == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return res


def shm_write(shmid: int, data: bytes, offset: int = 0) -> None:
    addr = ck(_libc.shmat(shmid, None, 0))
    try:
        ctypes.memmove(addr + offset, data, len(data))
    finally:
        ck(_libc.shmdt(addr))


def shm_read(shmid: int, size: int) -> bytes:
    addr = ck(_libc.shmat(shmid, None, SHM_RDONLY))
    try:
        return ctypes.string_at(addr, size)
    finally:
        ck(_libc.shmdt(addr))


def sem_values(semid: int, nsems: int) -> list[int]:
    return [ck(_libc.semctl(semid, i, GETVAL, 0)) for i in range(nsems)]


def msg_send(msqid: int, mtype: int, text: bytes) -> None:
    buf = ctypes.create_string_buffer(8 + len(text))
    struct.pack_into("q", buf, 0, mtype)
    buf[8:8 + len(text)] = text
    ck(_libc.msgsnd(msqid, buf, len(text), IPC_NOWAIT))


def msg_receive_all(msqid: int) -> list[tuple[int, bytes]]:
    """Consume the queue."""
    buf = ctypes.create_string_buffer(8 + 65536)
    out = []
    while True:
        n = _libc.msgrcv(msqid, buf, 65536, 0, IPC_NOWAIT)
        if n == -1:
            assert ctypes.get_errno() == errno.ENOMSG
            return out
        out.append((struct.unpack_from("q", buf)[0], buf.raw[8:8 + n]))


# struct ipc64_perm: key@0 uid@4 gid@8 cuid@12 cgid@16 mode@20; the *id64_ds fit in 256 bytes.
def set_owner(kind: IpcKind, ipc_id: int, uid: int, gid: int, mode: int) -> None:
    """IPC_STAT, change uid/gid/mode, IPC_SET."""
    buf = ctypes.create_string_buffer(256)
    ctl = {IpcKind.SHM: lambda cmd: _libc.shmctl(ipc_id, cmd, buf),
           IpcKind.SEM: lambda cmd: _libc.semctl(ipc_id, 0, cmd, ctypes.addressof(buf)),
           IpcKind.MSG: lambda cmd: _libc.msgctl(ipc_id, cmd, buf)}[kind]
    ck(ctl(IPC_STAT))
    struct.pack_into("II", buf, 4, uid, gid)
    struct.pack_into("I", buf, 20, mode)
    ck(ctl(IPC_SET))


def next_id(kind: IpcKind) -> int:
    with open(f"/proc/sys/kernel/{kind.value}_next_id") as f:
        return int(f.read())


def create_at(ipc: "Ipc", kind: IpcKind, ipc_id: int, create) -> int:
    """Create (and track) an object with this id through the *_next_id sysctl, independently
    of the module; the kernel resets the sysctl to -1 when it allocates the id."""
    with open(f"/proc/sys/kernel/{kind.value}_next_id", "w") as f:
        f.write(str(ipc_id))
    got = ipc.track(kind, create())
    assert next_id(kind) == -1
    return got


def row(kind: IpcKind, ipc_id: int):
    """The /proc/sysvipc line of an object, or None."""
    lister = {IpcKind.SHM: sysvipc.list_shm, IpcKind.SEM: sysvipc.list_sem,
              IpcKind.MSG: sysvipc.list_msg}[kind]
    for r in lister():
        if (r.shmid if kind is IpcKind.SHM else r.semid if kind is IpcKind.SEM
                else r.msqid) == ipc_id:
            return r
    return None


def rmid(kind: IpcKind, ipc_id: int) -> None:
    """IPC_RMID with this file's own call; an object already gone is fine."""
    res = {IpcKind.SHM: lambda: _libc.shmctl(ipc_id, IPC_RMID, None),
           IpcKind.SEM: lambda: _libc.semctl(ipc_id, 0, IPC_RMID, 0),
           IpcKind.MSG: lambda: _libc.msgctl(ipc_id, IPC_RMID, None)}[kind]()
    if res == -1 and ctypes.get_errno() not in (errno.EINVAL, errno.EIDRM):
        raise OSError(ctypes.get_errno(), "IPC_RMID")


# --- fixtures ----------------------------------------------------------------

_keys = itertools.count(1)


class Ipc:
    """Creates objects for one test and removes them (and whatever was restored) at teardown."""

    def __init__(self) -> None:
        self.made: list[tuple[IpcKind, int]] = []

    def key(self) -> int:
        """A key no other test (or run) uses."""
        return 0x5C000000 | (os.getpid() & 0xFFF) << 12 | next(_keys)

    def track(self, kind: IpcKind, ipc_id: int) -> int:
        self.made.append((kind, ipc_id))
        return ipc_id

    def shm(self, key: int, size: int, mode: int = 0o600) -> int:
        return self.track(IpcKind.SHM, ck(_libc.shmget(key, size, IPC_CREAT | IPC_EXCL | mode)))

    def sem(self, key: int, nsems: int, mode: int = 0o600) -> int:
        return self.track(IpcKind.SEM, ck(_libc.semget(key, nsems, IPC_CREAT | IPC_EXCL | mode)))

    def msg(self, key: int, mode: int = 0o600) -> int:
        return self.track(IpcKind.MSG, ck(_libc.msgget(key, IPC_CREAT | IPC_EXCL | mode)))

    def cleanup(self) -> None:
        for kind, ipc_id in reversed(self.made):
            rmid(kind, ipc_id)


@pytest.fixture
def ipc(request) -> Ipc:
    made = Ipc()
    request.addfinalizer(made.cleanup)
    return made


@pytest.fixture(autouse=True)
def next_ids_untouched():
    """Every test leaves the *_next_id sysctls at -1."""
    yield
    assert [next_id(k) for k in IpcKind] == [-1, -1, -1]


MESSAGES = [(5, b"hello"), (2, b"world!!"), (5, b""), (9, bytes(range(256)) * 4),
            (1, b"\0binary\0"), (7, b"x" * 8192)]


def make_queue(ipc: Ipc, key: int) -> int:
    msqid = ipc.msg(key)
    for mtype, text in MESSAGES:
        msg_send(msqid, mtype, text)
    return msqid


def pattern(size: int) -> bytes:
    return bytes((i * 7 + i // 4096) & 0xFF for i in range(size))


# --- listing -----------------------------------------------------------------

def test_lists_parse_proc_sysvipc(ipc):
    key = ipc.key()
    shmid = ipc.shm(key, 3 * PAGE + 100, 0o640)
    semid = ipc.sem(ipc.key(), 3, 0o604)
    msqid = ipc.msg(IPC_PRIVATE, 0o620)
    msg_send(msqid, 3, b"abc")

    s = row(IpcKind.SHM, shmid)
    assert (s.key, s.perms, s.mode, s.size, s.cpid, s.lpid, s.nattch) == \
        (key, 0o640, 0o640, 3 * PAGE + 100, os.getpid(), 0, 0)
    assert (s.uid, s.gid, s.cuid, s.cgid) == (0, 0, 0, 0)
    assert not s.destroyed and not s.locked and s.ctime > 0
    sem = row(IpcKind.SEM, semid)
    assert (sem.perms, sem.nsems, sem.uid, sem.otime) == (0o604, 3, 0, 0)
    q = row(IpcKind.MSG, msqid)
    assert (q.key, q.perms, q.cbytes, q.qnum, q.lspid, q.lrpid) == (0, 0o620, 3, 1, os.getpid(), 0)


def test_parse_uses_header_names():
    text = ("  key  shmid perms  size cpid lpid nattch uid gid cuid cgid newcol\n"
            "   -5      7  1644  4096  10   11     2   1   2    3    4    99\n")
    [seg] = sysvipc._parse_table(IpcKind.SHM, text, sysvipc.ShmSegment)
    assert seg == sysvipc.ShmSegment(key=-5, shmid=7, perms=0o1644, size=4096, cpid=10,
                                     lpid=11, nattch=2, uid=1, gid=2, cuid=3, cgid=4)
    assert seg.destroyed and seg.mode == 0o644
    # reordered columns are read by name
    [q] = sysvipc._parse_table(IpcKind.MSG, "msqid key perms cbytes qnum lspid lrpid uid gid "
                               "cuid cgid\n 3 9 600 1 2 3 4 5 6 7 8\n", sysvipc.MsgQueue)
    assert (q.msqid, q.key, q.perms, q.cgid) == (3, 9, 0o600, 8)
    with pytest.raises(sysvipc.SysvIpcError, match="unexpected columns"):
        sysvipc._parse_table(IpcKind.SEM, "key semid\n1 2\n", sysvipc.SemSet)


# --- dump --------------------------------------------------------------------

def test_dump_shm(ipc):
    key = ipc.key()
    size = 5 * PAGE + 123
    shmid = ipc.shm(key, size, 0o640)
    data = pattern(size)
    shm_write(shmid, data)
    set_owner(IpcKind.SHM, shmid, 1234, 4321, 0o604)
    seg = row(IpcKind.SHM, shmid)

    img = sysvipc.dump_shm(seg)
    assert img.data == data
    # the IPC_STAT layout agrees with /proc
    assert (img.key, img.shmid, img.perms, img.size, img.uid, img.gid, img.cuid, img.cgid,
            img.cpid, img.lpid, img.nattch, img.atime, img.dtime, img.ctime) == \
        (seg.key, seg.shmid, seg.perms, seg.size, seg.uid, seg.gid, seg.cuid, seg.cgid,
         seg.cpid, seg.lpid, seg.nattch, seg.atime, seg.dtime, seg.ctime)
    assert (img.destroyed, img.locked) == (False, False)
    assert row(IpcKind.SHM, shmid).nattch == 0          # detached again


def test_dump_shm_destroyed_and_locked(ipc):
    shmid = ipc.shm(ipc.key(), PAGE)
    ck(_libc.shmctl(shmid, SHM_LOCK, None))
    addr = ck(_libc.shmat(shmid, None, 0))
    try:
        ctypes.memmove(addr, b"marked", 6)
        ck(_libc.shmctl(shmid, IPC_RMID, None))
        seg = row(IpcKind.SHM, shmid)
        assert seg.destroyed and seg.key == IPC_PRIVATE      # the kernel drops the key
        img = sysvipc.dump_shm(seg)
    finally:
        ck(_libc.shmdt(addr))
    assert img.destroyed and img.locked and img.key == IPC_PRIVATE and img.nattch == 1
    assert img.data[:6] == b"marked" and img.perms == 0o600
    assert row(IpcKind.SHM, shmid) is None               # gone at the last detach


def test_dump_sem(ipc):
    semid = ipc.sem(ipc.key(), 5, 0o640)
    for i, v in [(0, 3), (2, 32767), (4, 1)]:
        ck(_libc.semctl(semid, i, SETVAL, v))
    img = sysvipc.dump_sem(row(IpcKind.SEM, semid))
    assert img.values == (3, 0, 32767, 0, 1) and img.nsems == 5
    assert img.pids == (os.getpid(), 0, os.getpid(), 0, os.getpid())
    assert sysvipc.sem_pids(semid) == img.pids
    assert (img.perms, img.uid, img.cuid) == (0o640, 0, 0)
    assert img.ctime == row(IpcKind.SEM, semid).ctime


def test_dump_msg_copies_without_consuming(ipc):
    msqid = make_queue(ipc, ipc.key())
    set_owner(IpcKind.MSG, msqid, 1234, 4321, 0o660)
    before = row(IpcKind.MSG, msqid)

    img = sysvipc.dump_msg(before)
    assert list(img.messages) == MESSAGES
    assert (img.key, img.perms, img.uid, img.gid, img.lspid, img.lrpid, img.stime) == \
        (before.key, 0o660, 1234, 4321, os.getpid(), 0, before.stime)
    assert img.qbytes == int(open("/proc/sys/kernel/msgmnb").read())
    # nothing consumed, not even lrpid/rtime touched; a second copy is the same
    assert row(IpcKind.MSG, msqid) == before
    assert sysvipc.dump_msg(before) == img
    assert msg_receive_all(msqid) == MESSAGES


def test_dump_empty_queue(ipc):
    msqid = ipc.msg(IPC_PRIVATE)
    assert sysvipc.dump_msg(row(IpcKind.MSG, msqid)).messages == ()


def test_dump_of_removed_object_names_it(ipc):
    semid = ipc.sem(ipc.key(), 1)
    sem = row(IpcKind.SEM, semid)
    rmid(IpcKind.SEM, semid)
    with pytest.raises(sysvipc.IpcObjectGone, match=f"semaphore set semid {semid} .*removed"):
        sysvipc.dump_sem(sem)


# --- restore -----------------------------------------------------------------

def dump_and_remove(kind: IpcKind, ipc_id: int):
    """Dump an object, then IPC_RMID it."""
    r = row(kind, ipc_id)
    img = {IpcKind.SHM: sysvipc.dump_shm, IpcKind.SEM: sysvipc.dump_sem,
           IpcKind.MSG: sysvipc.dump_msg}[kind](r)
    rmid(kind, ipc_id)
    assert row(kind, ipc_id) is None
    return r, img


@pytest.mark.parametrize("private", [False, True], ids=["keyed", "private"])
def test_shm_roundtrip(ipc, private):
    key = IPC_PRIVATE if private else ipc.key()
    size = 4 * PAGE + 10
    shmid = ipc.shm(key, size, 0o640)
    data = bytearray(size)
    data[PAGE:2 * PAGE] = pattern(PAGE)            # page 0 and 2-3 are holes
    data[-10:] = b"0123456789"
    shm_write(shmid, bytes(data))
    set_owner(IpcKind.SHM, shmid, 1234, 4321, 0o604)
    ck(_libc.shmctl(shmid, SHM_LOCK, None))
    before, img = dump_and_remove(IpcKind.SHM, shmid)

    assert ipc.track(IpcKind.SHM, sysvipc.restore_shm(img)) == shmid
    after = row(IpcKind.SHM, shmid)
    assert (after.key, after.perms, after.size, after.uid, after.gid, after.cuid, after.cgid) == \
        (key, 0o604 | sysvipc.SHM_LOCKED, size, 1234, 4321, 0, 0)
    assert shm_read(shmid, size) == bytes(data)
    assert after.rss == PAGE + PAGE               # holes were not written (data page + tail page)


def test_sem_roundtrip(ipc):
    key = ipc.key()
    semid = ipc.sem(key, 4, 0o640)
    for i, v in enumerate([7, 0, 65535 // 2, 2]):
        ck(_libc.semctl(semid, i, SETVAL, v))
    set_owner(IpcKind.SEM, semid, 1234, 4321, 0o600)
    _, img = dump_and_remove(IpcKind.SEM, semid)

    assert ipc.track(IpcKind.SEM, sysvipc.restore_sem(img)) == semid
    after = row(IpcKind.SEM, semid)
    assert (after.key, after.perms, after.nsems, after.uid, after.gid) == (key, 0o600, 4, 1234, 4321)
    assert sem_values(semid, 4) == [7, 0, 65535 // 2, 2]


def test_msg_roundtrip(ipc):
    key = ipc.key()
    msqid = make_queue(ipc, key)
    set_owner(IpcKind.MSG, msqid, 1234, 4321, 0o620)
    _, img = dump_and_remove(IpcKind.MSG, msqid)

    assert ipc.track(IpcKind.MSG, sysvipc.restore_msg(img)) == msqid
    after = row(IpcKind.MSG, msqid)
    assert (after.key, after.perms, after.uid, after.gid, after.qnum) == \
        (key, 0o620, 1234, 4321, len(MESSAGES))
    assert after.cbytes == sum(len(t) for _, t in MESSAGES)
    assert sysvipc.dump_msg(after).qbytes == img.qbytes
    assert msg_receive_all(msqid) == MESSAGES


def test_msg_roundtrip_qbytes_below_contents(ipc):
    """IPC_SET may lower qbytes under a full queue; the restore still fits every message."""
    msqid = make_queue(ipc, IPC_PRIVATE)
    buf = ctypes.create_string_buffer(256)
    ck(_libc.msgctl(msqid, IPC_STAT, buf))
    struct.pack_into("Q", buf, 48 + 5 * 8, 100)     # msg_qbytes (after 3 times, cbytes, qnum)
    ck(_libc.msgctl(msqid, IPC_SET, buf))
    _, img = dump_and_remove(IpcKind.MSG, msqid)
    assert img.qbytes == 100

    ipc.track(IpcKind.MSG, sysvipc.restore_msg(img))
    assert sysvipc.dump_msg(row(IpcKind.MSG, msqid)).qbytes == 100
    assert msg_receive_all(msqid) == MESSAGES


def test_creator_is_restored(ipc):
    """Objects created by another user come back with that creator (cuid/cgid)."""
    key = ipc.key()
    os.setegid(4321)
    os.seteuid(1234)
    try:
        msqid = ipc.msg(key, 0o600)
    finally:
        os.seteuid(0)
        os.setegid(0)
    set_owner(IpcKind.MSG, msqid, 1000, 1001, 0o640)
    _, img = dump_and_remove(IpcKind.MSG, msqid)
    assert (img.cuid, img.cgid, img.uid, img.gid) == (1234, 4321, 1000, 1001)

    ipc.track(IpcKind.MSG, sysvipc.restore_msg(img))
    after = row(IpcKind.MSG, msqid)
    assert (after.cuid, after.cgid, after.uid, after.gid) == (1234, 4321, 1000, 1001)
    assert (os.geteuid(), os.getegid()) == (0, 0)


def test_destroyed_segment_restored_then_marked(ipc):
    shmid = ipc.shm(ipc.key(), PAGE)
    addr = ck(_libc.shmat(shmid, None, 0))
    try:
        ctypes.memmove(addr, b"doomed", 6)
        ck(_libc.shmctl(shmid, IPC_RMID, None))
        img = sysvipc.dump_shm(row(IpcKind.SHM, shmid))
    finally:
        ck(_libc.shmdt(addr))
    assert row(IpcKind.SHM, shmid) is None and img.destroyed

    assert ipc.track(IpcKind.SHM, sysvipc.restore_shm(img)) == shmid
    assert not row(IpcKind.SHM, shmid).destroyed           # alive until the caller marks it
    addr = ck(_libc.shmat(shmid, None, 0))                 # "the restored process attaches"
    try:
        sysvipc.mark_destroyed(shmid)
        seg = row(IpcKind.SHM, shmid)
        assert seg.destroyed and seg.nattch == 1
        assert ctypes.string_at(addr, 6) == b"doomed"
    finally:
        ck(_libc.shmdt(addr))
    assert row(IpcKind.SHM, shmid) is None


# --- restore over the surviving original ----------------------------------------

def test_restore_over_existing_resets_contents(ipc):
    key = ipc.key()
    shmid = ipc.shm(key, 2 * PAGE)
    shm_write(shmid, b"checkpoint")
    semid = ipc.sem(ipc.key(), 3)
    ck(_libc.semctl(semid, 1, SETVAL, 5))
    msqid = make_queue(ipc, ipc.key())
    shm_img = sysvipc.dump_shm(row(IpcKind.SHM, shmid))
    sem_img = sysvipc.dump_sem(row(IpcKind.SEM, semid))
    msg_img = sysvipc.dump_msg(row(IpcKind.MSG, msqid))

    # life goes on after the checkpoint
    shm_write(shmid, b"AFTERWARDS", 0)
    shm_write(shmid, b"more", PAGE)
    ck(_libc.semctl(semid, 1, SETVAL, 0))
    ck(_libc.semctl(semid, 2, SETVAL, 9))
    msg_receive_all(msqid)
    msg_send(msqid, 42, b"new")
    set_owner(IpcKind.MSG, msqid, 7, 7, 0o666)

    assert sysvipc.restore_shm(shm_img) == shmid
    assert sysvipc.restore_sem(sem_img) == semid
    assert sysvipc.restore_msg(msg_img) == msqid
    assert shm_read(shmid, 2 * PAGE) == b"checkpoint" + bytes(2 * PAGE - 10)
    assert sem_values(semid, 3) == [0, 5, 0]
    q = row(IpcKind.MSG, msqid)
    assert (q.key, q.uid, q.gid, q.perms) == (msg_img.key, 0, 0, 0o600)
    assert msg_receive_all(msqid) == MESSAGES


def test_restore_over_existing_of_other_size_fails(ipc):
    key = ipc.key()
    shmid = ipc.shm(key, PAGE)
    _, img = dump_and_remove(IpcKind.SHM, shmid)
    create_at(ipc, IpcKind.SHM, shmid, lambda: ck(_libc.shmget(key, 2 * PAGE, IPC_CREAT | 0o600)))
    with pytest.raises(sysvipc.IpcRestoreFailed, match=f"shmid {shmid} .*exists with size "
                       f"{2 * PAGE}, the image has {PAGE}"):
        sysvipc.restore_shm(img)


# --- id or key held by another object ---------------------------------------------

@pytest.mark.parametrize("kind", list(IpcKind), ids=lambda k: k.value)
def test_id_taken_by_another_key(ipc, kind):
    key, other_key = ipc.key(), ipc.key()
    make = {IpcKind.SHM: lambda k, f: ck(_libc.shmget(k, PAGE, f)),
            IpcKind.SEM: lambda k, f: ck(_libc.semget(k, 2, f)),
            IpcKind.MSG: lambda k, f: ck(_libc.msgget(k, f))}[kind]
    ipc_id = ipc.track(kind, make(key, IPC_CREAT | 0o600))
    _, img = dump_and_remove(kind, ipc_id)
    create_at(ipc, kind, ipc_id, lambda: make(other_key, IPC_CREAT | 0o600))

    restore = {IpcKind.SHM: sysvipc.restore_shm, IpcKind.SEM: sysvipc.restore_sem,
               IpcKind.MSG: sysvipc.restore_msg}[kind]
    with pytest.raises(sysvipc.IpcIdTaken) as info:
        restore(img)
    err = info.value
    assert isinstance(err, RestoreFailed)
    assert (err.holder_id, err.holder_key, err.ipc_id, err.key) == (ipc_id, other_key, ipc_id, key)
    assert f"{kind.id_name} {ipc_id} (key {key:#010x})" in str(err)
    assert f"key {other_key:#010x}" in str(err)
    with pytest.raises(OSError):        # nothing was created under the image's key
        ck({IpcKind.SHM: lambda: _libc.shmget(key, 0, 0), IpcKind.SEM: lambda: _libc.semget(key, 0, 0),
            IpcKind.MSG: lambda: _libc.msgget(key, 0)}[kind]())


def test_slot_taken_by_other_generation(ipc):
    """Same slot, other sequence number: the kernel would hand out the next slot; refused."""
    key, other_key = ipc.key(), ipc.key()
    semid = ipc.sem(key, 1)
    _, img = dump_and_remove(IpcKind.SEM, semid)
    other = create_at(ipc, IpcKind.SEM, semid + (1 << 15),
                      lambda: ck(_libc.semget(other_key, 1, IPC_CREAT | 0o600)))
    assert other == semid + (1 << 15)
    with pytest.raises(sysvipc.IpcIdTaken, match=f"slot of id {semid} .*semid {other}"):
        sysvipc.restore_sem(img)
    assert row(IpcKind.SEM, other + 1) is None and row(IpcKind.SEM, semid + 1) is None
    assert [s.semid for s in sysvipc.list_sem() if s.key == key] == []


def test_key_taken_by_another_id(ipc):
    key = ipc.key()
    msqid = ipc.msg(key)
    _, img = dump_and_remove(IpcKind.MSG, msqid)
    other = ipc.msg(key)
    assert other != msqid
    with pytest.raises(sysvipc.IpcKeyTaken, match=f"key {key:#010x} is used by msqid {other}"):
        sysvipc.restore_msg(img)
    assert row(IpcKind.MSG, msqid) is None


def test_failed_create_leaves_next_id_unset(ipc):
    """A *get that fails before the kernel allocates an id must not leave *_next_id set
    (-1 cannot be written back; the module uses it up with a throwaway object)."""
    semmsl = int(open("/proc/sys/kernel/sem").read().split()[0])
    others = sysvipc.list_sem()
    img = sysvipc.SemImage(key=ipc.key(), semid=12345, perms=0o600, uid=0, gid=0, cuid=0,
                           cgid=0, values=(0,) * (semmsl + 1), pids=(0,) * (semmsl + 1))
    with pytest.raises(sysvipc.IpcRestoreFailed,
                       match=r"cannot restore semaphore set semid 12345 \(key 0x.*\): "
                             r"semget failed: EINVAL"):
        sysvipc.restore_sem(img)
    assert next_id(IpcKind.SEM) == -1
    assert sysvipc.list_sem() == others                 # the throwaway is gone too


# --- which objects a process uses ----------------------------------------------

CHILD = textwrap.dedent("""
    import ctypes, struct, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    shmid, semid, msqid = map(int, sys.argv[1:4])
    addr = libc.shmat(shmid, None, 0)
    assert addr not in (None, 2**64 - 1), ctypes.get_errno()
    ctypes.memmove(addr, b"child", 5)
    op = struct.pack("HhH", 1, 3, 0)                  # struct sembuf: sem 1, +3
    assert libc.semop(semid, op, 1) == 0, ctypes.get_errno()
    msg = struct.pack("q", 7) + b"ping"
    assert libc.msgsnd(msqid, msg, 4, 0) == 0, ctypes.get_errno()
    print("ready", flush=True)
    time.sleep(60)
""")


@pytest.fixture
def child_using(ipc, request):
    """A python3 child attached to a segment, after a semop and a msgsnd; plus decoys."""
    shmid = ipc.shm(ipc.key(), PAGE)
    semid = ipc.sem(ipc.key(), 2)
    msqid = ipc.msg(ipc.key())
    decoys = (ipc.shm(ipc.key(), PAGE), ipc.sem(ipc.key(), 2), ipc.msg(ipc.key()))
    ck(_libc.semctl(decoys[1], 0, SETVAL, 1))         # touched, but by us
    msg_send(decoys[2], 1, b"us")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(shmid), str(semid), str(msqid)],
                            stdout=subprocess.PIPE, text=True)

    def kill() -> None:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    request.addfinalizer(kill)
    assert proc.stdout.readline() == "ready\n"
    return proc.pid, (shmid, semid, msqid), decoys


def test_used_by_child(child_using):
    pid, (shmid, semid, msqid), decoys = child_using
    mapped = sysvipc.mapped_shmids(pid)
    assert mapped == {shmid}

    shms, sems, msgs = sysvipc.used_by({pid}, mapped)
    assert [s.shmid for s in shms] == [shmid]
    assert [s.semid for s in sems] == [semid]
    assert [q.msqid for q in msgs] == [msqid]
    assert shms[0].lpid == pid and shms[0].nattch == 1 and msgs[0].lspid == pid
    assert sysvipc.sem_pids(semid) == (0, pid)
    assert sysvipc.dump_sem(sems[0]).values == (0, 3)

    # by the maps alone, and by the pids alone (lpid of the child's shmat)
    assert [s.shmid for s in sysvipc.used_by(set(), mapped)[0]] == [shmid]
    assert sysvipc.used_by(set(), mapped)[1:] == ([], [])
    assert [s.shmid for s in sysvipc.used_by({pid}, set())[0]] == [shmid]
    # we created everything, and touched the decoys
    mine = sysvipc.used_by({os.getpid()}, set())
    assert {s.shmid for s in mine[0]} >= {shmid, decoys[0]}
    assert [s.semid for s in mine[1]] == [decoys[1]]
    assert [q.msqid for q in mine[2]] == [decoys[2]]
    assert shm_read(shmid, 5) == b"child"

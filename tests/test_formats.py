"""The image format: record round trips, framing rules, and the image directory's writer/reader.

Pure: no ptrace, no processes; everything is built from synthetic records.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import zlib
from dataclasses import dataclass

import pytest
from construct import Int32ul, Struct

import ptckpt.formats.image as image_mod
from ptckpt.errors import (
    BadMagic,
    CorruptImage,
    DestinationExists,
    ImageWriteError,
    NotAnImage,
    UnsupportedVersion,
)
from ptckpt.formats.image import ImageReader, ImageWriter, core_name, pagemap_name, pages_name
from ptckpt.formats.model import (
    AioRing,
    FanotifyMark,
    FanotifyState,
    GP_REG_NAMES,
    EpollState,
    InetMode,
    InFlightFd,
    InetSocket,
    FdOwner,
    Itimer,
    NetlinkSocket,
    EpollTarget,
    EventfdState,
    InotifyState,
    InotifyWatch,
    MemfdState,
    MqueueState,
    PidfdState,
    SignalfdState,
    Terminal,
    TimerfdState,
    PAGE_SIZE,
    Creds,
    Fd,
    FdKind,
    GhostFile,
    HeldLock,
    Inventory,
    Mm,
    MsgImage,
    PageRun,
    PendingSignal,
    PosixTimer,
    Pty,
    PipeBuffer,
    PluginData,
    ProcessImage,
    Restart,
    Rlimit,
    SavedFile,
    SemImage,
    ShmImage,
    Sigaction,
    Task,
    Thread,
    PageSums,
    ParentPages,
    PageFrames,
    PageServerPages,
    UnixSocket,
    Vma,
    VmaKind,
    Zombie,
)
from ptckpt.formats.records import (
    FORMAT_VERSION,
    HEADER_SIZE,
    KIND_OF,
    PAGES_DATA_OFFSET,
    RECORDS,
    Entry,
    EntryDecodeError,
    EntryKind,
    FileKind,
    RawEntry,
    Record,
    Since,
    build_header,
    build_record,
    decode_entries,
    encode_entry,
    encode_page_runs,
    encode_parent_pages,
    parse_header,
    parse_record,
)

U64_MAX = 2**64 - 1
ODD_PATH = b"/tmp/caf\xe9-\xff\xfe.so".decode("utf-8", "surrogateescape")   # Latin-1 name, not UTF-8


# --- sample records ------------------------------------------------------------

def make_inventory(pids=(100,)) -> Inventory:
    return Inventory(
        ptckpt_version="0.1.0", kernel_release="6.8.0-test", arch="x86_64", page_size=PAGE_SIZE,
        xfeatures=0x2e7, xstate_size=2696, root_pid=pids[0], pids=tuple(pids),
        realtime_ns=1_700_000_000_123_456_789, monotonic_ns=5_000_000_000, boottime_ns=6_000_000_000,
        hostname="host\udcff", fd_kinds_unsupported=("100 7 -> anon_inode:[io_uring]",))


def make_task(pid=100, tids=(100, 101)) -> Task:
    return Task(
        # (200 is the golden two-process image's child of 100: a member's parent is in the image)
        pid=pid, ppid=100 if pid == 200 else 1, pgid=pid, sid=1, comm="wörker\udcfe", state="S", exe="/usr/bin/app",
        cwd=ODD_PATH, root="/", umask=0o022, personality=0x0040000, nice=-20,
        sched_policy=0x40000000, rt_priority=0, oom_score_adj=-1000, timerslack_ns=50_000,
        exit_signal=-1, tids=tuple(tids), cmdline=("app", "--x=\udcff", ""), dumpable=2,
        pdeath_signal=15, child_subreaper=True)


def make_creds() -> Creds:
    return Creds(uids=(1000, 1000, 1000, 1000), gids=(100, 100, 100, 100), groups=(4, 24, 27),
                 cap_inh=0, cap_prm=0x1ffffffffff, cap_eff=0x1ffffffffff, cap_bnd=U64_MAX,
                 cap_amb=0, no_new_privs=1, seccomp=2)


def make_mm() -> Mm:
    return Mm(start_code=0x400000, end_code=0x401000, start_data=0x600000, end_data=0x601000,
              start_brk=0x1000000, brk=0x1021000, start_stack=0x7ffc0000f000, arg_start=0x7ffc0000f100,
              arg_end=0x7ffc0000f200, env_start=0x7ffc0000f200, env_end=0x7ffc0000fff0,
              exe_file="/usr/bin/app", auxv=((33, 0x7ffd000), (6, 4096), (25, 0x7ffc0000f300)))


def make_vma(start=0x7f0000000000, npages=4, kind=VmaKind.FILE_PRIVATE, path=ODD_PATH, shared=False) -> Vma:
    return Vma(start=start, end=start + npages * PAGE_SIZE, prot=5, shared=shared, kind=kind,
               pgoff=0x2000, dev_major=259, dev_minor=2, inode=1234567, path=path,
               vmflags="rd ex mr mw me", file_size=123456, file_mtime_ns=-5, file_deleted=True,
               build_id="1a2b3c" if kind == VmaKind.FILE_PRIVATE else "")


def make_thread(tid=100, restart=Restart.REEXECUTE) -> Thread:
    regs = tuple(range(1, len(GP_REG_NAMES) + 1))
    regs = regs[:15] + (U64_MAX,) + (0x401234,) + regs[17:19] + (0x7ffc0000e000,) + regs[20:]
    return Thread(tid=tid, regs=regs, xstate=bytes(range(256)) * 10 + b"\x00" * 136, xfeatures=0x7,
                  sigmask=1 << 9, rseq_addr=0x7f00000020a0, rseq_len=32, rseq_sig=0x53053053,
                  rseq_flags=0, robust_list=0x7f0000001920, robust_list_len=24,
                  clear_child_tid=0x7f0000001910, sas_sp=0, sas_flags=0x80000002, sas_size=0,
                  restart=restart, syscall_nr=-1 if restart == Restart.NONE else 7, comm="t\udcff")


def make_process(pid=100) -> ProcessImage:
    return ProcessImage(
        task=make_task(pid, (pid, pid + 1)), creds=make_creds(), mm=make_mm(),
        rlimits=(Rlimit(7, 1024, 4096), Rlimit(3, 8 << 20, U64_MAX)),
        vmas=(make_vma(), make_vma(0x7f0000100000, 2, VmaKind.ANON_PRIVATE, "")),
        threads=(make_thread(pid), make_thread(pid + 1, Restart.NONE)),
        sigactions=(Sigaction(2, 0x401500, 0x04000004, 0x401600, 1 << 1), Sigaction(13, 1, 0, 0, 0)),
        pending=(PendingSignal(0, bytes([10]) + bytes(127)), PendingSignal(pid + 1, bytes([12, 0, 0, 0]) + bytes(range(4, 128)))),
        fds=(Fd(fd=0, kind=FdKind.PTY_SLAVE, path="/dev/pts/3", flags=0o100002, pos=0, cloexec=False,
                mnt_id=25, dev=0x19, ino=6, mode=0o20620, rdev=0x8803, size=0, mtime_ns=1),
             Fd(fd=7, kind=FdKind.REGULAR, path=ODD_PATH, flags=0o2100000, pos=-1 & 0x7fffffffffffffff,
                cloexec=True, mnt_id=30, dev=0x10302, ino=99, mode=0o100644, rdev=0, size=-1,
                mtime_ns=-1_000_000_000, details=(("lock", "1: POSIX"), ("sock", "\udcff")), desc=3, skipped=True, external="vendor: emulator link")),
        locks=(HeldLock(fd=7, kind="posix", type="write", start=200, end=-1, pid=pid),
               HeldLock(fd=7, kind="flock", type="read", start=0, end=-1, pid=pid - 1)),
        timers=(PosixTimer(id=0, clockid=1, signo=34, notify=0, tid=0, value=0xdead, interval_ns=20_000_000,
                           left_ns=7_000_000, overrun=2),
                PosixTimer(id=42, clockid=-6, signo=10, notify=4, tid=pid + 1, value=2**64 - 1, interval_ns=0,
                           left_ns=0)),
        itimers=(Itimer(which=0, interval_us=30_000, left_us=12_345),),
        owners=(FdOwner(fd=7, owner_type=1, pid=pid, signo=0), FdOwner(fd=0, owner_type=2, pid=pid - 1, signo=29)),
        aio_rings=(AioRing(start=0x7f0000100000, end=0x7f0000101000, nr=127, head=3, tail=5, events=bytes(range(64))),),
    )


def sample_records() -> list:
    proc = make_process()
    return [make_inventory(), proc.task, proc.creds, proc.mm, *proc.rlimits, *proc.vmas, *proc.threads,
            *proc.sigactions, *proc.pending, *proc.fds, *proc.locks, *proc.timers, *proc.itimers,
            *proc.owners, *proc.aio_rings, PageRun(0x7f0000000000, 4, 8192), PageSums(1 << 20, bytes(range(16))),
            ParentPages(0x7f0000010000, 3), PageFrames("zstd", 3, bytes(range(16))),
            PageServerPages("unix:/run/ps.sock", "pages/0123abcd/pages-100.img", 1 << 20, 0xDEADBEEF),
            Zombie(pid=101, ppid=100, pgid=100, sid=1, wait_status=0x0300),
            PipeBuffer(ino=4242, capacity=65536, data=b"1\n2\n" + bytes(300), path="/tmp/fifo\udcff"),
            UnixSocket(ino=77, type=5, state=1, name=b"\0abstract", peer=78, peer_name=b"/tmp/s",
                       backlog=0, shutdown=2, queue=(b"one", b"", b"three" * 1000), listener=76,
                       options=((1, 16, b"\1\0\0\0"),)),
            UnixSocket(ino=(1 << 62) | 2, type=1, state=1, name=b"/tmp/gone", peer=0, peer_name=b"",
                       backlog=0, shutdown=0, queue=(b"early", b"x"), listener=76, pending=True, deleted=True,
                       file_mode=0o140640, file_uid=18943, file_gid=58467, queue_fds=((3, 4), ())),
            InFlightFd(Fd(fd=9, kind=FdKind.PIPE, path="pipe:[12]", flags=0, pos=0, cloexec=True, mnt_id=15,
                          dev=0xd, ino=12, mode=0o10600, rdev=0, size=0, mtime_ns=1, desc=3)),
            ShmImage(key=0x1234, shmid=32769, perms=0o600, size=8192, uid=1000, gid=100, cuid=0, cgid=0,
                     cpid=100, lpid=101, nattch=2, atime=1, dtime=0, ctime=-1, destroyed=True, locked=False,
                     data=b"\x01" * 8192),
            SemImage(key=0, semid=5, perms=0o666, uid=0, gid=0, cuid=0, cgid=0, values=(0, 1, 65535),
                     pids=(100, 0, 101), otime=3, ctime=4),
            MsgImage(key=-1, msqid=7, perms=0o640, uid=1, gid=2, cuid=3, cgid=4, qbytes=16384,
                     messages=((1, b"hello"), (2**62, b""), (3, bytes(range(256)))), lspid=100, lrpid=0,
                     stime=5, rtime=6, ctime=7),
            GhostFile(dev=0x10302, ino=99, path=ODD_PATH, mode=0o100600, uid=1000, gid=100,
                      data=b"ghost" * 1000),
            GhostFile(dev=0x10302, ino=100, path="/tmp/sparse", mode=0o106604, uid=0, gid=0, data=b"ab" * 4096,
                      mtime_ns=123456 * 10**9, atime_ns=-1, size=1 << 40, extents=((0, 4096), (1 << 39, 4096)),
                      xattrs=(("user.k", b"v\0"), ("system.posix_acl_access", bytes(range(28))))),
            GhostFile(dev=0x10302, ino=101, path="/tmp/linked", mode=0o100644, uid=0, gid=0, data=b"", size=19,
                      handle=bytes.fromhex("080000000100000029c2200088da5a6a")),
            SavedFile(path="/slot3/state.bin", mode=0o100644, uid=0, gid=0, mtime_ns=-7, data=b"\0\1"),
            EventfdState(count=5, flags=0o4001, desc=4),
            TimerfdState(clockid=1, flags=0o4000, settime_flags=1, value_ns=2 * 10**9, interval_ns=5 * 10**8,
                         ticks=3, expires_ns=-1, desc=5),
            SignalfdState(mask=(1 << 9) | (1 << 14), flags=0, desc=6),
            InotifyState(watches=(InotifyWatch(1, "/tmp/a", 0x100), InotifyWatch(12, ODD_PATH, 0x2)),
                         flags=0o4000, desc=7, deleted=((12, 0x10302, 99),)),
            MemfdState(name="board", contents=b"\x07" * 100, size=4096, seals=0xb, mode=0o777, pos=9, desc=8),
            MqueueState(name="/q", maxmsg=10, msgsize=8192, flags=0o4000, messages=((5, b"hi"), (0, b"")),
                        mode=0o600, uid=0, gid=0, unlinked=True, desc=9),
            EpollState(targets=(EpollTarget(4, 0x80000019, 2**64 - 1), EpollTarget(9, 1, 0)), desc=10, sources=(0, 3)),
            Terminal(termios=bytes(range(44)), rows=40, cols=120, xpixel=1920, ypixel=1280, fg_pgrp=77,
                     sid=-1, controlling=True, desc=11),
            Pty(desc=12, index=300, termios=bytes(range(44)), rows=25, cols=90, xpixel=0, ypixel=0, sid=4000,
                fg_pgrp=-1, locked=False, packet=True, output=b"\r\nbash$ " * 100, input=b"ls\nvi",
                input_lines=(3,)),
            Pty(desc=13, index=301, termios=b"", rows=0, cols=0, xpixel=0, ypixel=0, sid=-1, fg_pgrp=-1,
                locked=False, packet=False, hung_up=True),
            InetSocket(ino=88, family=10, type=1, protocol=6, state=8, mode=InetMode.REPAIRED, src="::1",
                       sport=8080, dst="::ffff:127.0.0.1", dport=45000, shutdown=1, options=((1, 2, b"\1\0\0\0"),),
                       rcv_seq=2**32 - 1, snd_seq=5, recv_queue=b"r" * 3000, send_queue=b"s" * 70000, unsent=100,
                       mss=65483, tcp_options=7, snd_wscale=10, rcv_wscale=7, timestamp=123456,
                       window=(1, 2, 3, 4, 5), peer=89),
            InetSocket(ino=90, family=2, type=2, protocol=17, state=7, src="0.0.0.0", sport=53,
                       datagrams=(("127.0.0.1", 4000, b"q"), ("10.0.0.2", 65535, b"")),
                       multicast=((0, "239.1.2.3"),), filter=bytes(range(16))),
            InetSocket(ino=(1 << 62) | 1, family=2, type=1, protocol=6, state=1, mode=InetMode.PENDING,
                       src="127.0.0.1", sport=80, dst="127.0.0.1", dport=40000, listener=91, peer=92),
            NetlinkSocket(ino=93, type=3, protocol=0, portid=4242, groups=0x11, dst_portid=0, dst_group=0),
            FanotifyState(init_flags=0x200, event_flags=0o100000, flags=0o4000, desc=12,
                          marks=(FanotifyMark(0, ODD_PATH, 0x40, 0, 0x8), FanotifyMark(1, "/", 0, 2**40, 0),
                                 FanotifyMark(2, "/tmp", 0x200, 0x20, 0))),
            PidfdState(pid=100, flags=0o4200, target=1, desc=13),
            PidfdState(pid=-1, flags=0, target=2, desc=14),
            PluginData(name="vendor", version="1.2", pid=-1, key="", data=b""),
            PluginData(name="vendor", version="1.2", pid=100, key="emulator-state", data=b"\x00state")]


SAMPLES = sample_records()


def _id(rec) -> str:
    return type(rec).__name__


# --- records -------------------------------------------------------------------------

def test_every_entry_kind_has_a_record_and_a_sample():
    assert set(RECORDS) == set(EntryKind)
    assert {KIND_OF[type(r)] for r in SAMPLES} == set(EntryKind)


@pytest.mark.parametrize("record", SAMPLES, ids=_id)
def test_record_round_trip(record):
    rec = RECORDS[KIND_OF[type(record)]]
    payload = rec.build(record)
    assert rec.parse(payload) == record                  # parse(build(rec)) == rec
    assert rec.build(rec.parse(payload)) == payload      # build(parse(b)) == b
    assert build_record(record) == payload
    assert parse_record(KIND_OF[type(record)], payload) == record


@pytest.mark.parametrize("record", SAMPLES, ids=_id)
def test_fast_framing_agrees_with_entry_grammar(record):
    framed = encode_entry(record)
    assert framed == Entry.build(dict(kind=KIND_OF[type(record)], payload=record))
    parsed = Entry.parse(framed)
    assert parsed.payload == record and parsed.kind == KIND_OF[type(record)]
    assert decode_entries(framed) == [record]


def test_record_types_survive_parse():
    task = RECORDS[EntryKind.TASK].parse(build_record(make_task()))
    assert isinstance(task.tids, tuple) and isinstance(task.cmdline, tuple)
    fd = RECORDS[EntryKind.FD].parse(build_record(make_process().fds[1]))
    assert fd.kind is FdKind.REGULAR and fd.details[0] == ("lock", "1: POSIX")
    thread = RECORDS[EntryKind.THREAD].parse(build_record(make_thread()))
    assert thread.restart is Restart.REEXECUTE and len(thread.regs) == 27


def test_non_utf8_path_round_trips_as_raw_bytes():
    vma = make_vma(path=ODD_PATH)
    payload = build_record(vma)
    assert b"/tmp/caf\xe9-\xff\xfe.so" in payload          # the original bytes, not an escape
    back = parse_record(EntryKind.VMA, payload)
    assert back.path == ODD_PATH and os.fsencode(back.path) == b"/tmp/caf\xe9-\xff\xfe.so"


def test_unknown_enum_value_round_trips_as_int():
    vma = dataclasses.replace(make_vma(), kind=99)
    payload = build_record(vma)
    back = parse_record(EntryKind.VMA, payload)
    assert back.kind == 99 and not isinstance(back.kind, VmaKind)
    assert build_record(back) == payload


def test_signed_fields_keep_their_sign():
    back = parse_record(EntryKind.TASK, build_record(make_task()))
    assert (back.nice, back.oom_score_adj, back.exit_signal) == (-20, -1000, -1)
    assert parse_record(EntryKind.THREAD, build_record(make_thread(restart=Restart.NONE))).syscall_nr == -1


def test_out_of_range_value_is_refused_on_build():
    with pytest.raises(ValueError, match="cannot encode"):
        build_record(Rlimit(7, -1, 0))


def test_unknown_entry_kind_is_kept_raw_and_skipped():
    plugin = RawEntry(999, b"\x01\x02\x03")
    data = encode_entry(make_task()) + encode_entry(plugin) + encode_entry(make_creds())
    entries = decode_entries(data)
    assert entries == [make_task(), plugin, make_creds()]
    assert b"".join(encode_entry(e) for e in entries) == data


def test_trailing_payload_bytes_are_ignored():
    for record in (make_task(), make_creds(), PageRun(0x1000, 1, 0)):
        payload = build_record(record) + b"\x00future field\xff"
        kind = KIND_OF[type(record)]
        framed = kind.to_bytes(2, "little") + bytes(2) + len(payload).to_bytes(4, "little") + payload
        assert decode_entries(framed + encode_entry(make_mm())) == [record, make_mm()]
        assert RECORDS[kind].parse(payload) == record


@dataclass(frozen=True)
class _Toy:
    a: int
    b: int = 7


def test_since_field_defaults_for_older_versions():
    toy = Record(_Toy, Struct("a" / Int32ul, "b" / Since(2, Int32ul)))   # as if FORMAT_VERSION were 2
    assert toy.build(_Toy(1, 2), version=2) == b"\x01\x00\x00\x00\x02\x00\x00\x00"
    assert toy.parse(b"\x01\x00\x00\x00\x02\x00\x00\x00", version=2) == _Toy(1, 2)
    assert toy.parse(b"\x01\x00\x00\x00", version=1) == _Toy(1)


def test_truncated_entries_are_decode_errors():
    data = encode_entry(make_task())
    with pytest.raises(EntryDecodeError, match="truncated entry header"):
        decode_entries(data + b"\x0a\x00")
    with pytest.raises(EntryDecodeError, match="overruns"):
        decode_entries(data[:-1])
    short = encode_entry(RawEntry(EntryKind.TASK, build_record(make_task())[:5]))
    with pytest.raises(EntryDecodeError, match="TASK entry at payload offset 0"):
        decode_entries(short)
    with pytest.raises(EntryDecodeError, match="PAGE_RUN"):
        decode_entries(encode_entry(RawEntry(EntryKind.PAGE_RUN, bytes(23))))


def test_page_run_fast_path_matches_construct():
    runs = [PageRun(0x1000 * i, i + 1, 4096 * i) for i in range(50)]
    assert encode_page_runs(runs) == b"".join(encode_entry(r) for r in runs)
    assert encode_page_runs((r.vaddr, r.npages, r.offset) for r in runs) == encode_page_runs(runs)
    assert decode_entries(encode_page_runs(runs)) == runs


def test_parent_pages_fast_path_matches_construct():
    ranges = [ParentPages(0x1000 * i, i + 1) for i in range(50)]
    blob = encode_parent_pages(ranges)
    assert blob == b"".join(RECORDS[EntryKind.PAGE_PARENT].build(r) and encode_entry(r) for r in ranges)
    assert decode_entries(blob) == ranges
    assert RECORDS[EntryKind.PAGE_PARENT].parse(blob[8:24]) == ranges[0]


def test_pty_format_14_fields():
    """A PTY record of format 14 ends with the typed input, its line lengths and hung_up; a
    format-13 one has none of them and takes the defaults (no input, not hung up)."""
    pty = Pty(desc=3, index=1, termios=b"", rows=0, cols=0, xpixel=0, ypixel=0, sid=-1, fg_pgrp=-1,
              locked=False, packet=False, output=b"o", input=b"ab\nc", input_lines=(3,), hung_up=True)
    payload = build_record(pty)[:-12]                  # as format 14 wrote it
    assert payload.endswith(bytes.fromhex("01" "6f" "04" "61620a63" "0103" "01"))
    assert parse_record(EntryKind.PTY, payload, version=14) == pty
    old = parse_record(EntryKind.PTY, payload[:-8], version=13)
    assert old == dataclasses.replace(pty, input=b"", input_lines=(), hung_up=False)


def test_pty_format_17_slave_owner():
    """A PTY record of format 17 ends with the slave's uid, gid and mode (int32 each); a
    format-16 one has none and takes -1: not recorded, a restore leaves a new pty's."""
    pty = Pty(desc=3, index=1, termios=b"", rows=0, cols=0, xpixel=0, ypixel=0, sid=-1, fg_pgrp=-1,
              locked=False, packet=False, slave_uid=13333, slave_gid=44444, slave_mode=0o620)
    payload = build_record(pty)
    assert payload.endswith(bytes.fromhex("15340000" "9cad0000" "90010000"))
    assert parse_record(EntryKind.PTY, payload) == pty
    old = parse_record(EntryKind.PTY, payload[:-12], version=16)
    assert old == dataclasses.replace(pty, slave_uid=-1, slave_gid=-1, slave_mode=-1)


def test_unix_socket_format_17_name_dir():
    """A UNIX_SOCKET record of format 17 ends with the directory its relative name was bound
    in; a format-16 one has none and takes "": the holder's cwd at restore."""
    sock = UnixSocket(ino=9, type=2, state=7, name=b"r.sock", peer=0, peer_name=b"", backlog=0,
                      shutdown=0, queue=(), deleted=True, name_dir="/srv/run")
    payload = build_record(sock)
    assert payload.endswith(b"\x08/srv/run")
    assert parse_record(EntryKind.UNIX_SOCKET, payload) == sock
    old = parse_record(EntryKind.UNIX_SOCKET, payload[:-9], version=16)
    assert old == dataclasses.replace(sock, name_dir="")


def test_cgroups_format_17_dirs_and_thread_cgroups():
    """A TASK record of format 17 ends with its cgroup directories, a THREAD record with its
    own cgroups (a VarInt-prefixed text each); format-16 ones have neither and take ""."""
    task = dataclasses.replace(make_task(), cgroup_dirs="d\tname=x\t/a\t755\t0\t0\n")
    payload = build_record(task)
    assert payload.endswith(b"\x14" + task.cgroup_dirs.encode())
    assert parse_record(EntryKind.TASK, payload) == task
    assert parse_record(EntryKind.TASK, payload[:-21], version=16) == dataclasses.replace(task, cgroup_dirs="")
    thread = dataclasses.replace(make_thread(5), cgroups="1:name=x:/a/b\n")
    payload = build_record(thread)
    assert payload.endswith(b"\x0e" + thread.cgroups.encode() + b"\x00")   # then no creds of its own
    assert parse_record(EntryKind.THREAD, payload) == thread
    assert parse_record(EntryKind.THREAD, payload[:-16], version=16) == dataclasses.replace(thread, cgroups="")


def test_thread_format_17_own_creds():
    """A THREAD record of format 17 ends with the thread's own credentials where they differ
    from its process's: a VarInt count (0 or 1) of CREDS records; a format-16 one has none
    and takes (): the process's."""
    own = dataclasses.replace(make_creds(), cap_eff=0x20, seccomp=2, seccomp_filters=(b"\x06" + b"\x00" * 7,),
                              seccomp_flags=(0,))
    thread = dataclasses.replace(make_thread(5), creds=(own,))
    payload = build_record(thread)
    creds_payload = build_record(own)
    assert payload.endswith(b"\x01" + creds_payload)
    assert parse_record(EntryKind.THREAD, payload) == thread
    old = parse_record(EntryKind.THREAD, payload[:-len(creds_payload) - 2], version=16)
    assert old == dataclasses.replace(thread, creds=())
    plain = make_thread(5)
    assert build_record(plain).endswith(b"\x00\x00") and parse_record(EntryKind.THREAD, build_record(plain)) == plain


def test_thread_format_15_tls_entries():
    """A THREAD record of format 15 ends with its TLS entries (a 32-bit thread's struct
    user_desc fields); a format-14 one has none and takes the default ()."""
    thread = dataclasses.replace(make_thread(5), tls=((12, 0xF7EE1580, 0xFFFFF, 0x51),))
    payload = build_record(thread)
    assert payload.endswith(bytes.fromhex("01" "0c000000" "8015eef7" "ffff0f00" "51000000" "00" "00"))
    assert parse_record(EntryKind.THREAD, payload) == thread
    old = parse_record(EntryKind.THREAD, payload[:-19], version=14)
    assert old == dataclasses.replace(thread, tls=())


def test_golden_bytes():
    """Pins the on-disk layout: a change here is a format change (bump FORMAT_VERSION)."""
    assert build_header(FileKind.CORE, 0x1122, 0xdeadbeef) == bytes.fromhex(
        "5054434b" "0200" "1100" "2211000000000000" "efbeadde" "00000000")
    assert encode_entry(PageSums(1 << 20, bytes(range(8)))) == bytes.fromhex(
        "1700" "0000" "0d000000" "00001000" "08" "0001020304050607")
    assert encode_entry(PageServerPages("h:1", "p/q", 0x2000, 0xdeadbeef)) == bytes.fromhex(
        "1b00" "0000" "14000000" "03" "683a31" "03" "702f71" "0020000000000000" "efbeadde")
    assert encode_entry(PageRun(0x7f0000001000, 3, 0x2000)) == bytes.fromhex(
        "1400" "0000" "18000000" "00100000007f0000" "0300000000000000" "0020000000000000")
    assert encode_entry(Rlimit(7, 1024, U64_MAX)) == bytes.fromhex(
        "0d00" "0000" "14000000" "07000000" "0004000000000000" "ffffffffffffffff")
    assert encode_entry(PendingSignal(5, bytes(128)))[:12] == bytes.fromhex("1100" "0000" "84000000" "05000000")
    task = make_task(pid=5, tids=(5,))
    task = dataclasses.replace(task, comm="a\udcff", cwd="/", cmdline=("x",))
    assert build_record(task) == bytes.fromhex(
        "05000000" "01000000" "05000000" "01000000"        # pid ppid pgid sid
        "0261ff" "0153" "0c2f7573722f62696e2f617070"      # comm "a\xff", state, exe
        "012f" "012f"                                       # cwd, root
        "12000000" "00000400" "ecffffff" "00000040"        # umask personality nice policy
        "00000000" "18fcffff" "50c3000000000000"            # rt_priority oom_score_adj timerslack_ns
        "ffffffff" "0105000000" "010178" "02000000"        # exit_signal tids cmdline dumpable
        "0f000000" "01"                                     # pdeath_signal child_subreaper (format 2)
        "00" "00000000" "00" "00" "00" "00" "00"            # thp_disable mdwe memory_merge spec_ctrl
        "ffffffff" "ffffffff"                               # coredump_filter loginuid
                                                            # shares_files shares_fs cgroups (format 8)
        "00000000"                                          # stop_signal (format 13)
        "00")                                               # cgroup_dirs (format 17)
    # A format-1 image has no format-2 fields: they take their defaults.
    old = parse_record(EntryKind.TASK, build_record(task)[:-28], version=1)
    assert (old.pdeath_signal, old.child_subreaper) == (0, False)
    assert dataclasses.replace(old, pdeath_signal=15, child_subreaper=True) == task


def test_stop_signal_and_membarrier_since_format_13():
    task = dataclasses.replace(make_task(), state="T", stop_signal=20)
    raw = build_record(task)
    assert raw.endswith(bytes.fromhex("14000000" "00")) and parse_record(EntryKind.TASK, raw) == task
    old = parse_record(EntryKind.TASK, raw[:-5], version=12)             # a format-12 image
    assert old == dataclasses.replace(task, stop_signal=0)
    mm = Mm(*range(1, 12), exe_file="/bin/x", auxv=((6, 4096),), membarrier=0x14)
    raw = build_record(mm)
    assert raw.endswith(bytes.fromhex("14000000")) and parse_record(EntryKind.MM, raw) == mm
    assert parse_record(EntryKind.MM, raw[:-4], version=12) == dataclasses.replace(mm, membarrier=0)


def test_pidfd_entry_since_format_14():
    assert encode_entry(PidfdState(pid=-1, flags=0o4200, target=3, desc=300)) == bytes.fromhex(
        "3600" "0000" "0b000000" "ac02" "ffffffff" "80080000" "03")    # desc pid flags target
    assert parse_record(EntryKind.PIDFD, bytes.fromhex("05" "64000000" "00000000" "01")) == PidfdState(
        pid=100, flags=0, target=1, desc=5)


def test_unix_socket_queue_credentials_since_format_9():
    sock = UnixSocket(ino=9, type=2, state=1, name=b"", peer=8, peer_name=b"", backlog=0, shutdown=0,
                      queue=(b"a", b"b"), queue_creds=((5, 0, 0), (6, 4321, 4322)))
    raw = build_record(sock)
    assert raw.endswith(bytes.fromhex("02" "050000000000000000000000000000000000000000000000"
                                      "0600000000000000e110000000000000e210000000000000"
                                      "00"))                                # name_dir (format 17)
    assert parse_record(EntryKind.UNIX_SOCKET, raw) == sock
    old = parse_record(EntryKind.UNIX_SOCKET, raw[:-50], version=8)        # a format-8 image
    assert old == dataclasses.replace(sock, queue_creds=())


def test_inventory_pid_namespace_fields_since_format_5():
    inv = Inventory("0.1", "6.18", "x86_64", 4096, 7, 2696, 5, (5, 6), 1, 2, 3, "h",
                    pid_level=1, real_pids=((5, 4005), (6, 4006)))
    raw = build_record(inv)
    assert raw.endswith(bytes.fromhex("01" "02" "05000000a50f0000" "06000000a60f0000" "00" "00000000"))
    assert parse_record(EntryKind.INVENTORY, raw) == inv
    old = parse_record(EntryKind.INVENTORY, raw[:-23], version=4)     # a format-4 image
    assert (old.pid_level, old.real_pids) == (0, ())


def test_inventory_netlock_since_format_6():
    inv = Inventory("0.1", "6.18", "x86_64", 4096, 7, 2696, 5, (5,), 1, 2, 3, "h", netlock="ab12")
    raw = build_record(inv)
    assert raw.endswith(b"\x04ab12" + bytes(4)) and parse_record(EntryKind.INVENTORY, raw) == inv
    old = parse_record(EntryKind.INVENTORY, raw[:-9], version=5)      # a format-5 image
    assert old.netlock == "" and old.pid_level == 0


def test_inventory_chain_fields_since_format_12():
    inv = Inventory("0.1", "6.18", "x86_64", 4096, 7, 2696, 5, (5,), 1, 2, 3, "h", image_id="c0ffee",
                    parent="../p", parent_id="beef", memory_only=True)
    raw = build_record(inv)
    assert raw.endswith(b"\x06c0ffee\x04../p\x04beef\x01") and parse_record(EntryKind.INVENTORY, raw) == inv
    old = parse_record(EntryKind.INVENTORY, raw[:-18], version=11)    # a format-11 image
    assert (old.image_id, old.parent, old.parent_id, old.memory_only) == ("", "", "", False)
    assert encode_entry(ParentPages(0x7f0000001000, 3)) == bytes.fromhex(
        "1800" "0000" "10000000" "00100000007f0000" "0300000000000000")


def test_header_parse_round_trip():
    raw = build_header(FileKind.PAGES, 8192, 0x1234)
    h = parse_header(raw)
    assert (h.file_kind, h.version, h.payload_length, h.crc32) == (FileKind.PAGES, FORMAT_VERSION, 8192, 0x1234)
    assert len(raw) == HEADER_SIZE


# --- the image directory -----------------------------------------------------------------

PAGE_A = bytes([0xAA]) * PAGE_SIZE
PAGE_B = bytes([0xBB]) * PAGE_SIZE
PAGE_C = bytes(range(256)) * (PAGE_SIZE // 256)


def write_image(target, pids=(100, 200)) -> dict[int, bytes]:
    """A small two-process image; returns each process's page data."""
    data = {}
    with ImageWriter(target) as image:
        image.write_inventory(make_inventory(pids))
        for pid in pids:
            image.write_process(make_process(pid))
            with image.pages_writer(pid, buffer_size=2 * PAGE_SIZE, nbuffers=2) as pages:
                off1 = pages.write(PAGE_A + PAGE_B)
                pages.add_run(0x7f0000000000, 2, off1)
                buf = pages.get_buffer()
                buf[:PAGE_SIZE] = PAGE_C
                off2 = pages.submit(buf, PAGE_SIZE)
                pages.add_run(0x7f0000100000, 1, off2)
            data[pid] = PAGE_A + PAGE_B + PAGE_C
    return data


@pytest.fixture
def image_dir(tmp_path):
    target = tmp_path / "ckpt"
    write_image(target)
    return target


def test_golden_image_reads_back(image_dir):
    with ImageReader(image_dir) as image:
        assert image.inventory == dataclasses.replace(make_inventory((100, 200)), image_id=image.inventory.image_id)
        assert len(image.inventory.image_id) == 32      # the writer gives every image an id
        assert image.version == FORMAT_VERSION
        for pid in (100, 200):
            assert image.process(pid) == make_process(pid)
            assert image.unknown_entries(pid) == ()
            runs = image.page_runs(pid)
            assert runs == [PageRun(0x7f0000000000, 2, 0), PageRun(0x7f0000100000, 1, 2 * PAGE_SIZE)]
            assert image.read_pages(pid, runs[0]) == PAGE_A + PAGE_B
            assert image.read_pages(pid, runs[1]) == PAGE_C
            fd, offset = image.pages_location(pid, runs[1])
            assert os.pread(fd, PAGE_SIZE, offset) == PAGE_C
            assert image.pages_length(pid) == 3 * PAGE_SIZE
            assert image.pages_crc32(pid) == zlib.crc32(PAGE_A + PAGE_B + PAGE_C)
            assert image.pages_crc_ok(pid)
    assert sorted(os.listdir(image_dir)) == sorted(
        ["inventory.img"] + [f(p) for p in (100, 200) for f in (core_name, pagemap_name, pages_name)])


def test_read_inventory_alone(tmp_path):
    """The inventory without the records after it (a lock's owner asks what an image is),
    and still every check of the file: checksum, not an image."""
    target = tmp_path / "ckpt"
    with ImageWriter(target) as image:
        image.write_inventory(make_inventory((100,)), [Zombie(pid=101, ppid=100, pgid=100, sid=1, wait_status=0)])
        image.write_process(make_process(100))
        with image.pages_writer(100) as pages:
            pages.add_run(0x7f0000000000, 1, pages.write(PAGE_A))
    assert ImageReader.read_inventory(target) == dataclasses.replace(make_inventory((100,)), image_id=image.image_id)
    raw = bytearray((target / "inventory.img").read_bytes())
    raw[-1] ^= 0xFF                                  # in the ZOMBIE record, after the INVENTORY
    (target / "inventory.img").write_bytes(raw)
    with pytest.raises(CorruptImage, match="checksum"):
        ImageReader.read_inventory(target)
    with pytest.raises(NotAnImage):
        ImageReader.read_inventory(tmp_path)


def test_pages_file_layout(image_dir):
    raw = (image_dir / pages_name(100)).read_bytes()
    assert len(raw) == PAGES_DATA_OFFSET + 3 * PAGE_SIZE
    assert raw[:4] == b"PTCK" and raw[HEADER_SIZE:PAGES_DATA_OFFSET] == bytes(PAGES_DATA_OFFSET - HEADER_SIZE)
    header = parse_header(raw[:HEADER_SIZE])
    assert header.file_kind == FileKind.PAGES and header.payload_length == 3 * PAGE_SIZE
    assert raw[PAGES_DATA_OFFSET:] == PAGE_A + PAGE_B + PAGE_C


def test_reader_does_not_modify_the_image(image_dir):
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in image_dir.iterdir()}
    with ImageReader(image_dir) as image:
        image.read_pages(100, image.page_runs(100)[0])
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in image_dir.iterdir()} == before


def test_modes_do_not_depend_on_umask(tmp_path):
    old = os.umask(0o277)
    try:
        write_image(tmp_path / "ckpt", pids=(100,))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "ckpt").stat().st_mode) == 0o700
    for f in (tmp_path / "ckpt").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f.name


def test_nothing_visible_until_commit_and_no_temp_left(tmp_path):
    target = tmp_path / "ckpt"
    image = ImageWriter(target).create()
    assert not target.exists()
    [temp] = [p for p in tmp_path.iterdir()]
    assert temp.name.startswith(".ckpt.tmp-") and stat.S_IMODE(temp.stat().st_mode) == 0o700
    image.write_inventory(make_inventory((100,)))
    image.write_process(make_process(100))
    image.pages_writer(100).close()
    assert not target.exists()
    image.commit()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    ImageReader(target).open().close()


def test_existing_empty_directory_is_replaced(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    write_image(target, pids=(100,))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert (target / "inventory.img").exists()


def test_abort_and_exception_leave_nothing(tmp_path):
    target = tmp_path / "ckpt"
    image = ImageWriter(target).create()
    image.write_inventory(make_inventory((100,)))
    pages = image.pages_writer(100)
    pages.write(PAGE_A)
    image.abort()
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(RuntimeError):
        with ImageWriter(target) as image:
            image.write_inventory(make_inventory((100,)))
            with image.pages_writer(100) as pages:
                pages.write(PAGE_A)
                raise RuntimeError("dump failed")
    assert list(tmp_path.iterdir()) == []


def test_destination_exists(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old").write_bytes(b"x")
    with pytest.raises(DestinationExists):
        ImageWriter(target).create()
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(DestinationExists):
        ImageWriter(tmp_path / "file").create()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "file"]


def test_destination_filled_while_writing(tmp_path):
    target = tmp_path / "ckpt"
    image = ImageWriter(target).create()
    image.write_inventory(make_inventory((100,)))
    image.write_process(make_process(100))
    image.pages_writer(100).close()
    target.mkdir()
    (target / "other").write_bytes(b"x")
    with pytest.raises(DestinationExists):
        image.commit()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert [p.name for p in target.iterdir()] == ["other"]


def test_incomplete_image_is_refused_at_commit(tmp_path):
    image = ImageWriter(tmp_path / "ckpt").create()
    image.write_inventory(make_inventory((100, 200)))
    image.write_process(make_process(100))
    image.pages_writer(100).close()
    with pytest.raises(ValueError, match="process 200 has no core"):
        image.commit()
    image.abort()
    assert list(tmp_path.iterdir()) == []


def test_os_errors_become_image_write_errors(tmp_path, monkeypatch):
    with pytest.raises(ImageWriteError):
        ImageWriter(tmp_path / "missing-parent" / "ckpt").create()

    image = ImageWriter(tmp_path / "ckpt").create()
    real_pwrite = os.pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(image_mod.os, "pwrite", full)
    with pytest.raises(ImageWriteError, match="No space left") as info:
        image.write_process(make_process(100))
    assert info.value.errno == errno.ENOSPC and isinstance(info.value.__cause__, OSError)
    pages = image.pages_writer(100)
    buf = pages.get_buffer()
    pages.submit(buf, PAGE_SIZE)
    with pytest.raises(ImageWriteError, match="pages-100.img"):
        pages.close()
    monkeypatch.setattr(image_mod.os, "pwrite", real_pwrite)
    image.abort()
    assert list(tmp_path.iterdir()) == []


def test_pages_writer_offsets_and_crc(tmp_path):
    image = ImageWriter(tmp_path / "ckpt").create()
    image.write_inventory(make_inventory((100,)))
    proc = make_process(100)
    image.write_process(dataclasses.replace(proc, vmas=proc.vmas + (
        make_vma(0x10000000, 20 * 0x100, VmaKind.ANON_PRIVATE, ""),)))     # where the runs go
    pages = image.pages_writer(100, buffer_size=4 * PAGE_SIZE, nbuffers=2)
    expected = bytearray()
    offsets = []
    mine = bytearray(3 * PAGE_SIZE)
    for i in range(20):                                  # interleave both APIs, reuse every buffer
        if i % 3 == 0:
            mine[:] = bytes([i]) * len(mine)
            offsets.append(pages.write(memoryview(mine)))
            expected += mine
        else:
            buf = pages.get_buffer()
            n = (i % 4 + 1) * PAGE_SIZE
            buf[:n] = bytes([i]) * n
            offsets.append(pages.submit(buf, n))
            expected += bytes([i]) * n
        pages.add_run(0x10000000 + i * 0x100000, 1, offsets[-1])
    assert pages.submit(pages.get_buffer(), 0) == len(expected)      # returning an unused buffer
    assert pages.length == len(expected)
    pages.close()
    image.commit()
    sizes = [3 if i % 3 == 0 else i % 4 + 1 for i in range(20)]
    assert offsets == [sum(sizes[:i]) * PAGE_SIZE for i in range(20)]
    with ImageReader(tmp_path / "ckpt") as reader:
        assert reader.pages_crc32(100) == zlib.crc32(expected)
        assert reader.pages_length(100) == len(expected)
        fd, off = reader.pages_location(100, PageRun(0, 1, 0))
        assert os.pread(fd, len(expected), off) == expected


def test_pages_writer_misuse(tmp_path):
    image = ImageWriter(tmp_path / "ckpt").create()
    pages = image.pages_writer(100, buffer_size=PAGE_SIZE, nbuffers=1)
    with pytest.raises(ValueError, match="whole pages"):
        pages.write(b"x" * 100)
    with pytest.raises(ValueError, match="get_buffer"):
        pages.submit(memoryview(bytearray(PAGE_SIZE)), PAGE_SIZE)
    buf = pages.get_buffer()
    with pytest.raises(ValueError, match="multiple"):
        pages.submit(buf, 10)
    pages.add_run(0x1000, 2, 0)                           # more pages than written
    with pytest.raises(ValueError, match="bad page run"):
        pages.close()
    image.abort()


def test_empty_pages(tmp_path):
    with ImageWriter(tmp_path / "ckpt") as image:
        image.write_inventory(make_inventory((100,)))
        image.write_process(make_process(100))
        image.pages_writer(100).close()
    with ImageReader(tmp_path / "ckpt") as reader:
        assert reader.page_runs(100) == [] and reader.pages_length(100) == 0
        assert reader.pages_crc_ok(100)


# --- the reader's validation ---------------------------------------------------------------

def _patch(path, offset, data: bytes):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_not_an_image(tmp_path):
    with pytest.raises(NotAnImage, match="no such directory"):
        ImageReader(tmp_path / "nope").open()
    with pytest.raises(NotAnImage, match="inventory"):
        ImageReader(tmp_path).open()


@pytest.mark.parametrize("name", ["inventory.img", "core-100.img", "pagemap-200.img", "pages-100.img"])
def test_bad_magic(image_dir, name):
    _patch(image_dir / name, 0, b"CRIU")
    with pytest.raises(BadMagic) as info:
        ImageReader(image_dir).open()
    assert info.value.found == b"CRIU" and info.value.path.endswith(name)


@pytest.mark.parametrize("name", ["inventory.img", "core-100.img", "pagemap-100.img", "pages-200.img"])
def test_truncated_file(image_dir, name):
    path = image_dir / name
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(CorruptImage, match="truncated"):
        ImageReader(image_dir).open()
    os.truncate(path, 10)
    with pytest.raises(CorruptImage, match="truncated header"):
        ImageReader(image_dir).open()


def test_extra_bytes_after_payload(image_dir):
    with open(image_dir / "core-100.img", "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptImage, match="unexpected bytes"):
        ImageReader(image_dir).open()


@pytest.mark.parametrize("name", ["inventory.img", "core-200.img", "pagemap-100.img", "pages-100.img"])
def test_flipped_byte_is_a_checksum_mismatch(image_dir, name):
    path = image_dir / name
    offset = path.stat().st_size - 5
    raw = path.read_bytes()
    _patch(path, offset, bytes([raw[offset] ^ 0x10]))
    with pytest.raises(CorruptImage, match="checksum mismatch"):
        ImageReader(image_dir).open()


def test_pages_checksum_can_be_deferred(image_dir):
    path = image_dir / "pages-100.img"
    _patch(path, PAGES_DATA_OFFSET + 7, b"\x00")
    with ImageReader(image_dir, verify_pages=False) as reader:
        assert not reader.pages_crc_ok(100)
        assert reader.pages_crc_ok(200)


@pytest.mark.parametrize("name", ["inventory.img", "core-100.img", "pages-200.img"])
def test_newer_version_is_unsupported(image_dir, name):
    _patch(image_dir / name, 6, (FORMAT_VERSION + 1).to_bytes(2, "little"))
    with pytest.raises(UnsupportedVersion) as info:
        ImageReader(image_dir).open()
    assert info.value.found == FORMAT_VERSION + 1 and info.value.supported == FORMAT_VERSION


def test_wrong_file_kind(image_dir):
    (image_dir / "core-100.img").write_bytes((image_dir / "pagemap-100.img").read_bytes())
    with pytest.raises(CorruptImage, match="file kind PAGEMAP, expected CORE"):
        ImageReader(image_dir).open()


def test_missing_per_process_file(image_dir):
    os.unlink(image_dir / "pagemap-200.img")
    with pytest.raises(CorruptImage, match="pagemap-200.img: corrupt image: missing"):
        ImageReader(image_dir).open()


@pytest.mark.parametrize("state", [PidfdState(pid=999, flags=0, target=1, desc=1),      # not in the image
                                   PidfdState(pid=100, flags=0o2, target=1, desc=1),      # O_RDWR: no pidfd flag
                                   PidfdState(pid=-1, flags=0, target=0, desc=1)])
def test_pidfd_of_no_process_of_the_image_is_corrupt(tmp_path, state):
    with ImageWriter(tmp_path / "ckpt") as image:
        image.write_inventory(make_inventory((100, 200)), [state])
        for pid in (100, 200):
            image.write_process(make_process(pid))
            with image.pages_writer(pid) as pages:
                pages.add_run(0x7f0000000000, 1, pages.write(PAGE_A))
    with pytest.raises(CorruptImage, match="pidfd"):
        ImageReader(tmp_path / "ckpt").open()


def _rewrite_core(path, records):
    from ptckpt.formats.records import build_file
    path.write_bytes(build_file(FileKind.CORE, records))


def test_undecodable_entry_is_corrupt(image_dir):
    proc = make_process(100)
    _rewrite_core(image_dir / "core-100.img",
                  [proc.task, proc.creds, proc.mm, RawEntry(EntryKind.VMA, b"\x01\x02")])
    with pytest.raises(CorruptImage, match="VMA entry"):
        ImageReader(image_dir).open()


def test_core_structure_is_checked(image_dir):
    proc = make_process(100)
    _rewrite_core(image_dir / "core-100.img", [proc.task, proc.mm])
    with pytest.raises(CorruptImage, match="no CREDS entry"):
        ImageReader(image_dir).open()
    _rewrite_core(image_dir / "core-100.img", [make_task(pid=999), proc.creds, proc.mm])
    with pytest.raises(CorruptImage, match="pid 999"):
        ImageReader(image_dir).open()
    _rewrite_core(image_dir / "core-100.img", [proc.task, proc.creds, proc.mm, PageRun(0, 1, 0)])
    with pytest.raises(CorruptImage, match="PAGE_RUN entry in a CORE file"):
        ImageReader(image_dir).open()


def test_unknown_core_entries_are_refused(image_dir):
    """Only a newer writer knows more kinds, and its images are refused by version: in an
    image of a version this reader knows, an unknown kind is damage, and skipping it would
    lose what it held."""
    proc = make_process(100)
    plugin = RawEntry(999, b"plugin state")
    _rewrite_core(image_dir / "core-100.img", [proc.task, plugin, proc.creds, proc.mm, *proc.vmas,
                                               *proc.threads])
    with pytest.raises(CorruptImage, match="unknown kind 999"):
        ImageReader(image_dir).open()


def test_page_run_outside_the_data_is_corrupt(image_dir):
    from ptckpt.formats.image import build_file_from_runs
    (image_dir / "pagemap-100.img").write_bytes(build_file_from_runs([(0x1000, 4, 0)]))
    with pytest.raises(CorruptImage, match="does not fit"):
        ImageReader(image_dir).open()


def test_ghost_file_format_17_device_numbers_and_link_target():
    """A GHOST_FILE record of format 17 ends with a device node's st_rdev (u64) and a symbolic
    link's target; a format-16 one has neither and takes 0 and ""."""
    ghost = GhostFile(dev=1, ino=2, path="/d/l", mode=0o120777, uid=0, gid=0, data=b"",
                      rdev=0x103, target="t")
    payload = build_record(ghost)
    assert payload.endswith(bytes.fromhex("0301000000000000" "01" "74"))
    assert parse_record(EntryKind.GHOST_FILE, payload) == ghost
    old = parse_record(EntryKind.GHOST_FILE, payload[:-10], version=16)
    assert old == dataclasses.replace(ghost, rdev=0, target="")

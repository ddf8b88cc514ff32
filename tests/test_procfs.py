"""Tests of ptckpt.procfs: every parser on the fixture tree (tests/proc_tree,
exact values) and on live processes (this one and python3 children)."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ptckpt import errors, procfs
from ptckpt.procfs import (
    PAGE_IS_FILE, PAGE_IS_PFNZERO, PAGE_IS_PRESENT, PAGE_IS_SOFT_DIRTY, PAGE_IS_SWAPPED,
    PAGE_SIZE, FdInfo, MapEntry, PageRun, Rlimit, ScanMethod, SyscallInfo,
)

TREE = Path(__file__).parent / "proc_tree"
PID = 4242
TID2 = 4243
P = PAGE_SIZE
PROT_R, PROT_W, PROT_X = procfs.PROT_READ, procfs.PROT_WRITE, procfs.PROT_EXEC

# --- the fixture tree -------------------------------------------------------

AUXV = [(33, 0x7FFD00001000), (16, 0x178BFBFF), (6, 4096), (17, 100), (3, 0x400040),
        (9, 0x401000), (11, 1000), (23, 0)]
CMDLINE = [b"/usr/bin/my prog", b"--flag", b"", b"last arg"]
ENVIRON = [b"HOME=/root", b"EMPTY=", b"NOEQUALS", b"A=b=c"]
FD_LINKS = {0: "/dev/pts/0", 3: "anon_inode:[eventfd]", 4: "anon_inode:[eventpoll]",
            5: "anon_inode:inotify", 6: "anon_inode:[timerfd]"}

# A fake pagemap: base page -> entry.  Built in the tmp copy (binary).
PM_BASE = 0x400000


def _pagemap_entries(zero_pfn: int) -> list[int]:
    present, swapped, file_, sd = 1 << 63, 1 << 62, 1 << 61, 1 << 55
    return [
        present | 0x1234,                  # 0 anon data
        present | 0x1235,                  # 1 anon data
        present | zero_pfn,                # 2 zero page
        present | sd | zero_pfn,           # 3 zero page, soft-dirty
        swapped | (0x55 << 5) | 1,         # 4 swapped
        present | file_ | 0x2000,          # 5 page cache
        0,                                 # 6 hole
        sd,                                # 7 hole in a soft-dirty VMA
        present | sd | 0x3000,             # 8 anon, soft-dirty
        present | 0x3001,                  # 9 anon
    ]


@pytest.fixture
def tree(tmp_path: Path) -> str:
    """A copy of tests/proc_tree plus what git cannot hold as hand-written
    text: binary files (auxv, cmdline, environ, pagemap) and symlinks."""
    root = tmp_path / "proc"
    shutil.copytree(TREE, root)
    d = root / str(PID)
    (d / "auxv").write_bytes(b"".join(struct.pack("=QQ", t, v) for t, v in AUXV)
                             + struct.pack("=QQ", 0, 0) + b"\0" * 32)
    (d / "cmdline").write_bytes(b"\0".join(CMDLINE) + b"\0")
    (d / "environ").write_bytes(b"\0".join(ENVIRON) + b"\0")
    (d / "fd").mkdir()
    for fd, target in FD_LINKS.items():
        os.symlink(target, d / "fd" / str(fd))
    os.symlink("/usr/bin/my prog (deleted)", d / "exe")
    os.symlink("/home/u/work dir", d / "cwd")
    os.symlink("/", d / "root")
    zero = procfs.zero_page_pfn() or 0x777
    with open(d / "pagemap", "wb") as f:
        f.seek((PM_BASE // P) * 8)
        f.write(struct.pack(f"={len(_pagemap_entries(zero))}Q", *_pagemap_entries(zero)))
    return str(root)


def test_fixture_maps(tree):
    maps = procfs.read_maps(PID, procfs=tree)
    assert maps == [
        MapEntry(0x400000, 0x401000, "r-xp", PROT_R | PROT_X, False, 0, 0xFD, 1, 1234,
                 "/usr/bin/my prog", False),
        MapEntry(0x600000, 0x602000, "rw-p", PROT_R | PROT_W, False, 0x1000, 0xFD, 1, 1234,
                 "/usr/bin/my prog", False),
        MapEntry(0x1A00000, 0x1A21000, "rw-p", PROT_R | PROT_W, False, 0, 0, 0, 0, "[heap]", False),
        MapEntry(0x7F0000000000, 0x7F0000001000, "rw-s", PROT_R | PROT_W, True, 0, 0, 1, 4711,
                 "/memfd:shm buf", True),
        MapEntry(0x7F0000001000, 0x7F0000003000, "r--p", PROT_R, False, 0x2000, 0x103, 2, 99,
                 "/tmp/new\nline", False),
        MapEntry(0x7F0000003000, 0x7F0000004000, "---p", 0, False, 0, 0, 0, 0, "", False),
        MapEntry(0x7FFD00000000, 0x7FFD00021000, "rw-p", PROT_R | PROT_W, False, 0, 0, 0, 0,
                 "[stack]", False),
        MapEntry(0xFFFFFFFFFF600000, 0xFFFFFFFFFF601000, "--xp", PROT_X, False, 0, 0, 0, 0,
                 "[vsyscall]", False),
    ]
    assert maps[2].is_pseudo and not maps[0].is_pseudo
    assert maps[1].size == 2 * P


def test_fixture_smaps(tree):
    smaps = procfs.read_smaps(PID, procfs=tree)
    maps = procfs.read_maps(PID, procfs=tree)
    assert [s.map_entry() for s in smaps] == [maps[0], maps[2], maps[3]]
    text, heap, shm = smaps
    assert text.counters["Rss"] == 4 and text.counters["Pss"] == 2
    assert text.counters["Shared_Clean"] == 4 and text.counters["THPeligible"] == 0
    assert text.vmflags == "rd ex mr mw me sd"
    assert heap.counters == {
        "Size": 132, "KernelPageSize": 4, "MMUPageSize": 4, "Rss": 20, "Pss": 20,
        "Pss_Dirty": 20, "Shared_Clean": 0, "Shared_Dirty": 0, "Private_Clean": 0,
        "Private_Dirty": 20, "Referenced": 20, "Anonymous": 20, "KSM": 0, "LazyFree": 0,
        "AnonHugePages": 0, "ShmemPmdMapped": 0, "FilePmdMapped": 0, "Shared_Hugetlb": 0,
        "Private_Hugetlb": 0, "Swap": 8, "SwapPss": 8, "Locked": 0, "THPeligible": 1,
        "ProtectionKey": 0,
    }
    assert heap.vmflag_set == {"rd", "wr", "mr", "mw", "me", "ac", "sd"}
    assert shm.path == "/memfd:shm buf" and shm.deleted and shm.shared
    assert "sh" in shm.vmflag_set


def test_fixture_stat(tree):
    st = procfs.read_stat(PID, procfs=tree)
    assert st.pid == PID and st.comm == "my ) (prog" and st.state == "S"
    # the fixture holds field number k as the value of field k (man 5 proc)
    for number, name in enumerate(procfs.Stat._fields[3:], start=4):
        assert getattr(st, name) == number, name
    assert (st.start_time, st.exit_signal, st.start_brk, st.exit_code) == (22, 38, 47, 52)
    assert not st.is_kthread
    assert procfs.read_stat(PID, PID, procfs=tree) == st

    t = procfs.read_stat(PID, TID2, procfs=tree)
    assert (t.pid, t.comm, t.state, t.ppid, t.pgrp, t.session) == (TID2, "worker 1", "R", 1, 4242, 4242)
    assert (t.tty_nr, t.tpgid, t.flags) == (0, -1, 0x400040)
    assert (t.utime, t.stime, t.priority, t.nice, t.num_threads) == (3, 1, 20, 0, 2)
    assert (t.start_time, t.vsize, t.rss, t.rsslim) == (1001, 8192000, 300, 2**64 - 1)
    assert (t.start_code, t.end_code, t.start_stack) == (0x400000, 0x401000, 140724603453440)
    assert (t.exit_signal, t.processor, t.rt_priority, t.policy) == (-1, 1, 0, 0)
    assert (t.start_data, t.end_data, t.start_brk) == (0x600000, 0x602000, 0x1A00000)
    assert (t.arg_start, t.arg_end, t.env_start, t.env_end, t.exit_code) == \
        (140724603457000, 140724603457100, 140724603457100, 140724603458000, 0)


def test_fixture_stat_short_line_pads_with_zeros(tree):
    path = Path(tree, str(PID), "stat")
    path.write_text("4242 (old) S 1 4242 4242 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5\n")
    st = procfs.read_stat(PID, procfs=tree)
    assert (st.comm, st.ppid, st.start_time, st.vsize, st.exit_code) == ("old", 1, 5, 0, 0)


def test_fixture_status(tree):
    s = procfs.read_status(PID, procfs=tree)
    assert (s.name, s.umask, s.state) == ("my ) (prog", 0o027, "S")
    assert (s.tgid, s.ngid, s.pid, s.ppid, s.tracer_pid) == (4242, 0, 4242, 4, 77)
    assert s.uids == (1000, 1001, 1002, 1003) and s.gids == (2000, 2001, 2002, 2003)
    assert s.fd_size == 64 and s.groups == (4, 24, 27)
    assert (s.nstgid, s.nspid, s.nspgid, s.nssid) == ((4242, 1), (4242, 1), (5, 0), (6, 0))
    assert s.kthread is False and s.threads == 2 and s.sig_q == (3, 96364)
    assert (s.sig_pnd, s.shd_pnd, s.sig_blk, s.sig_ign, s.sig_cgt) == \
        (0x100, 0x4000, 0x10000, 0x1001000, 0x180000002)
    assert (s.cap_inh, s.cap_prm, s.cap_eff, s.cap_bnd, s.cap_amb) == \
        (0, 0x1FFFEFFFFFF, 0x1FFFEFFFFFF, 0x1FFFEFFFFFF, 0x400)
    assert s.no_new_privs is True and s.seccomp == 2 and s.seccomp_filters == 1
    assert s.core_dumping is False
    assert (s.cpus_allowed_list, s.mems_allowed_list) == ("0-1", "0")
    assert (s.voluntary_ctxt_switches, s.nonvoluntary_ctxt_switches) == (150, 7)
    assert s.vm["VmPeak"] == 9000 and s.vm["VmSwap"] == 8 and s.vm["RssFile"] == 1588
    assert s.vm["HugetlbPages"] == 0 and "THP_enabled" not in s.vm
    assert s.raw["Speculation_Store_Bypass"] == "vulnerable"


def test_fixture_status_kthread_without_kthread_line(tree):
    """Before the "Kthread:" line (6.x), PF_KTHREAD in stat field 9 tells."""
    d = Path(tree, str(PID))
    status = d / "status"
    status.write_text("".join(line for line in status.read_text().splitlines(True)
                              if not line.startswith("Kthread:")))
    assert procfs.read_status(PID, procfs=tree).kthread is False
    stat = d / "stat"     # field 9 (flags) holds 9 in the fixture
    stat.write_text(stat.read_text().replace(" 8 9 10 ", f" 8 {procfs.PF_KTHREAD | 0x40} 10 "))
    assert procfs.read_stat(PID, procfs=tree).flags == procfs.PF_KTHREAD | 0x40
    assert procfs.read_status(PID, procfs=tree).kthread is True


def test_fixture_status_escaped_name(tree):
    status = Path(tree, str(PID), "status")
    status.write_text(status.read_text().replace("Name:\tmy ) (prog", "Name:\ta\\nb\\\\c"))
    assert procfs.read_status(PID, procfs=tree).name == "a\nb\\c"


def test_fixture_tasks_and_children(tree):
    assert procfs.list_tids(PID, procfs=tree) == [4242, 4243]
    assert procfs.read_children(PID, procfs=tree) == [4300, 4301, 4302]
    assert procfs.read_comm(PID, procfs=tree) == "my ) (prog"
    assert procfs.read_comm(PID, TID2, procfs=tree) == "worker 1"


def test_fixture_small_files(tree):
    assert procfs.read_auxv(PID, procfs=tree) == AUXV
    assert procfs.read_cmdline(PID, procfs=tree) == [os.fsdecode(a) for a in CMDLINE]
    assert procfs.read_environ(PID, procfs=tree) == [os.fsdecode(e) for e in ENVIRON]
    assert procfs.read_exe(PID, procfs=tree) == "/usr/bin/my prog (deleted)"
    assert procfs.read_cwd(PID, procfs=tree) == "/home/u/work dir"
    assert procfs.read_root(PID, procfs=tree) == "/"
    assert procfs.read_oom_score_adj(PID, procfs=tree) == -500
    assert procfs.read_timerslack_ns(PID, procfs=tree) == 50000
    assert procfs.read_personality(PID, procfs=tree) == 0x00400000
    assert procfs.read_sessionid(PID, procfs=tree) == 3
    assert procfs.read_wchan(PID, procfs=tree) == "do_sys_poll"
    assert procfs.read_wchan(PID, TID2, procfs=tree) == "0"


def test_fixture_syscall(tree):
    info = procfs.read_syscall(PID, PID, procfs=tree)
    assert info == SyscallInfo(False, 7, (0x7FFD00020000, 1, 0xFFFFFFFF, 0, 0, 0),
                               0x7FFD00020F00, 0x7F0000001234)
    assert info.in_syscall
    assert procfs.read_syscall(PID, procfs=tree) == info
    assert procfs.read_syscall(PID, TID2, procfs=tree) == SyscallInfo(True, None, (), None, None)
    Path(tree, str(PID), "syscall").write_text("-1 0x7ffd00020f00 0x7f0000001234\n")
    blocked = procfs.read_syscall(PID, procfs=tree)
    assert blocked == SyscallInfo(False, -1, (), 0x7FFD00020F00, 0x7F0000001234)
    assert not blocked.in_syscall


def test_fixture_limits(tree):
    inf = procfs.RLIM_INFINITY
    assert inf == 2**64 - 1
    limits = procfs.read_limits(PID, procfs=tree)
    assert [r.resource for r in limits] == list(range(16))
    assert limits[resource.RLIMIT_STACK] == Rlimit(3, 8388608, inf)
    assert limits[resource.RLIMIT_NOFILE] == Rlimit(7, 1024, 4096)
    assert limits[resource.RLIMIT_CPU] == Rlimit(0, inf, inf)
    assert limits[resource.RLIMIT_CORE] == Rlimit(4, 0, inf)
    assert limits[13] == Rlimit(13, 0, 0) and limits[15] == Rlimit(15, inf, inf)


def test_fixture_fds(tree):
    assert procfs.list_fds(PID, procfs=tree) == [0, 3, 4, 5, 6]
    for fd, target in FD_LINKS.items():
        assert procfs.readlink_fd(PID, fd, procfs=tree) == target
    assert procfs.read_fdinfo(PID, 0, procfs=tree) == FdInfo(10, 0o2100002, 25, 1234, {})
    ev = procfs.read_fdinfo(PID, 3, procfs=tree)
    assert (ev.pos, ev.flags, ev.mnt_id, ev.ino) == (0, 0o2004002, 15, 1057)
    assert ev.extra == {"eventfd-count": ["5"], "eventfd-id": ["3"], "eventfd-semaphore": ["0"]}
    ep = procfs.read_fdinfo(PID, 4, procfs=tree)
    assert ep.extra == {"tfd": [
        "5 events:       19 data:                5  pos:0 ino:3a5 sdev:f",
        "6 events:        1 data:                6  pos:0 ino:3a6 sdev:f"]}
    ino = procfs.read_fdinfo(PID, 5, procfs=tree)
    assert ino.flags == 0 and ino.extra == {"inotify": [
        "wd:1 ino:a2 sdev:800013 mask:800afce ignored_mask:0 fhandle-bytes:8 "
        "fhandle-type:1 f_handle:a200000000000000",
        "wd:2 ino:a3 sdev:800013 mask:2 ignored_mask:0 fhandle-bytes:8 "
        "fhandle-type:1 f_handle:a300000000000000"]}
    tfd = procfs.read_fdinfo(PID, 6, procfs=tree)
    assert tfd.extra == {"clockid": ["1"], "ticks": ["0"], "settime flags": ["01"],
                         "it_value": ["(0, 999)"], "it_interval": ["(1, 0)"]}
    with pytest.raises(procfs.FdGone) as exc:
        procfs.read_fdinfo(PID, 9, procfs=tree)
    assert exc.value.fd == 9 and exc.value.pid == PID
    with pytest.raises(procfs.FdGone):
        procfs.readlink_fd(PID, 9, procfs=tree)


def test_fixture_map_files(tree):
    st = procfs.stat_map_file(PID, 0x400000, 0x401000, procfs=tree)
    assert st is not None and st.st_size == 2
    assert procfs.stat_map_file(PID, 0x1A00000, 0x1A21000, procfs=tree) is None
    with pytest.raises(errors.NoSuchProcess):
        procfs.stat_map_file(PID + 100, 0x400000, 0x401000, procfs=tree)


def test_fixture_read_pagemap(tree):
    raw = procfs.read_pagemap(PID, PM_BASE, PM_BASE + 10 * P, procfs=tree)
    assert len(raw) == 80
    entries = [procfs.decode_pagemap_entry(v) for v in procfs.pagemap_values(raw)]
    assert entries[0].present and entries[0].pfn == 0x1234 and not entries[0].file_or_shared
    assert entries[4].swapped and not entries[4].present
    assert (entries[4].swap_type, entries[4].swap_offset, entries[4].pfn) == (1, 0x55, 0)
    assert entries[5].file_or_shared and entries[3].soft_dirty and not entries[6].present
    # unaligned bounds are widened to whole pages
    assert procfs.read_pagemap(PID, PM_BASE + 1, PM_BASE + P + 1, procfs=tree) == raw[:16]


def test_fixture_scan_pages_fallback(tree):
    """A regular file refuses PAGEMAP_SCAN (ENOTTY): AUTO parses the entries."""
    if procfs.zero_page_pfn() is None:
        pytest.skip("PFNs are hidden (not CAP_SYS_ADMIN): the zero page is unknown")
    base = PM_BASE
    runs = procfs.scan_pages(PID, base, base + 10 * P, procfs=tree)
    assert runs == [
        PageRun(base, base + 2 * P, PAGE_IS_PRESENT),
        PageRun(base + 4 * P, base + 5 * P, PAGE_IS_SWAPPED),
        PageRun(base + 5 * P, base + 6 * P, PAGE_IS_PRESENT | PAGE_IS_FILE),
        PageRun(base + 8 * P, base + 10 * P, PAGE_IS_PRESENT),
    ]
    assert runs[0].npages == 2 and runs[2].is_file and runs[1].is_swapped
    assert procfs.scan_pages(PID, base, base + 10 * P, method=ScanMethod.PAGEMAP,
                             procfs=tree) == runs
    assert procfs.scan_pages(PID, base, base + 10 * P, skip_file=True, procfs=tree) == \
        [runs[0], runs[1], runs[3]]
    with_zero = procfs.scan_pages(PID, base, base + 10 * P, skip_zero=False, procfs=tree)
    assert with_zero[:2] == [PageRun(base, base + 2 * P, PAGE_IS_PRESENT),
                             PageRun(base + 2 * P, base + 4 * P, PAGE_IS_PRESENT | PAGE_IS_PFNZERO)]
    assert with_zero[1].is_zero
    sd = procfs.scan_pages(PID, base, base + 10 * P, procfs=tree,
                           return_mask=PAGE_IS_PRESENT | PAGE_IS_SOFT_DIRTY)
    assert sd == [PageRun(base, base + 2 * P, PAGE_IS_PRESENT),
                  PageRun(base + 4 * P, base + 5 * P, 0),
                  PageRun(base + 5 * P, base + 6 * P, PAGE_IS_PRESENT),
                  PageRun(base + 8 * P, base + 9 * P, PAGE_IS_PRESENT | PAGE_IS_SOFT_DIRTY),
                  PageRun(base + 9 * P, base + 10 * P, PAGE_IS_PRESENT)]
    # a run that crosses the fallback's chunk boundary stays one run
    old = procfs._FALLBACK_CHUNK_PAGES
    try:
        procfs._FALLBACK_CHUNK_PAGES = 3
        assert procfs.scan_pages(PID, base, base + 10 * P, procfs=tree) == runs
    finally:
        procfs._FALLBACK_CHUNK_PAGES = old
    assert procfs.scan_pages(PID, base, base, procfs=tree) == []
    with pytest.raises(procfs.ProcfsError):
        procfs.scan_pages(PID, base, base + P, method=ScanMethod.IOCTL, procfs=tree)


def test_fixture_errors(tree, monkeypatch):
    with pytest.raises(errors.NoSuchProcess) as exc:
        procfs.read_stat(4241, procfs=tree)
    assert exc.value.pid == 4241 and exc.value.exit_code == errors.ExitCode.NO_SUCH_PROCESS
    with pytest.raises(errors.NoSuchProcess, match="no such thread: 4299"):
        procfs.read_stat(PID, 4299, procfs=tree)
    with pytest.raises(errors.NoSuchProcess):
        procfs.list_tids(4241, procfs=tree)
    os.unlink(Path(tree, str(PID), "wchan"))
    with pytest.raises(procfs.ProcEntryMissing) as missing:
        procfs.read_wchan(PID, procfs=tree)
    assert not isinstance(missing.value, errors.NoSuchProcess)
    assert missing.value.path.endswith(f"/{PID}/wchan") and missing.value.pid == PID

    def denied(path):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(procfs, "_read", denied)
    with pytest.raises(errors.AccessDenied, match=f"not permitted to read /proc of process {PID}"):
        procfs.read_stat(PID, procfs=tree)

    def eio(path):
        raise OSError(errno.EIO, "Input/output error", path)

    monkeypatch.setattr(procfs, "_read", eio)
    with pytest.raises(procfs.ProcfsError) as exc2:
        procfs.read_maps(PID, procfs=tree)
    assert exc2.value.errno == errno.EIO and isinstance(exc2.value, errors.PtckptError)


# --- live processes -----------------------------------------------------------

class Child:
    def __init__(self, popen: subprocess.Popen, info: dict):
        self.popen = popen
        self.pid = popen.pid
        self.info = info


def _wait_blocked_in_read(pid: int, timeout: float = 10.0) -> None:
    """Wait until the child's main thread sleeps in read(0, ...) of stdin."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sc = procfs.read_syscall(pid, pid)
        if sc.nr == 0 and sc.args[0] == 0 and procfs.read_stat(pid, pid).state == "S":
            return
        time.sleep(0.005)
    pytest.fail(f"child {pid} did not block in read(0, ...)")


@pytest.fixture
def pychild(tmp_path: Path):
    """pychild(code, env=None) -> Child: a python3 child that runs `code`
    (which must print one JSON line), then blocks reading stdin.  Killed and
    reaped by the finaliser."""
    children: list[subprocess.Popen] = []

    def start(code: str, env: dict | None = None) -> Child:
        script = textwrap.dedent(code) + "\nimport sys\nsys.stdout.flush()\nsys.stdin.read()\n"
        popen = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, cwd=tmp_path, env=env)
        children.append(popen)
        line = popen.stdout.readline()
        assert line, f"child exited with {popen.wait()}"
        _wait_blocked_in_read(popen.pid)
        return Child(popen, json.loads(line))

    yield start
    for popen in children:
        popen.kill()
        popen.wait()
        popen.stdin.close()
        popen.stdout.close()


@pytest.fixture
def sleeper(pychild):
    return pychild('import json, os; print(json.dumps({"pid": os.getpid()}))',
                   env=dict(os.environ, PTCKPT_TEST="1"))


def test_live_self():
    pid = os.getpid()
    maps = procfs.read_maps(pid)
    exe = procfs.read_exe(pid)
    assert exe == os.path.realpath(sys.executable)
    assert any(m.path == exe for m in maps)
    assert [m.start for m in maps] == sorted(m.start for m in maps)
    st = procfs.read_stat(pid)
    assert st.pid == pid and st.ppid == os.getppid() and st.state == "R"
    assert st.num_threads >= 1 and st.start_code < st.end_code
    assert st.arg_start < st.arg_end <= st.env_start < st.env_end
    heap = [m for m in maps if m.path == "[heap]"]
    if heap:
        # /proc/PID/stat has start_brk (field 47) but not brk: the [heap] VMA gives it
        assert heap[0].start == st.start_brk
    status = procfs.read_status(pid)
    assert (status.pid, status.tgid, status.ppid) == (pid, pid, os.getppid())
    assert status.uids == os.getresuid() + (os.geteuid(),)   # real, effective, saved, fs
    assert status.kthread is False and status.state == "R"
    assert procfs.list_tids(pid)[0] == pid
    auxv = dict(procfs.read_auxv(pid))
    assert auxv[6] == PAGE_SIZE              # AT_PAGESZ
    assert auxv[11] == os.getuid()           # AT_UID
    assert 0 not in auxv                     # AT_NULL left out
    cmdline = open("/proc/self/cmdline", "rb").read().rstrip(b"\0").split(b"\0")
    assert procfs.read_cmdline(pid) == [os.fsdecode(a) for a in cmdline]
    assert procfs.read_cwd(pid) == os.getcwd()
    assert procfs.read_root(pid) == "/"
    assert procfs.read_comm(pid) == st.comm
    libc = ctypes.CDLL(None)
    assert procfs.read_personality(pid) == libc.personality(0xFFFFFFFF)
    assert isinstance(procfs.read_sessionid(pid), int)
    assert procfs.read_timerslack_ns(pid) > 0
    assert -1000 <= procfs.read_oom_score_adj(pid) <= 1000


def test_live_self_limits():
    limits = procfs.read_limits(os.getpid())
    assert len(limits) == 16
    for r in limits:
        cur, hard = resource.getrlimit(r.resource)
        conv = lambda v: procfs.RLIM_INFINITY if v == resource.RLIM_INFINITY else v  # noqa: E731
        assert (r.cur, r.max) == (conv(cur), conv(hard)), r


def test_live_self_fds(tmp_path):
    path = tmp_path / "some file"
    path.write_bytes(b"0123456789")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    efd = os.eventfd(5)
    try:
        os.lseek(fd, 7, os.SEEK_SET)
        pid = os.getpid()
        fds = procfs.list_fds(pid)
        assert fd in fds and efd in fds and fds == sorted(fds)
        assert procfs.readlink_fd(pid, fd) == str(path)
        info = procfs.read_fdinfo(pid, fd)
        assert info.pos == 7
        assert info.flags & os.O_ACCMODE == os.O_RDONLY and info.flags & os.O_CLOEXEC
        assert info.ino == os.fstat(fd).st_ino and info.mnt_id > 0
        ev = procfs.read_fdinfo(pid, efd)
        assert procfs.readlink_fd(pid, efd) == "anon_inode:[eventfd]"
        assert int(ev.extra["eventfd-count"][0], 16) == 5     # printed as %16llx
    finally:
        os.close(fd)
        os.close(efd)
    with pytest.raises(procfs.FdGone):
        procfs.read_fdinfo(os.getpid(), fd)


def test_live_child(sleeper, tmp_path):
    pid = sleeper.pid
    assert sleeper.info["pid"] == pid
    assert pid in procfs.read_children(os.getpid())
    assert procfs.list_tids(pid) == [pid]
    st = procfs.read_stat(pid)
    assert st.ppid == os.getpid() and st.state == "S" and st.num_threads == 1
    assert procfs.read_status(pid).ppid == os.getpid()
    assert "PTCKPT_TEST=1" in procfs.read_environ(pid)
    assert procfs.read_cmdline(pid)[:2] == [sys.executable, "-c"]
    assert procfs.read_cwd(pid) == str(tmp_path)
    # blocked in read(0, ...) of its stdin pipe
    sc = procfs.read_syscall(pid, pid)
    assert not sc.running and sc.nr == 0 and sc.args[0] == 0 and sc.in_syscall
    assert procfs.read_wchan(pid, pid) != ""
    # an idle process: maps and smaps agree
    maps = procfs.read_maps(pid)
    smaps = procfs.read_smaps(pid)
    assert [s.map_entry() for s in smaps] == maps
    assert all("Rss" in s.counters and s.vmflags for s in smaps)
    exe_vma = next(m for m in maps if m.path == procfs.read_exe(pid))
    fst = procfs.stat_map_file(pid, exe_vma.start, exe_vma.end)
    assert fst is not None and fst.st_ino == exe_vma.inode
    anon = next(m for m in maps if m.inode == 0 and not m.path)
    assert procfs.stat_map_file(pid, anon.start, anon.end) is None
    # writable knobs read back
    Path(f"/proc/{pid}/oom_score_adj").write_text("123")
    assert procfs.read_oom_score_adj(pid) == 123
    Path(f"/proc/{pid}/timerslack_ns").write_text("12345")
    assert procfs.read_timerslack_ns(pid) == 12345


def test_live_threads(pychild):
    child = pychild("""
        import ctypes, json, os, threading
        libc = ctypes.CDLL(None)
        ready = threading.Event()
        tids = []
        def worker():
            libc.prctl(15, b"worker ) (x", 0, 0, 0)     # PR_SET_NAME
            tids.append(threading.get_native_id())
            ready.set()
            threading.Event().wait()
        threading.Thread(target=worker, daemon=True).start()
        ready.wait()
        print(json.dumps({"tid": tids[0]}))
    """)
    pid, tid = child.pid, child.info["tid"]
    assert procfs.list_tids(pid) == [pid, tid]
    assert procfs.read_comm(pid, tid) == "worker ) (x"
    t = procfs.read_stat(pid, tid)
    assert t.pid == tid and t.comm == "worker ) (x" and t.num_threads == 2
    assert procfs.read_status(pid, tid).pid == tid
    assert procfs.read_status(pid, tid).tgid == pid
    assert procfs.read_syscall(pid, tid).nr is not None


def test_live_comm_with_parens(pychild):
    child = pychild("""
        import json, os
        with open("/proc/self/comm", "w") as f:
            f.write("a) (b c)")
        print(json.dumps({}))
    """)
    assert procfs.read_comm(child.pid) == "a) (b c)"
    st = procfs.read_stat(child.pid)
    assert st.comm == "a) (b c)" and st.state == "S" and st.ppid == os.getpid()
    assert procfs.read_status(child.pid).name == "a) (b c)"


def test_live_paths_with_spaces(pychild, tmp_path):
    names = {"space": b"a b", "nonutf8": b"x \xff y", "deleted": b"gone soon"}
    child = pychild(f"""
        import json, mmap, os
        keep = []
        for key, name in {names!r}.items():
            path = os.path.join({os.fsencode(tmp_path)!r}, name)
            with open(path, "wb") as f:
                f.write(b"z" * 8192)
            fd = os.open(path, os.O_RDONLY)
            m = mmap.mmap(fd, 8192, prot=mmap.PROT_READ)
            os.close(fd)
            keep.append(m)
        os.unlink(os.path.join({os.fsencode(tmp_path)!r}, b"gone soon"))
        print(json.dumps({{}}))
    """)
    maps = procfs.read_maps(child.pid)
    by_path = {m.path: m for m in maps}
    spaced = by_path[os.fsdecode(os.fsencode(tmp_path) + b"/a b")]
    assert spaced.size == 8192 and spaced.prot == PROT_R and not spaced.deleted
    raw = os.fsencode(tmp_path) + b"/x \xff y"
    assert os.fsencode(by_path[os.fsdecode(raw)].path) == raw
    gone = by_path[str(tmp_path / "gone soon")]
    assert gone.deleted and gone.inode != 0
    smaps = procfs.read_smaps(child.pid)
    assert {s.path for s in smaps} == {m.path for m in maps}


_SCAN_CHILD = """
    import ctypes, json, mmap, os
    P = mmap.PAGESIZE
    libc = ctypes.CDLL(None)
    anon = mmap.mmap(-1, 64 * P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, 16):
        anon[i * P] = 1                  # written
    for i in range(16, 32):
        _ = anon[i * P]                  # read only: the zero page
    # 32..63 untouched
    path = os.path.join(os.getcwd(), "data")
    with open(path, "wb") as f:
        f.write(b"d" * 16 * P)
    with open(path, "r+b") as f:
        priv = mmap.mmap(f.fileno(), 16 * P, flags=mmap.MAP_PRIVATE)
    for i in range(16):
        _ = priv[i * P]
    priv[4 * P] = 2                      # copied on write: anonymous
    priv[5 * P] = 2
    shared = mmap.mmap(-1, 8 * P, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    for i in range(4):
        shared[i * P] = 3
    alt = mmap.mmap(-1, 256 * P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, 256, 2):
        alt[i * P] = 1
        _ = alt[(i + 1) * P]
    addr = lambda m: ctypes.addressof(ctypes.c_char.from_buffer(m))
    print(json.dumps({"anon": addr(anon), "priv": addr(priv), "shared": addr(shared),
                      "alt": addr(alt)}))
"""


@pytest.fixture
def scan_child(pychild):
    return pychild(_SCAN_CHILD)


def _methods():
    return [ScanMethod.IOCTL, ScanMethod.PAGEMAP] if procfs.HAS_PAGEMAP_SCAN \
        else [ScanMethod.PAGEMAP]


@pytest.mark.parametrize("method", [ScanMethod.AUTO, ScanMethod.IOCTL, ScanMethod.PAGEMAP])
def test_scan_pages_live(scan_child, method):
    if method is ScanMethod.IOCTL and not procfs.HAS_PAGEMAP_SCAN:
        pytest.skip("no PAGEMAP_SCAN on this kernel")
    if method is ScanMethod.PAGEMAP and procfs.zero_page_pfn() is None:
        pytest.skip("PFNs are hidden: the pagemap fallback cannot see the zero page")
    pid, a = scan_child.pid, scan_child.info["anon"]

    def scan(start, end, **kw):
        return procfs.scan_pages(pid, start, end, method=method, **kw)

    # written pages are reported; read-only (zero page) and untouched ones not
    assert scan(a, a + 64 * P) == [PageRun(a, a + 16 * P, PAGE_IS_PRESENT)]
    assert scan(a, a + 64 * P, skip_zero=False) == [
        PageRun(a, a + 16 * P, PAGE_IS_PRESENT),
        PageRun(a + 16 * P, a + 32 * P, PAGE_IS_PRESENT | PAGE_IS_PFNZERO)]
    assert scan(a + 8 * P, a + 20 * P) == [PageRun(a + 8 * P, a + 16 * P, PAGE_IS_PRESENT)]

    # private file mapping: page cache is FILE, the two written pages are not
    f = scan_child.info["priv"]
    runs = scan(f, f + 16 * P)
    assert runs == [PageRun(f, f + 4 * P, PAGE_IS_PRESENT | PAGE_IS_FILE),
                    PageRun(f + 4 * P, f + 6 * P, PAGE_IS_PRESENT),
                    PageRun(f + 6 * P, f + 16 * P, PAGE_IS_PRESENT | PAGE_IS_FILE)]
    assert scan(f, f + 16 * P, skip_file=True) == [PageRun(f + 4 * P, f + 6 * P, PAGE_IS_PRESENT)]

    # shared anonymous memory is shmem: its pages count as FILE
    s = scan_child.info["shared"]
    assert scan(s, s + 8 * P) == [PageRun(s, s + 4 * P, PAGE_IS_PRESENT | PAGE_IS_FILE)]

    # alternating written / zero pages
    t = scan_child.info["alt"]
    expect = [PageRun(t + i * P, t + (i + 1) * P, PAGE_IS_PRESENT) for i in range(0, 256, 2)]
    assert scan(t, t + 256 * P) == expect


@pytest.mark.skipif(not procfs.HAS_PAGEMAP_SCAN, reason="no PAGEMAP_SCAN on this kernel")
@pytest.mark.parametrize("max_regions", [1, 3, 4, 128])
def test_scan_pages_small_buffer(scan_child, max_regions):
    """The ioctl loop resumes where the walk stopped, with no run lost or
    reported twice (walk_end can point back into already reported pages)."""
    pid, t = scan_child.pid, scan_child.info["alt"]
    expect = procfs.scan_pages(pid, t, t + 256 * P, method=ScanMethod.IOCTL)
    assert len(expect) == 128
    assert procfs.scan_pages(pid, t, t + 256 * P, method=ScanMethod.IOCTL,
                             max_regions=max_regions) == expect


def test_scan_pages_methods_agree(scan_child):
    if not procfs.HAS_PAGEMAP_SCAN or procfs.zero_page_pfn() is None:
        pytest.skip("needs both PAGEMAP_SCAN and visible PFNs")
    pid = scan_child.pid
    for m in procfs.read_maps(pid):
        for kw in ({}, {"skip_zero": False}, {"skip_file": True},
                   {"return_mask": 0xFF & ~procfs.PAGE_IS_HUGE & ~procfs.PAGE_IS_WPALLOWED}):
            ioctl = procfs.scan_pages(pid, m.start, m.end, method=ScanMethod.IOCTL, **kw)
            fallback = procfs.scan_pages(pid, m.start, m.end, method=ScanMethod.PAGEMAP, **kw)
            assert ioctl == fallback, (m, kw)


def test_scan_pages_vsyscall(sleeper):
    """[vsyscall] lies past the user address space: no pages, no error."""
    for m in procfs.read_maps(sleeper.pid):
        if m.path == "[vsyscall]":
            assert procfs.scan_pages(sleeper.pid, m.start, m.end) == []
            assert procfs.read_pagemap(sleeper.pid, m.start, m.end) == bytes(8)
            break
    else:
        pytest.skip("no [vsyscall] mapping")


def test_read_pagemap_live(scan_child):
    pid, a = scan_child.pid, scan_child.info["anon"]
    raw = procfs.read_pagemap(pid, a, a + 64 * P)
    entries = [procfs.decode_pagemap_entry(v) for v in procfs.pagemap_values(raw)]
    assert all(e.present for e in entries[:32])
    assert not any(e.present or e.swapped for e in entries[32:])
    zero = procfs.zero_page_pfn()
    if zero is not None:
        assert all(e.pfn == zero for e in entries[16:32])
        assert all(e.pfn not in (0, zero) and e.exclusive for e in entries[:16])


def _a_pid_gone() -> int:
    """The pid of a child that has exited and been reaped (the test skips if it is reused)."""
    child = subprocess.Popen(["true"])
    child.wait()
    if os.path.exists(f"/proc/{child.pid}"):
        pytest.skip("pid reused already")
    return child.pid


def test_no_such_process():
    pid = _a_pid_gone()
    for fn in (procfs.read_stat, procfs.read_status, procfs.read_maps, procfs.read_smaps,
               procfs.list_tids, procfs.read_children, procfs.read_auxv, procfs.read_limits,
               procfs.list_fds, procfs.read_cmdline, procfs.read_environ, procfs.read_comm,
               procfs.read_exe, procfs.read_cwd, procfs.read_root, procfs.read_oom_score_adj,
               procfs.read_timerslack_ns, procfs.read_personality, procfs.read_wchan,
               procfs.read_sessionid, procfs.read_syscall):
        with pytest.raises(errors.NoSuchProcess) as exc:
            fn(pid)
        assert exc.value.pid == pid, fn
    with pytest.raises(errors.NoSuchProcess):
        procfs.read_fdinfo(pid, 0)
    with pytest.raises(errors.NoSuchProcess):
        procfs.readlink_fd(pid, 0)
    with pytest.raises(errors.NoSuchProcess):
        procfs.scan_pages(pid, 0x400000, 0x500000)
    with pytest.raises(errors.NoSuchProcess):
        procfs.read_pagemap(pid, 0x400000, 0x500000)
    with pytest.raises(errors.NoSuchProcess):
        procfs.stat_map_file(pid, 0x400000, 0x500000)
    with pytest.raises(errors.NoSuchProcess, match="thread"):
        procfs.read_stat(os.getpid(), pid)


def test_zombie():
    child = subprocess.Popen(["true"])
    try:
        for _ in range(500):
            if procfs.read_stat(child.pid).state == "Z":
                break
            os.sched_yield()
        else:
            pytest.fail("child did not become a zombie")
        for fn in (procfs.read_exe, procfs.read_cwd, procfs.read_auxv):
            with pytest.raises(procfs.ZombieProcess) as exc:
                fn(child.pid)
            assert isinstance(exc.value, errors.NoSuchProcess) and exc.value.pid == child.pid
        with pytest.raises(errors.NoSuchProcess):
            procfs.scan_pages(child.pid, 0x400000, 0x500000, method=ScanMethod.PAGEMAP)
        assert procfs.read_maps(child.pid) == []
    finally:
        child.wait()


def test_kernel_thread():
    try:
        st = procfs.read_stat(2)
    except errors.NoSuchProcess:
        pytest.skip("no pid 2 here")
    if not st.is_kthread:
        pytest.skip("pid 2 is not a kernel thread here (pid namespace?)")
    assert procfs.read_status(2).kthread is True
    assert procfs.read_cmdline(2) == []
    with pytest.raises(errors.KernelThread):
        procfs.read_exe(2)
    with pytest.raises(errors.KernelThread):
        procfs.read_auxv(2)


def test_ancestors_walks_up_to_init():
    chain = procfs.ancestors(os.getpid())
    assert chain[0] == os.getppid()
    assert chain[-1] in (0, 1) or procfs.read_stat(chain[-1]).ppid in (0, 1)
    assert os.getpid() not in chain and len(set(chain)) == len(chain)
    assert procfs.ancestors(1) == []


# --- the readers other modules use (issue 33): live, on this process and a child ----------

@pytest.fixture
def holder(pychild, tmp_path):
    """A child holding fd 3 on a file it flock()ed, with a POSIX timer (CLOCK_MONOTONIC)."""
    path = tmp_path / "held"
    path.write_bytes(b"x" * 10)
    child = pychild(f'''
        import ctypes, fcntl, json, os
        fd = os.open({str(path)!r}, os.O_RDWR)
        os.dup2(fd, 3)
        fcntl.flock(3, fcntl.LOCK_EX)
        librt = ctypes.CDLL("librt.so.1", use_errno=True)
        timer = ctypes.c_void_p()
        assert librt.timer_create(1, None, ctypes.byref(timer)) == 0
        print(json.dumps({{"pid": os.getpid()}}))
        ''')
    child.path = path
    return child


def test_stat_fd_and_fd_gone(holder):
    st = procfs.stat_fd(holder.pid, 3)
    own = os.stat(holder.path)
    assert (st.st_dev, st.st_ino, st.st_size) == (own.st_dev, own.st_ino, 10)
    with pytest.raises(procfs.FdGone) as exc:
        procfs.stat_fd(holder.pid, 999)
    assert exc.value.fd == 999 and exc.value.pid == holder.pid
    text = procfs.read_fdinfo_text(holder.pid, 3)
    assert text.startswith("pos:") and "lock:" in text
    info = procfs.read_fdinfo(holder.pid, 3)
    assert f"mnt_id:\t{info.mnt_id}" in text and info.extra["lock"][0] in text
    with pytest.raises(procfs.FdGone):
        procfs.read_fdinfo_text(holder.pid, 999)


def test_namespaces(holder):
    names = procfs.list_namespaces(holder.pid)
    assert names == sorted(os.listdir(f"/proc/{holder.pid}/ns")) and {"mnt", "net", "pid"} <= set(names)
    for name in ("mnt", "net", "pid"):
        ours = os.stat(f"/proc/self/ns/{name}")
        assert procfs.stat_namespace(holder.pid, name).st_ino == ours.st_ino
        assert procfs.stat_namespace("self", name).st_ino == ours.st_ino
    with pytest.raises(procfs.ProcEntryMissing):
        procfs.stat_namespace(holder.pid, "no-such-kind")


def test_mounts(holder):
    lines = procfs.read_mountinfo(holder.pid)
    with open(f"/proc/{holder.pid}/mountinfo", "rb") as f:
        assert lines == f.read().splitlines()
    assert procfs.read_mountinfo("self") == lines            # one mount namespace
    fstypes = procfs.mount_fstypes(holder.pid)
    assert fstypes[procfs.read_fdinfo(holder.pid, 3).mnt_id] != ""
    assert "proc" in fstypes.values()
    mounts = procfs.read_mounts("self")
    assert any(line.split()[1:3] == ["/proc", "proc"] for line in mounts)
    assert procfs.mount_fstypes(1 << 30) == {}               # no such process: nothing


def test_small_files_of_a_child(holder):
    pid = holder.pid
    assert procfs.read_text_file(pid, "coredump_filter") == procfs.read_text_file(os.getpid(), "coredump_filter")
    assert int(procfs.read_text_file(pid, "oom_score_adj")) == procfs.read_oom_score_adj(pid)
    assert procfs.read_cgroup(pid) == procfs.read_cgroup(os.getpid()) != ""
    assert procfs.read_id_map(pid, "uid_map") == procfs.read_id_map("self", "uid_map")
    assert all(len(row) == 3 for row in procfs.read_id_map(pid, "gid_map"))
    try:
        label = procfs.read_attr_current(pid)
    except procfs.ProcfsError as err:
        assert err.errno in (errno.EINVAL, errno.ENOENT)    # no LSM gives labels here
    else:
        assert not label.endswith(("\0", "\n"))
    auxv = procfs.read_auxv_bytes(pid)
    assert len(auxv) % 16 == 0 and auxv.startswith(
        b"".join(struct.pack("=QQ", *e) for e in procfs.read_auxv(pid)))
    timers = procfs.read_timers(pid)
    assert "ClockID: 1" in timers and "signal: 14/" in timers
    try:
        numa = procfs.read_numa_maps(pid)
    except procfs.ProcEntryMissing:
        pass                                                 # a kernel without CONFIG_NUMA
    else:
        assert numa and all(line.split()[1].startswith(("default", "bind", "prefer", "interleave", "local"))
                            for line in numa)


def test_net_tables(holder):
    lines = procfs.read_net_table(holder.pid, "tcp")
    assert lines[0].split()[:2] == ["sl", "local_address"]
    assert procfs.read_net_table("self", "tcp")[0] == lines[0]


def test_thread_children_and_pids(holder):
    import threading
    assert holder.pid in procfs.read_thread_children(os.getpid(), threading.get_native_id())
    assert procfs.read_thread_children(holder.pid, holder.pid) == []
    pids = procfs.list_pids()
    assert os.getpid() in pids and holder.pid in pids and 1 in pids
    assert procfs.pid_exists(holder.pid) and procfs.pid_exists("self")


def test_system_wide_files(holder):
    assert int(procfs.read_sysctl("kernel/pid_max")) > 300
    assert procfs.read_sysctl("kernel/cap_last_cap").isdigit()
    with pytest.raises(FileNotFoundError):                   # no process to name: OSError as it is
        procfs.read_sysctl("kernel/no_such_knob")
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), None)
    assert procfs.read_cpu_flags() == (set(flags.split(":", 1)[1].split()) if flags else set())
    vmstat = procfs.read_vmstat()
    assert vmstat["nr_free_pages"] >= 0 and all(isinstance(v, int) for v in vmstat.values())
    held = os.stat(holder.path)
    where = f"{os.major(held.st_dev):02x}:{os.minor(held.st_dev):02x}:{held.st_ino}"
    assert any("FLOCK" in line and where in line.split() for line in procfs.read_locks())
    assert procfs.read_kernel_cmdline() == open("/proc/cmdline").read().split()
    for kind in ("shm", "sem", "msg"):
        try:
            text = procfs.read_sysvipc(kind)
        except FileNotFoundError:
            pytest.skip("a kernel without CONFIG_SYSVIPC")
        assert text.splitlines()[0].split()[:2] == ["key", {"shm": "shmid", "sem": "semid", "msg": "msqid"}[kind]]


def test_new_readers_of_a_process_that_is_gone():
    pid = _a_pid_gone()
    for fn in (procfs.list_namespaces, procfs.read_mountinfo, procfs.read_mounts, procfs.read_numa_maps,
               procfs.read_attr_current, procfs.read_cgroup, procfs.read_timers, procfs.read_auxv_bytes):
        with pytest.raises(errors.NoSuchProcess) as exc:
            fn(pid)
        assert exc.value.pid == pid, fn
    for fn, args in ((procfs.stat_fd, (0,)), (procfs.stat_namespace, ("net",)), (procfs.read_net_table, ("tcp",)),
                     (procfs.read_text_file, ("loginuid",)), (procfs.read_id_map, ("uid_map",)),
                     (procfs.read_thread_children, (pid,))):
        with pytest.raises(errors.NoSuchProcess):
            fn(pid, *args)
    assert not procfs.pid_exists(pid) and pid not in procfs.list_pids()

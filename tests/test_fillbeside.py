"""How a big eager restore's page filling is shared between the tracee and a thread of
ptckpt (ptckpt/resources/fillbeside.py).  That the pages arrive whole is
tests/test_restore.py::test_heap_contents_intact; that a memory limit still kills the
tracee, not ptckpt, is tests/test_exhaustion.py."""

from __future__ import annotations

import os
import subprocess

from ptckpt.formats.model import PAGE_SIZE
from ptckpt.resources import fillbeside

from conftest import kill_pids, limited_cgroup, wait_until

MIB = 1 << 20


def _bytes(groups) -> int:
    return sum(n for g in groups for _o, _v, n in g)


def _pieces(groups) -> list[tuple[int, int, int]]:
    return sorted(p for g in groups for p in g)


def _file(tmp_path, size: int) -> int:
    path = tmp_path / "pages"
    with open(path, "wb") as f:
        f.truncate(size)
    return os.open(path, os.O_RDONLY)


def test_half_the_bytes_each_the_middle_group_cut_at_a_page(tmp_path, monkeypatch):
    monkeypatch.setattr(fillbeside, "memory_room", lambda pid, need: True)
    groups = [[(0, 0x10000000, 64 * MIB)], [(64 * MIB, 0x20000000, 64 * MIB)],
              [(128 * MIB, 0x30000000, 16 * MIB), (144 * MIB, 0x40000000, 16 * MIB + 3 * PAGE_SIZE)]]
    fd = _file(tmp_path, 4096 + 161 * MIB)
    try:
        theirs, mine = fillbeside.split(os.getpid(), groups, fd, 4096)
    finally:
        os.close(fd)
    total = _bytes(groups)
    assert _bytes(theirs) == total // 2 // PAGE_SIZE * PAGE_SIZE and _bytes(mine) == total - _bytes(theirs)
    # nothing lost or doubled: the pieces join up to the same bytes at the same addresses
    joined = {}
    for o, v, n in _pieces(theirs) + _pieces(mine):
        for page in range(0, n, PAGE_SIZE):
            assert (o + page) not in joined
            joined[o + page] = v + page
    assert joined == {o + p: v + p for g in groups for o, v, n in g for p in range(0, n, PAGE_SIZE)}
    for g in theirs + mine:                      # each group still one stretch of the file
        assert all(a[0] + a[2] == b[0] for a, b in zip(g, g[1:]))


def test_small_fills_short_files_and_no_room_stay_with_the_tracee(tmp_path, monkeypatch):
    monkeypatch.setattr(fillbeside, "memory_room", lambda pid, need: True)
    small = [[(0, 0x10000000, fillbeside.SPLIT_MIN - PAGE_SIZE)]]
    big = [[(0, 0x10000000, 128 * MIB)]]
    fd = _file(tmp_path, 4096 + 128 * MIB - PAGE_SIZE)         # a page short of the big fill
    try:
        assert fillbeside.split(os.getpid(), small, fd, 4096) == (small, [])
        assert fillbeside.split(os.getpid(), big, fd, 4096) == (big, []), "the file ends early"
        assert fillbeside.split(os.getpid(), big, fd, 0)[1], "it does not"
        monkeypatch.setattr(fillbeside, "memory_room", lambda pid, need: False)
        assert fillbeside.split(os.getpid(), big, fd, 0) == (big, [])
    finally:
        os.close(fd)


def test_memory_room_is_the_limit_of_the_tracees_memory_cgroup():
    """A process in a memory cgroup of 256 MiB: room for 64 MiB more, not for 512 MiB (nor
    for 200, with the margin); the tests' own cgroup has room for a MiB."""
    assert fillbeside.memory_room(os.getpid(), MIB)
    with limited_cgroup("memory", "memory.max", str(256 * MIB)) as inside:
        proc = subprocess.Popen([*inside, "sleep", "60"], stdin=subprocess.DEVNULL, close_fds=True,
                                start_new_session=True)
        try:
            wait_until(lambda: "ptckpt-test-" in open(f"/proc/{proc.pid}/cgroup").read(), 5)
            assert fillbeside.memory_room(proc.pid, 64 * MIB)
            assert not fillbeside.memory_room(proc.pid, 200 * MIB)
            assert not fillbeside.memory_room(proc.pid, 512 * MIB)
        finally:
            kill_pids([proc.pid])
            proc.wait()


def test_a_page_file_that_cannot_be_mapped_leaves_the_whole_fill_to_the_tracee(tmp_path, monkeypatch):
    """share(): where the view cannot be made (mmap refused), nothing of the split is lost:
    the tracee gets every group back, whole."""
    monkeypatch.setattr(fillbeside, "memory_room", lambda pid, need: True)

    def refused(*_args, **_kw):
        raise OSError(19, "No such device")
    monkeypatch.setattr(fillbeside, "Beside", refused)

    class _Mem:
        pid = os.getpid()
    groups = [[(0, 0x10000000, 64 * MIB)], [(64 * MIB, 0x20000000, 64 * MIB)]]
    fd = _file(tmp_path, 4096 + 128 * MIB)
    try:
        assert fillbeside.share(_Mem(), groups, fd, 4096) == (groups, None)
    finally:
        os.close(fd)

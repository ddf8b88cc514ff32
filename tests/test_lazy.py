"""restore --lazy: the process runs before its anonymous memory is in; a page server
(ptckpt.lazypages) brings each page it touches, then the rest, and exits.

Each test finds the server and its watchdog in restore --json's "lazy" object and kills
them (and the restored process) in its finaliser, whatever happened.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from conftest import kill_pids, pid_alive, reap_orphans, wait_pid_free, wait_until

PAGE_SIZE = 4096
BLOCK = 1 << 20


@pytest.fixture
def lazy(ptckpt, request):
    """lazy(image, env=None) -> (restored pid, {"server", "watchdog", "log", "bytes"})."""
    started: list[int] = []
    logs: list[str] = []

    def run(image: Path, env: dict | None = None, *extra) -> tuple[int, dict]:
        res = ptckpt("restore", "-D", image, "--detach", "--lazy", "--json", *extra,
                     env={**os.environ, **(env or {})})
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        started.append(out["pid"])
        info = out["lazy"]
        assert info, f"nothing was left to a page server: {res.stderr}"
        started.extend([info["server"], info["watchdog"]])
        logs.append(info["log"])
        return out["pid"], info

    def finish() -> None:
        kill_pids(started)
        reap_orphans()
        for path in logs:
            try:
                os.unlink(path)
            except OSError:
                pass
    request.addfinalizer(finish)
    return run


def _gone(pid: int, timeout: float = 20.0) -> None:
    wait_until(lambda: (reap_orphans(), not pid_alive(pid))[1], timeout, message=f"process {pid} ends")


def _log(info: dict) -> str:
    return Path(info["log"]).read_text()


def _dump_kill(ptckpt, target, image: Path, *extra) -> None:
    res = ptckpt("dump", target.pid, "-D", image, "--kill", *extra)
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    wait_pid_free(target.pid)


def _flip_byte(path: Path, at: int, mask: int) -> None:
    """The byte at offset `at` of `path` XORed with `mask` (a damaged image)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


def _heap_vma(pid: int, heap: int) -> tuple[int, int, str]:
    """(size, rss, vmflags) in kB of the mapping holding address `heap`."""
    size = rss = 0
    inside = False
    flags = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= heap < int(m.group(2), 16)
                if inside:
                    size = (int(m.group(2), 16) - int(m.group(1), 16)) // 1024
            elif inside and line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif inside and line.startswith("VmFlags:"):
                flags = line.split(":", 1)[1]
    return size, rss, flags


@pytest.mark.parametrize("build", ["x86_64", pytest.param("-m32", marks=pytest.mark.proc_differs(
    "maps", reason="[vsyscall] shows in a restored 32-bit process (test_compat32)"))])
def test_lazy_heap_comes_in_whole_and_the_server_leaves(spawn, ptckpt, tmp_path, lazy, request, build):
    """The pattern is intact when read at once (faults served), every page of the heap is
    in once the server exits, the mappings are no longer registered, and the log says so
    (a 32-bit program's too)."""
    target = spawn("bigheap" if build == "x86_64" else str(request.getfixturevalue("fixture_bins32")["bigheap"]), 64)
    heap = target.symbols["heap"]
    _size, rss_at_dump, _flags = _heap_vma(target.pid, heap)
    _dump_kill(ptckpt, target, tmp_path / "img")
    pid, info = lazy(tmp_path / "img")
    assert pid == target.pid
    assert info["bytes"] >= 64 << 20
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK", timeout=30)
    _gone(info["server"])
    _gone(info["watchdog"])
    text = _log(info)
    assert "all pages in" in text and "64 MiB" in text, text
    size, rss, flags = _heap_vma(pid, heap)
    assert rss == rss_at_dump >= 64 << 10, (size, rss, rss_at_dump)   # every page is in again
    assert " um" not in flags, flags                         # nothing depends on the server now
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 2 OK", timeout=30)
    target.assert_ok()


def test_lazy_child_forked_before_all_pages_are_in(spawn, ptckpt, tmp_path, lazy):
    """A fork while pages are still missing: the child's copy of the memory gets them
    too (the server serves the child's userfaultfd), none reads as zeros."""
    target = spawn("bigheap", 32)
    _dump_kill(ptckpt, target, tmp_path / "img")
    pid, info = lazy(tmp_path / "img", {"PTCKPT_TEST_LAZY_PACE": "0.05"})    # 32 chunks: >= 1.6 s
    target.signal(signal.SIGUSR2)
    target.wait_for_line("CHILD 1 ", timeout=30)
    assert "CHILD 1 OK" in target.stdout_text(), target.stdout_text()
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK", timeout=30)
    _gone(info["server"])
    text = _log(info)
    assert "forked" in text and "all pages in" in text, text
    target.assert_ok()


def test_lazy_server_killed_midway_kills_the_process_and_says_why(spawn, ptckpt, tmp_path, lazy):
    """The page server dies with pages missing: the watchdog ends the restored process
    (no hang, no page read as zeros) and its log line says why."""
    target = spawn("bigheap", 32)
    _dump_kill(ptckpt, target, tmp_path / "img")
    pid, info = lazy(tmp_path / "img", {"PTCKPT_TEST_DIE_AT": "lazy-copy:4",
                                        "PTCKPT_TEST_LAZY_PACE": "0.02"})
    _gone(pid)
    _gone(info["watchdog"])
    assert not pid_alive(info["server"])
    text = _log(info)
    assert "page server died before every page was in" in text and f"killed {pid}" in text, text
    assert "BAD" not in target.stdout_text()


def test_lazy_corrupt_block_ends_the_process_naming_the_bytes(spawn, ptckpt, tmp_path, lazy):
    """A byte changed in the sixth MiB of page data: checked when first served, the block is
    named by its bytes in the log and the process is killed, never run on with it."""
    target = spawn("bigheap", 8)
    image = tmp_path / "img"
    _dump_kill(ptckpt, target, image)
    pages = image / f"pages-{target.pid}.img"
    _flip_byte(pages, PAGE_SIZE + 5 * BLOCK + 12345, 0x01)
    pid, info = lazy(image)
    _gone(pid)
    _gone(info["server"])
    text = _log(info)
    first = PAGE_SIZE + 5 * BLOCK
    for words in (str(pages), f"bytes {first}-{first + BLOCK - 1}", "(block 5)", f"killed {pid}"):
        assert words in text, text
    assert "VERIFY" not in target.stdout_text()


def test_lazy_compressed_image_is_decompressed_as_its_pages_are_needed(spawn, ptckpt, tmp_path, lazy):
    """A compressed image (--compress zstd): the process runs before its frames are
    decompressed; the page server decompresses each frame when a page of it is first
    needed (most of them after the process started), and the heap is intact."""
    target = spawn("bigheap", 64)
    image = tmp_path / "img"
    _dump_kill(ptckpt, target, image, "--compress", "zstd:1")
    pid, info = lazy(image)
    assert info["bytes"] >= 64 << 20
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK", timeout=30)
    _gone(info["server"])
    text = _log(info)
    found = re.search(r"(\d+) compressed frames decompressed here \(of (\d+)\)", text)
    assert found, text
    here, total = map(int, found.groups())
    assert total >= 64 and here >= total // 2, text      # most of them after the process ran
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 2 OK", timeout=30)
    target.assert_ok()


def test_lazy_compressed_frame_damaged_ends_the_process_naming_it(spawn, ptckpt, tmp_path, lazy):
    """A byte changed in a compressed frame in the middle of the data: found when that frame
    is first needed (zstd's checksum), named in the log, and the process killed."""
    target = spawn("bigheap", 16)
    image = tmp_path / "img"
    _dump_kill(ptckpt, target, image, "--compress", "zstd:1")
    pages = image / f"pages-{target.pid}.img"
    _flip_byte(pages, pages.stat().st_size * 2 // 3, 0x5A)
    pid, info = lazy(image)
    _gone(pid)
    _gone(info["server"])
    text = _log(info)
    assert str(pages) in text and "compressed frame at offset" in text and f"killed {pid}" in text, text
    assert "VERIFY" not in target.stdout_text()


def _totals(target) -> tuple[int, int]:
    text = open(target.out_path).read()
    assert not text.startswith("FAIL"), text
    return tuple(map(int, text.split()))


def test_lazy_tree_goes_on(spawn, ptckpt, tmp_path, lazy):
    """A forked tree restored lazily (the children's pages shared with the parent come
    eagerly from it, the rest lazily): the parent sees its workers count on."""
    server = spawn("forkserver")
    workers = [int(line.split()[2]) for line in server.preamble if line.startswith("WORKER")]
    wait_until(lambda: _totals(server)[0] > 100, 5)
    try:
        _dump_kill(ptckpt, server, tmp_path / "img")
        for p in workers:
            wait_pid_free(p)
        pid, info = lazy(tmp_path / "img")
        at_restore = _totals(server)
        wait_until(lambda: all(t > a + 300 for t, a in zip(_totals(server), at_restore)), 20,
                   message="the parent sees the workers count on")
        _gone(info["server"])
        assert "all pages in" in _log(info)
        server.assert_ok()
    finally:
        kill_pids([server.pid] + workers)
        reap_orphans()


def test_lazy_python3_goes_on(spawn, ptckpt, tmp_path, lazy):
    """python3 (its heap, arenas and stack left to the server) counts on from its value."""
    py = spawn("counter.py")
    py.wait_progress()
    _dump_kill(ptckpt, py, tmp_path / "img")
    at_dump = py.read_counter()
    pid, info = lazy(tmp_path / "img")
    assert pid == py.pid
    wait_until(lambda: py.read_counter() > at_dump + 5, 20, message="python counts on")
    _gone(info["server"])
    assert "all pages in" in _log(info)
    py.assert_ok()


def test_waiting_lazy_restore_says_why_its_process_was_killed(spawn, ptckpt, tmp_path):
    """Without --detach ptckpt waits for the process; when the page server killed it (a
    corrupt block), ptckpt exits 137 and its last line says why."""
    target = spawn("bigheap", 8)
    image = tmp_path / "img"
    _dump_kill(ptckpt, target, image)
    pages = image / f"pages-{target.pid}.img"
    with open(pages, "r+b") as f:
        f.seek(PAGE_SIZE + 3 * BLOCK)
        b = f.read(1)
        f.seek(PAGE_SIZE + 3 * BLOCK)
        f.write(bytes([b[0] ^ 0x80]))
    res = ptckpt("restore", "-D", image, "--lazy", timeout=60)
    m = re.search(r"page server (\d+) \(watchdog (\d+), log (\S+)\)", res.stderr)
    try:
        assert m, res.stderr
        assert res.returncode == 128 + signal.SIGKILL, res.stderr
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith("ptckpt: lazy restore:") and "(block 3)" in last and "killed" in last, last
        assert "Traceback" not in res.stderr
    finally:
        if m:
            kill_pids([int(m.group(1)), int(m.group(2))])
            reap_orphans()
            Path(m.group(3)).unlink(missing_ok=True)


def test_dump_while_pages_are_still_coming_is_refused_by_name(spawn, ptckpt, tmp_path, lazy):
    """A dump before the server has finished would read through its registrations: it is
    refused, naming the reason and the way out, and the process runs on untouched."""
    target = spawn("bigheap", 16)
    _dump_kill(ptckpt, target, tmp_path / "img")
    pid, info = lazy(tmp_path / "img", {"PTCKPT_TEST_LAZY_PACE": "0.1"})      # >= 1.6 s to load
    res = ptckpt("dump", pid, "-D", tmp_path / "again")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "lazy restore" in res.stderr and "dump once it has exited" in res.stderr, res.stderr
    _gone(info["server"])
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK", timeout=30)
    res = ptckpt("dump", pid, "-D", tmp_path / "after")
    assert res.returncode == 0, res.stderr
    target.assert_ok()

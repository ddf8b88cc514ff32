"""Notification fds, epoll, AIO and io_uring through a real dump and restore
(fixtures/notify.c): what comes back, and what is refused by name with the target
left running as it was."""

from __future__ import annotations

import json
import os

from conftest import wait_pid_free
from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import EpollState, FanotifyState, InotifyState

UNSUPPORTED = 13
FAN_CLOSE_WRITE, FAN_EVENT_ON_CHILD = 0x8, 0x08000000


def _refused(spawn, ptckpt, tmp_path, mode: str, *want: str) -> None:
    """Dump a `mode` target: refused (exit 13) naming `want`; no image; it runs on and passes."""
    (tmp_path / "dir").mkdir(exist_ok=True)
    target = spawn("notify", mode, tmp_path / "dir")
    image = tmp_path / "img"
    res = ptckpt("dump", target.pid, "-D", image, "--kill")
    assert res.returncode == UNSUPPORTED, res.stderr
    for text in want:
        assert text in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not image.exists()
    assert os.path.exists(f"/proc/{target.pid}")
    target.signal()
    target.wait_for_line(rf"^OK {mode}\b", timeout=10)
    assert target.wait_exit(10) == 0, target.describe()


def test_io_uring_fd_is_refused_by_name_and_left_running(spawn, ptckpt, tmp_path):
    _refused(spawn, ptckpt, tmp_path, "iouring", "anon_inode:[io_uring] (io_uring: an io_uring instance",
             "--external fd:")


def test_io_uring_rings_mapped_without_their_fd_are_refused(spawn, ptckpt, tmp_path):
    _refused(spawn, ptckpt, tmp_path, "iouring-mapped", "-> anon_inode:[io_uring] (the rings of an io_uring",
             "unmapped and closed")


def test_fanotify_group_of_the_content_class_is_refused_and_left_running(spawn, ptckpt, tmp_path):
    _refused(spawn, ptckpt, tmp_path, "fanotify-content", "anon_inode:[fanotify]): a fanotify group of the "
             "content or pre-content class", "close it before the checkpoint")


def test_fanotify_group_comes_back_with_its_marks(spawn, ptckpt, tmp_path):
    """A mark on a directory (close-write of its children) and an ignored mark on a file in
    it: the same after restore, with no event of the restore's own in the queue."""
    target, image = _dump_restore(spawn, ptckpt, tmp_path, "fanotify")
    with ImageReader(image) as reader:
        state = next(s for s in reader.fd_states if isinstance(s, FanotifyState))
        assert sorted((m.kind, m.path, m.mask, m.ignored_mask) for m in state.marks) == [
            (0, str(tmp_path / "dir"), FAN_CLOSE_WRITE | FAN_EVENT_ON_CHILD, 0),
            (0, str(tmp_path / "dir" / "quiet"), 0, FAN_CLOSE_WRITE)]
    _passes(target, "fanotify")


def _dump_restore(spawn, ptckpt, tmp_path, mode: str):
    """Dump a `mode` target (--kill) and restore it; (target, image reader path)."""
    (tmp_path / "dir").mkdir()
    target = spawn("notify", mode, tmp_path / "dir")
    image = tmp_path / "img"
    res = ptckpt("dump", target.pid, "-D", image, "--kill")
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    wait_pid_free(target.pid)
    res = ptckpt("restore", "-D", image, "--detach")
    assert res.returncode == 0, res.stderr
    target.adopt(int(res.stdout.split()[-1]))
    return target, image


def _passes(target, mode: str) -> str:
    target.signal()
    line = target.wait_for_line(rf"^OK {mode}\b", timeout=15).string
    assert target.wait_exit(10) == 0, target.describe()
    return line


def test_epoll_items_registered_through_closed_fds_come_back(spawn, ptckpt, tmp_path):
    """Two items under fd number 100 (closed since, each a different pipe) and one under
    the pipe's own fd: the same files, events and data words after restore."""
    target, image = _dump_restore(spawn, ptckpt, tmp_path, "epoll")
    with ImageReader(image) as reader:
        state = next(s for s in reader.fd_states if isinstance(s, EpollState))
        assert sorted((t.tfd, t.data) for t in state.targets)[-2:] == [(100, 0xA), (100, 0xB)]
        assert sum(1 for d in state.sources if d) == 2
    assert not os.path.exists(f"/proc/{target.pid}/fd/100")
    _passes(target, "epoll")


def test_inotify_watch_on_a_deleted_open_file_comes_back(spawn, ptckpt, tmp_path):
    """The watched file was unlinked but is still open for writing: its watch keeps its wd,
    closing the fd after restore gives IN_CLOSE_WRITE and IN_DELETE_SELF there, and the
    restore leaves no event of its own in the queue (its unlink of the ghost, its reopen
    of DIR/kept under the directory's IN_OPEN watch)."""
    target, image = _dump_restore(spawn, ptckpt, tmp_path, "inotify")
    with ImageReader(image) as reader:
        state = next(s for s in reader.fd_states if isinstance(s, InotifyState))
        assert [w.path for w in state.watches] == [str(tmp_path / "dir"), str(tmp_path / "dir" / "watched")]
        assert [wd for wd, _dev, _ino in state.deleted] == [2]
    assert not (tmp_path / "dir" / "watched").exists()     # (a listdir would be an IN_OPEN)
    assert _passes(target, "inotify").split()[2:] == ["1", "2"]


def test_inotify_watch_on_a_deleted_file_held_only_outside_is_refused(spawn, ptckpt, tmp_path):
    (tmp_path / "dir").mkdir()
    keep = os.open(tmp_path / "dir" / "outside", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644)
    try:
        _refused(spawn, ptckpt, tmp_path, "inotify-outside",
                 f"inotify watch 1 on the deleted file {tmp_path / 'dir' / 'outside'}", "no fd or mapping of the tree")
    finally:
        os.close(keep)


def test_aio_context_comes_back_at_its_address_with_unreaped_completions(spawn, ptckpt, tmp_path):
    """io_setup's ring at the same address (the context id), head 3 and tail 5 as dumped,
    the two unreaped completions there; a new request completes after restore."""
    target, image = _dump_restore(spawn, ptckpt, tmp_path, "aio")
    ctx = int(target.wait_for_line(r"^AIO ").string.split()[1], 16)
    with ImageReader(image) as reader:
        (ring,) = reader.process(reader.inventory.root_pid).aio_rings
        # (counting the requests in flight at the dump takes the ring round to the same head and tail)
        assert (ring.start, ring.head, ring.tail, len(ring.events)) == (ctx, 3, 5, 64)
        assert [int.from_bytes(ring.events[i:i + 8], "little") for i in (0, 32)] == [0xD0, 0xD1]
    with open(f"/proc/{target.pid}/maps") as f:
        assert any(line.startswith(f"{ctx:x}-") and "[aio]" in line for line in f)
    shown = json.loads(ptckpt("show", image).stdout)
    assert [(r["head"], r["tail"]) for p in shown["processes"] for r in p["aio_rings"]] == [(3, 5)]
    _passes(target, "aio")


def test_epoll_item_whose_file_only_another_process_holds_is_refused(spawn, ptckpt, tmp_path):
    _refused(spawn, ptckpt, tmp_path, "epoll-child", "(epoll) watches a file", "registered as fd 100",
             "no fd of the process holds that file now")


def test_aio_request_in_flight_is_refused_and_left_running(spawn, ptckpt, tmp_path):
    """A poll request in flight (on a FIFO nobody writes): counted, the dump is refused by
    name, and the request is still there, untouched, for the program: a byte written to the
    FIFO afterwards completes it."""
    (tmp_path / "dir").mkdir()
    target = spawn("notify", "aio-poll", tmp_path / "dir")
    for _ in range(2):                         # a refused dump leaves it as it was: again
        res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--leave-running")
        assert res.returncode == UNSUPPORTED, res.stderr
        assert "1 request(s) in flight" in res.stderr and res.stderr.count("\n") == 1, res.stderr
        assert not (tmp_path / "img").exists()
    fd = os.open(tmp_path / "dir" / "fifo", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)
    target.signal()
    target.wait_for_line(r"^OK aio-poll\b", timeout=10)
    assert target.wait_exit(10) == 0, target.describe()

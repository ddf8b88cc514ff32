"""Files in every state round-trip: offsets, O_APPEND, O_PATH, directory streams, symlinks,
relative opens, deleted-but-open and deleted mapped files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader

from conftest import idle_script
from test_restore import _dump_kill, _one_line, _restore


def test_every_file_state_at_once(spawn, ptckpt, tmp_path):
    where = tmp_path / "files"
    where.mkdir()
    target = spawn("files", where)
    _dump_kill(ptckpt, target, tmp_path / "img")
    # the ghost and the deleted mapping are gone from the disk; the image has their bytes
    assert not (where / "ghost").exists() and not (where / "gmap").exists()
    with ImageReader(tmp_path / "img") as image:
        ghosts = {g.path: g for g in image.ghost_files}
    assert ghosts[str(where / "ghost")].data == b"ghost contents, still readable"
    assert len(ghosts[str(where / "gmap")].data) == 8192
    _restore(ptckpt, tmp_path / "img")
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK")
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 2 OK")
    target.assert_ok()
    assert not (where / "ghost").exists(), "the ghost is unlinked again"
    assert os.readlink(f"/proc/{target.pid}/cwd") == str(where / "sub")


def _holder(spawn, tmp_path, *paths):
    """A python3 target holding each of `paths` open for reading and writing (fds 3, 4 ...)."""
    opens = "".join(f"fds.append(os.open({str(p)!r}, os.O_RDWR))\n" for p in paths)
    return spawn(str(idle_script(tmp_path, "holder.py", "import os, time\nfds = []\n" + opens)), out=False)


def test_changed_file_policy_strict_warn_ignore(spawn, ptckpt, tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 100)
    target = _holder(spawn, tmp_path, data)
    _dump_kill(ptckpt, target, tmp_path / "img")
    with open(data, "ab") as f:
        f.write(b"more")
    _one_line(ptckpt("restore", "-D", tmp_path / "img"), ExitCode.INCOMPATIBLE,
              "files changed since the dump", f"{data}: size 100 -> 104, mtime changed", "--file-policy")
    assert not os.path.exists(f"/proc/{target.pid}")
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--file-policy", "warn")
    assert res.returncode == 0, res.stderr
    assert f"ptckpt: warning: changed since the dump: {data}: size 100 -> 104" in res.stderr
    target.kill()
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--file-policy", f"{tmp_path}/=ignore")
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr
    assert os.readlink(f"/proc/{target.pid}/fd/3") == str(data)
    target.kill()
    res = ptckpt("restore", "-D", tmp_path / "img", "--file-policy", "sometimes")
    assert res.returncode == ExitCode.USAGE and "sometimes" in res.stderr


LIB = "int lib_value(void) { return %d; }\n"
MAIN = r'''
#include <stdio.h>
#include <unistd.h>
int lib_value(void);
int main(void) {
    printf("READY %d\n", getpid());
    fflush(stdout);
    for (;;) { if (lib_value() < 0) return 1; sleep(1); }
}
'''


def test_replaced_library_is_refused_by_its_build_id(spawn, ptckpt, tmp_path):
    """The library is rebuilt with other code and given back its old size and mtime: only its
    build-id tells, and the refusal names it."""
    lib, src = tmp_path / "libv.so", tmp_path / "lib.c"
    src.write_text(LIB % 1)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, src], check=True)
    (tmp_path / "main.c").write_text(MAIN)
    subprocess.run(["gcc", "-o", tmp_path / "main", tmp_path / "main.c", f"-L{tmp_path}", "-lv",
                    f"-Wl,-rpath,{tmp_path}"], check=True)
    target = spawn(str(tmp_path / "main"), out=False)
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        [vma] = [v for v in image.process(target.pid).vmas if v.path == str(lib)][:1]
        old_id = vma.build_id
    assert len(old_id) == 40
    st = lib.stat()
    src.write_text(LIB % 2)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", tmp_path / "new.so", src], check=True)
    assert (tmp_path / "new.so").stat().st_size == st.st_size
    with open(lib, "r+b") as f:                     # same inode, same size, same mtime
        f.write((tmp_path / "new.so").read_bytes())
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns))
    _one_line(ptckpt("restore", "-D", tmp_path / "img"), ExitCode.INCOMPATIBLE,
              f"{lib}: build-id {old_id[:12]}")


@pytest.mark.proc_differs("fds", reason="--skip-file: the fd is left closed")
def test_save_file_puts_contents_back_and_skip_file_leaves_the_fd_closed(spawn, ptckpt, tmp_path):
    (tmp_path / "slot3").mkdir()
    state, scratch = tmp_path / "slot3" / "state.bin", tmp_path / "scratch.log"
    state.write_bytes(b"checkpointed state")
    scratch.write_text("scratch")
    target = _holder(spawn, tmp_path, state, scratch)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill",
                 "--save-file", f"{tmp_path}/slot3/**", "--skip-file", str(scratch))
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    state.write_bytes(b"what the run after the checkpoint wrote")
    scratch.write_text("changed, but nobody reopens it")
    _restore(ptckpt, tmp_path / "img")
    assert state.read_bytes() == b"checkpointed state"
    assert os.readlink(f"/proc/{target.pid}/fd/3") == str(state)
    assert not os.path.exists(f"/proc/{target.pid}/fd/4"), "the skipped file is not reopened"
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img2", "--save-file", "relative/*")
    assert res.returncode == ExitCode.USAGE and "relative" in res.stderr


def test_eventfd_timerfd_signalfd_inotify_epoll_memfd_mqueue(spawn, ptckpt, tmp_path):
    watched = tmp_path / "watched"
    watched.mkdir()
    target = spawn("fdkinds", watched)          # its queue is removed at teardown (conftest)
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        kinds = sorted(type(s).__name__ for s in image.fd_states)
    assert kinds == ["EpollState", "EpollState", "EventfdState", "InotifyState", "MemfdState", "MqueueState",
                     "SignalfdState", "TimerfdState"]
    _restore(ptckpt, tmp_path / "img")
    (watched / "created").write_text("")
    target.signal(signal.SIGUSR2)
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK", timeout=10)
    target.assert_ok()


LOCKER = r'''
import fcntl, os, struct, sys, time
where = sys.argv[2]
a = os.open(os.path.join(where, "a"), os.O_RDWR | os.O_CREAT, 0o600)
b = os.open(os.path.join(where, "b"), os.O_RDWR | os.O_CREAT, 0o600)
c = os.open(os.path.join(where, "c"), os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(a, fcntl.LOCK_EX)
fcntl.lockf(b, fcntl.LOCK_EX, 100, 0)                    # POSIX write lock on bytes 0-99
F_OFD_SETLK = 37
fcntl.fcntl(c, F_OFD_SETLK, struct.pack("hh4xqqi4x", fcntl.F_RDLCK, 0, 10, 0, 0))  # OFD read 10-EOF
print("READY", os.getpid(), flush=True)
while True: time.sleep(0.05)
'''

PROBE = r'''
import fcntl, os, struct, sys
where = sys.argv[1]
out = []
a = os.open(os.path.join(where, "a"), os.O_RDWR)
try:
    fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB); out.append("a free")
except BlockingIOError:
    out.append("a locked")
b = os.open(os.path.join(where, "b"), os.O_RDWR)
got = fcntl.fcntl(b, fcntl.F_GETLK, struct.pack("hh4xqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))
t, _, start, length, pid = struct.unpack("hh4xqqi4x", got)
out.append(f"b {t == fcntl.F_WRLCK} {start} {length} {pid}")
c = os.open(os.path.join(where, "c"), os.O_RDWR)
got = fcntl.fcntl(c, 36, struct.pack("hh4xqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))    # F_OFD_GETLK
t, _, start, length, pid = struct.unpack("hh4xqqi4x", got)
out.append(f"c {t == fcntl.F_RDLCK} {start} {length}")
print(";".join(out))
'''


def test_flock_posix_and_ofd_locks_are_held_again(spawn, ptckpt, tmp_path):
    """After the round trip another process still cannot take the locks, and F_GETLK names
    the restored process as the holder of the POSIX one."""
    where = tmp_path / "locks"
    where.mkdir()
    target = spawn(str(_write_script(tmp_path, "locker.py", LOCKER)), where)
    probe = lambda: subprocess.run([sys.executable, "-c", PROBE, str(where)], capture_output=True,
                                   text=True, check=True).stdout.strip()
    expected = f"a locked;b True 0 100 {target.pid};c True 10 0"
    assert probe() == expected
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        assert sorted((l.kind, l.type) for l in image.process(target.pid).locks) == \
               [("flock", "write"), ("ofd", "read"), ("posix", "write")]
    assert probe() == "a free;b False 0 0 0;c False 0 0"
    _restore(ptckpt, tmp_path / "img")
    assert probe() == expected


def _write_script(directory, name, text):
    path = directory / name
    path.write_text(text)
    return path


def _appender(spawn, tmp_path, log):
    """A python3 target holding `log` open for appending, one line written."""
    return spawn(str(idle_script(tmp_path, "appender.py", "import os, time\n"
                                 f"fd = os.open({str(log)!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)\n"
                                 "os.write(fd, b'first line\\n')\n")), out=False)


def test_a_log_open_for_appending_that_only_grew_is_accepted_and_said(spawn, ptckpt, tmp_path):
    """A second restore of an image whose program logs (O_APPEND) finds the log longer:
    its bytes up to the dump's size are unchanged (a hash at dump), so the strict default
    accepts it and says so; the restored fd appends after everything."""
    log = tmp_path / "app.log"
    target = _appender(spawn, tmp_path, log)
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        (fd,) = [f for f in image.process(target.pid).fds if f.path == str(log)]
    assert fd.append_hash and fd.size == len(b"first line\n")
    with open(log, "ab") as f:
        f.write(b"written after the dump\n")
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
    assert res.returncode == 0, res.stderr
    assert f"{log}: grew by 23 bytes, open for appending and its first 11 bytes unchanged: accepted" in res.stderr
    with open(f"/proc/{target.pid}/fd/{fd.fd}", "ab") as f:     # the restored description appends
        f.write(b"x\n")
    assert log.read_bytes() == b"first line\nwritten after the dump\nx\n"


def test_a_log_open_for_appending_whose_old_bytes_changed_is_refused(spawn, ptckpt, tmp_path):
    log = tmp_path / "app.log"
    target = _appender(spawn, tmp_path, log)
    _dump_kill(ptckpt, target, tmp_path / "img")
    log.write_bytes(b"FIRST line\nand more\n")                   # rewritten, longer: not an append
    _one_line(ptckpt("restore", "-D", tmp_path / "img", "--detach"), ExitCode.INCOMPATIBLE,
              f"{log}: size 11 -> 20, mtime changed")


def test_deleted_device_node_fifo_socket_and_symlinks_held(spawn, ptckpt, tmp_path):
    """A device node opened and deleted (CRIU's deleted_dev), and a FIFO, a socket's name and a
    symbolic link held O_PATH and deleted (its symlink01): each is made again for the restore
    (mknod, mkfifo, symlink) with its type, permissions, owner, device numbers and target,
    reopened and deleted again; a symbolic link held O_PATH|O_NOFOLLOW and not deleted is the
    link again, not what it leads to."""
    where = tmp_path / "nodes"
    where.mkdir()
    target = spawn("ghostnodes", where)
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        ghosts = {os.path.basename(g.path): g for g in image.ghost_files}
    assert sorted(ghosts) == ["fifo", "link", "null", "sock"]
    assert (os.major(ghosts["null"].rdev), os.minor(ghosts["null"].rdev)) == (1, 3)
    assert ghosts["link"].target == "some/target"
    _restore(ptckpt, tmp_path / "img")
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY OK")
    target.assert_ok()
    assert sorted(os.listdir(where)) == ["kept"], "the ghosts are deleted again"

"""Deleted paths and file attributes round-trip: a sparse deleted file with its mode and
mtime, an open removed directory, a removed cwd, a deleted FIFO with bytes in it, a shared
file mapping that may be made writable, and an fd's SIGIO owner, signal and O_ASYNC.
What cannot come back (an owner outside the tree, a deleted FIFO held outside, a deleted
device node)
is refused at dump by name."""

from __future__ import annotations

import os
import signal
import stat

import pytest

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader

from conftest import idle_script
from test_restore import _dump_kill, _one_line, _restore


def test_deleted_paths_and_attributes(spawn, ptckpt, tmp_path):
    where = tmp_path / "d"
    where.mkdir()
    target = spawn("deleted", where)
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        ghosts = {g.path: g for g in image.ghost_files}
        proc = image.process(image.pids[0])
    holes = ghosts[str(where / "holes")]
    assert holes.size == 128 * 1024 and holes.extents == ((0, 4096), (65536, 4096))
    assert len(holes.data) == 8192, "only the data extents go into the image"
    assert stat.S_IMODE(holes.mode) == 0o6604 and holes.mtime_ns == 123456 * 10**9
    assert stat.S_ISDIR(ghosts[str(where / "gone" / "sub")].mode)
    assert stat.S_ISDIR(ghosts[str(where / "cwd")].mode)
    assert [(o.pid, o.signo) for o in proc.owners] == [(target.pid, signal.SIGUSR2)]

    _restore(ptckpt, tmp_path / "img")
    assert sorted(os.listdir(where)) == ["shared"], "nothing made for the restore is left behind"
    assert os.readlink(f"/proc/{target.pid}/cwd") == f"{where}/cwd (deleted)"
    links = {os.readlink(f"/proc/{target.pid}/fd/{n}") for n in os.listdir(f"/proc/{target.pid}/fd")}
    assert {f"{where}/holes (deleted)", f"{where}/gone/sub (deleted)"} <= links
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK")
    target.signal(signal.SIGUSR1)                 # the FIFO is read once; the rest holds still
    target.wait_for_line("VERIFY 2 OK")
    target.assert_ok()


def test_deleted_paths_under_remap_path(spawn, ptckpt, tmp_path):
    """--remap-path moves what is reopened by path (the shared mapping) and leaves what the
    image holds (the deleted cwd, directory and file) as it was."""
    where, moved = tmp_path / "d", tmp_path / "d2"
    where.mkdir()
    target = spawn("deleted", where)
    _dump_kill(ptckpt, target, tmp_path / "img")
    moved.mkdir()
    (moved / "shared").write_bytes((where / "shared").read_bytes())
    _restore(ptckpt, tmp_path / "img", "--remap-path", f"{where}={moved}")
    assert os.readlink(f"/proc/{target.pid}/cwd") == f"{where}/cwd (deleted)"
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK")
    target.assert_ok()
    assert (moved / "shared").read_bytes()[0:1] == b"x", "the mapping is the moved file's"


def _holder_of_deleted(spawn, tmp_path, path, opening: str):
    """A python3 target that opens `path` (`opening`: the os.open flags), then unlinks it:
    (the target, the fd number whose link reads "PATH (deleted)")."""
    target = spawn(str(idle_script(tmp_path, f"holder-{path.name}.py", "import os, time\n"
                                   f"fd = os.open({str(path)!r}, {opening})\n"
                                   f"os.unlink({str(path)!r})\n")), out=False)
    fd = next(n for n in os.listdir(f"/proc/{target.pid}/fd")
              if os.readlink(f"/proc/{target.pid}/fd/{n}") == f"{path} (deleted)")
    return target, fd


def test_deleted_file_opened_o_path(spawn, ptckpt, tmp_path):
    (tmp_path / "P").write_bytes(b"p")
    target, fd = _holder_of_deleted(spawn, tmp_path, tmp_path / "P", "os.O_PATH")
    _dump_kill(ptckpt, target, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    assert os.readlink(f"/proc/{target.pid}/fd/{fd}") == f"{tmp_path}/P (deleted)"
    flags = int(next(line for line in open(f"/proc/{target.pid}/fdinfo/{fd}") if line.startswith("flags:"))
                .split()[1], 8)
    assert flags & 0o10000000, "still an O_PATH fd"
    with open(f"/proc/{target.pid}/fd/{fd}", "rb") as f:
        assert f.read() == b"p"
    assert os.listdir(tmp_path).count("P") == 0


@pytest.mark.proc_differs("fds", reason="its flags lose O_TMPFILE's bits (it is made again by name, then "
                                       "unlinked, so that it keeps its name #INODE)")
def test_a_file_made_with_o_tmpfile_comes_back_with_its_bytes_and_offset(spawn, ptckpt, tmp_path):
    """An O_TMPFILE file never had a name ("DIR/#INODE (deleted)"; pytest's output capture
    is one): it comes back with its bytes and offset, reopened as the file it is (its
    O_TMPFILE flags hold O_DIRECTORY, which a reopen must not ask for)."""
    where = tmp_path / "t"
    where.mkdir()
    target = spawn(str(idle_script(tmp_path, "tmpfile.py", "import os, time\n"
                                   f"fd = os.open({str(where)!r}, os.O_TMPFILE | os.O_RDWR, 0o600)\n"
                                   "os.write(fd, b'unnamed bytes')\n"
                                   "os.lseek(fd, 3, os.SEEK_SET)\n")), out=False)
    fd = next(n for n in os.listdir(f"/proc/{target.pid}/fd")
              if os.readlink(f"/proc/{target.pid}/fd/{n}").startswith(f"{where}/#"))
    _dump_kill(ptckpt, target, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    link = os.readlink(f"/proc/{target.pid}/fd/{fd}")
    assert link.startswith(str(where)) and link.endswith(" (deleted)"), link
    with open(f"/proc/{target.pid}/fdinfo/{fd}") as f:
        assert next(line for line in f if line.startswith("pos:")).split()[1] == "3"
    with open(f"/proc/{target.pid}/fd/{fd}", "rb") as f:
        assert f.read() == b"unnamed bytes"
    assert os.listdir(where) == [], "nothing left behind"


CHROOT = """import os, time
os.chdir({where!r})
os.chroot({where!r})
os.chdir("/")
"""


def test_root_and_a_removed_root(spawn, ptckpt, tmp_path):
    """chroot'ed processes: the root comes back after the exe and cwd are opened by the paths
    ptckpt sees; a removed root (and cwd in it) is made again and entered."""
    live, gone = tmp_path / "live", tmp_path / "gone"
    live.mkdir()
    gone.mkdir()
    a = spawn(str(idle_script(tmp_path, "a.py", CHROOT.format(where=str(live)))), out=False)
    b = spawn(str(idle_script(tmp_path, "b.py", CHROOT.format(where=str(gone)))), out=False)
    gone.rmdir()
    assert os.readlink(f"/proc/{b.pid}/root") == f"{gone} (deleted)"
    for target in (a, b):
        _dump_kill(ptckpt, target, tmp_path / f"img{target.pid}")
        _restore(ptckpt, tmp_path / f"img{target.pid}")
    assert os.readlink(f"/proc/{a.pid}/root") == os.readlink(f"/proc/{a.pid}/cwd") == str(live)
    assert os.readlink(f"/proc/{b.pid}/root") == os.readlink(f"/proc/{b.pid}/cwd") == f"{gone} (deleted)"
    assert not gone.exists()


def test_deleted_file_keeps_its_extended_attributes(spawn, ptckpt, tmp_path):
    path = tmp_path / "X"
    path.write_bytes(b"x")
    os.setxattr(path, "user.ptckpt", b"kept\0too")
    target, fd = _holder_of_deleted(spawn, tmp_path, path, "os.O_RDONLY")
    _dump_kill(ptckpt, target, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    assert os.getxattr(f"/proc/{target.pid}/fd/{fd}", "user.ptckpt") == b"kept\0too"


@pytest.mark.proc_differs("fds", reason="the fd's file is reopened by its other name")
def test_deleted_name_of_a_file_linked_elsewhere(spawn, ptckpt, tmp_path):
    """A name deleted while another link holds the file: the restored fd is that very file
    (a copy would part from it), opened again by its file handle."""
    name, other = tmp_path / "L", tmp_path / "L2"
    name.write_bytes(b"shared by two names")
    os.link(name, other)
    target, fd = _holder_of_deleted(spawn, tmp_path, name, "os.O_RDWR")
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        (ghost,) = image.ghost_files
    assert ghost.handle and ghost.data == b""
    _restore(ptckpt, tmp_path / "img")
    assert os.stat(f"/proc/{target.pid}/fd/{fd}").st_ino == os.stat(other).st_ino
    with open(f"/proc/{target.pid}/fd/{fd}", "r+b") as f:
        f.write(b"SHARED")
    assert other.read_bytes() == b"SHARED by two names"
    assert sorted(os.listdir(tmp_path)).count("L") == 0


def test_deleted_fifo_keeps_its_bytes(spawn, ptckpt, tmp_path):
    script = idle_script(tmp_path, "fifo.py", "import os, time\n"
                         f"os.mkfifo({str(tmp_path / 'f')!r})\n"
                         f"w = os.open({str(tmp_path / 'f')!r}, os.O_RDWR)\n"
                         f"r = os.open({str(tmp_path / 'f')!r}, os.O_RDONLY | os.O_NONBLOCK)\n"
                         "os.write(w, b'still here')\n"
                         f"os.unlink({str(tmp_path / 'f')!r})\n"
                         "os.close(w)\n")
    target = spawn(str(script), out=False)
    fd = next(n for n in os.listdir(f"/proc/{target.pid}/fd")
              if os.readlink(f"/proc/{target.pid}/fd/{n}").endswith("/f (deleted)"))
    _dump_kill(ptckpt, target, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    assert os.readlink(f"/proc/{target.pid}/fd/{fd}") == f"{tmp_path}/f (deleted)"
    copy = os.open(f"/proc/{target.pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert os.read(copy, 100) == b"still here"
    finally:
        os.close(copy)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ptckpt-fifo")]


def test_what_cannot_come_back_is_refused_at_dump(spawn, ptckpt, tmp_path):
    owner = spawn(str(idle_script(tmp_path, "owner.py", "import fcntl, os, time\n"
                                  "r, w = os.pipe()\n"
                                  "fcntl.fcntl(r, fcntl.F_SETOWN, os.getppid())\n")), out=False)
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    outside = os.open(fifo, os.O_RDWR)
    try:
        held = spawn(str(idle_script(tmp_path, "held.py", "import os, time\n"
                                     f"r = os.open({str(fifo)!r}, os.O_RDONLY | os.O_NONBLOCK)\n")), out=False)
        os.unlink(fifo)
        os.mknod(tmp_path / "N", 0o600 | stat.S_IFCHR, os.makedev(1, 3))      # /dev/null's numbers
        node = spawn(str(idle_script(tmp_path, "node.py", "import os, time\n"
                                     f"p = os.open({str(tmp_path / 'N')!r}, os.O_RDWR)\n"
                                     f"os.unlink({str(tmp_path / 'N')!r})\n")), out=False)
        # a deleted device node is made again with mknod: refused by a dump that lacks CAP_MKNOD
        for target, words, prefix in (
                (node, [f"{tmp_path / 'N'} (deleted)", "a deleted device node", "CAP_MKNOD"],
                 ("setpriv", "--bounding-set", "-mknod")),
                (owner, ["SIGIO owner", f"process {os.getpid()}", "outside the dumped tree"], ()),
                (held, [f"{fifo} (deleted)", "holds it too"], ())):
            _one_line(ptckpt("dump", target.pid, "-D", tmp_path / f"img{target.pid}", prefix=prefix),
                      ExitCode.UNSUPPORTED_RESOURCE, *words)
            assert target.alive() and not (tmp_path / f"img{target.pid}").exists()
    finally:
        os.close(outside)


@pytest.mark.parametrize("held", ["fd", "cwd"])
def test_a_file_of_a_process_that_ended_is_refused_at_dump(spawn, ptckpt, tmp_path, held):
    """An fd on /proc/PID/status, or a cwd of /proc/PID, of a child that has ended and been
    reaped: it reads ESRCH and no restore can open it again, so the dump refuses it (the
    restore would have found the file missing), one line naming it; the target runs on."""
    hold = ("fd = os.open(f'/proc/{pid}/status', os.O_RDONLY)\n" if held == "fd"
            else "os.chdir(f'/proc/{pid}')\n")
    script = idle_script(tmp_path, f"ended-{held}.py", "import os, time\n"
                         "pid = os.fork()\n"
                         "if pid == 0:\n    time.sleep(0.2)\n    os._exit(0)\n"
                         + hold + "os.waitpid(pid, 0)\n")
    target = spawn(str(script), out=False)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill")
    _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, "/proc/", "that process has ended")
    assert target.alive() and not (tmp_path / "img").exists()

"""Pty pairs held inside the tree: bytes queued each way, packet mode, a second /dev/ptmx,
a session whose controlling terminal is one of them, hung-up slaves; a leave-running dump
gives the bytes back to the tree left running, a restore to the restored one."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import pytest

from conftest import idle_script, kill_pids, wait_pid_free, wait_until

from ptckpt.resources import terminals as T
from ptckpt.tracee import pidfd_getfd


def _verified(target) -> None:
    os.kill(target.pid, signal.SIGUSR1)
    wait_until(lambda: "VERIFY OK" in target.out_text() or "FAIL" in target.out_text()
               or not target.alive(), 20, message=target.describe)
    assert "VERIFY OK" in target.out_text(), target.describe()


def _dump_leave_running_then_restore(target, ptckpt, image, others=()) -> None:
    """Dump `target` leaving it running; it checks its ptys (the dump put back what it read);
    then restore the image and the restored copy checks them again."""
    res = ptckpt("dump", target.pid, "-D", image)
    assert res.returncode == 0, res.stderr
    _verified(target)
    assert target.wait_exit(20) == 0, target.describe()
    kill_pids(others)
    for pid in (target.pid, *others):
        wait_pid_free(pid)
    target.out_path.write_text("")
    res = ptckpt("restore", "-D", image, "--detach", "--file-policy", "ignore")
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    _verified(target)


@pytest.mark.parametrize("build", ["x86_64", pytest.param("-m32", marks=pytest.mark.proc_differs(
    "maps", reason="[vsyscall] shows in a restored 32-bit process (test_compat32)"))])
def test_two_pty_pairs_with_bytes_queued_each_way_and_packet_mode(spawn, ptckpt, tmp_path, request, build):
    """Pair A (canonical): complete lines, one with a quoted newline, lines ended by VEOF
    and an unfinished line typed and unread, output unread; pair B (a second /dev/ptmx,
    packet mode, raw slave): both queues.  The program reads each back exactly, line by
    line, after a leave-running dump and after a restore; its session has no controlling
    terminal, before and after (a 32-bit program's too: its termios through the compat ioctls)."""
    target = spawn("ptypair" if build == "x86_64" else str(request.getfixturevalue("fixture_bins32")["ptypair"]),
                   "queues")
    _dump_leave_running_then_restore(target, ptckpt, tmp_path / "img")


def test_a_session_whose_controlling_terminal_is_a_pty_of_the_tree(spawn, ptckpt, tmp_path):
    """The session leader made the slave its controlling terminal and closed it (CRIU's pty03);
    its child, forked after, holds the slave by its path.  After the restore open("/dev/tty")
    works in both, is this pty (typed bytes come out of it, the child's reach the master),
    and the leader's group is in front."""
    target = spawn("ptypair", "ctty")
    kid = int(target.stdout_lines()[0].split()[2])
    try:
        _dump_leave_running_then_restore(target, ptckpt, tmp_path / "img", others=(kid,))
        assert target.wait_exit(20) == 0, target.describe()
    finally:
        kill_pids([kid])


HUNG_UP = """\
import os, fcntl, time
master = os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
fcntl.ioctl(master, 0x40045431, b"\\0\\0\\0\\0")              # TIOCSPTLCK 0
name = "/dev/pts/%d" % int.from_bytes(fcntl.ioctl(master, 0x80045430, b"\\0\\0\\0\\0"), "little")
os.dup2(os.open(name, os.O_RDWR | os.O_NOCTTY), 10)
os.dup2(os.open(name, os.O_RDWR | os.O_NOCTTY), 11)
os.close(master)                                            # the slaves hang up
"""


def test_slaves_whose_master_was_closed_come_back_hung_up(spawn, ptckpt, tmp_path):
    """Two opens of a slave whose master the process closed (CRIU's pty04): restored as two
    slave descriptions of one new pty, hung up (their ioctls fail with EIO)."""
    target = spawn(str(idle_script(tmp_path, "hung.py", HUNG_UP)), out=False)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill")
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    wait_pid_free(target.pid)
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    for fd in (10, 11):
        assert os.readlink(f"/proc/{target.pid}/fd/{fd}").endswith(" (deleted)")
        copy = pidfd_getfd(target.pid, fd)
        try:
            with pytest.raises(OSError) as err:
                T._get_termios(copy)
            assert err.value.errno == errno.EIO, f"fd {fd} is not hung up"
            assert os.read(copy, 10) == b""
        finally:
            os.close(copy)
    assert os.stat(f"/proc/{target.pid}/fd/10").st_rdev == os.stat(f"/proc/{target.pid}/fd/11").st_rdev


PACKET_STATUS = """\
import os, fcntl, termios, time
master = os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
fcntl.ioctl(master, 0x40045431, b"\\0\\0\\0\\0")              # TIOCSPTLCK 0
fcntl.ioctl(master, termios.TIOCPKT, b"\\1\\0\\0\\0")
slave = fcntl.ioctl(master, 0x5441, os.O_RDWR | os.O_NOCTTY)  # TIOCGPTPEER
termios.tcflush(slave, termios.TCIFLUSH)                     # TIOCPKT_FLUSHREAD for the master
"""


def test_a_packet_status_not_read_yet_is_refused_at_dump(spawn, ptckpt, tmp_path):
    """A packet-mode master whose status byte (TIOCPKT_FLUSHREAD after a tcflush) its program
    has not read: refused by name, the process left running with the status still there."""
    target = spawn(str(idle_script(tmp_path, "pkt.py", PACKET_STATUS)), out=False)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == 13, res.stderr
    line, = res.stderr.strip().splitlines()
    assert "packet mode with a status byte" in line and "/dev/ptmx" in line, line
    assert target.alive() and not (tmp_path / "img").exists()
    master = next(int(fd) for fd in os.listdir(f"/proc/{target.pid}/fd")
                  if os.readlink(f"/proc/{target.pid}/fd/{fd}") == "/dev/ptmx")
    copy = pidfd_getfd(target.pid, master)
    try:
        fcntl.fcntl(copy, fcntl.F_SETFL, os.O_NONBLOCK | os.O_RDWR)
        assert os.read(copy, 16) == bytes([1])                # TIOCPKT_FLUSHREAD, still there
    finally:
        os.close(copy)


def test_typed_bytes_go_back_line_by_line_in_a_frozen_tree(tmp_path):
    """take_typed / type_in on a pty of ptckpt's own: what they read is put back as it was
    (complete lines as separate reads, a VEOF-ended line, an unfinished one), with no echo."""
    master = os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
    try:
        fcntl.ioctl(master, T.TIOCSPTLCK, b"\0\0\0\0")
        slave = fcntl.ioctl(master, T.TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            os.write(master, b"one\nx\x16\ny\n\x04z\x04tail")
            echo = b""
            while b"tail" not in echo:                               # all typed, all echoed
                echo += os.read(master, 4096)
            tio = T._get_termios(slave)
            data, lines = T.take_typed(slave, tio)
            assert (data, lines) == (b"one\nx\ny\nztail", (4, 4, 0, 1))
            T.type_in(slave, tio, data, lines)
            assert T._get_termios(slave) == tio
            got = [os.read(slave, 4096) for _ in range(4)]
            assert got == [b"one\n", b"x\ny\n", b"", b"z"]
            with contextlib.suppress(BlockingIOError):
                raise AssertionError(os.read(slave, 4096))        # "tail" is no line yet
            os.write(master, b"!\n")
            wait_until(lambda: fcntl.ioctl(slave, T.TIOCINQ, b"\0\0\0\0") != b"\0\0\0\0", 5)
            assert os.read(slave, 4096) == b"tail!\n"
            fcntl.fcntl(master, fcntl.F_SETFL, os.O_NONBLOCK | os.O_RDWR)
            assert os.read(master, 4096) == b"!\r\n"             # only the new echo
        finally:
            os.close(slave)
    finally:
        os.close(master)

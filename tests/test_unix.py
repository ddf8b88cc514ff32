"""Unix sockets in their harder states (fixtures/unixkinds.py): connections not yet
accepted with the data their clients sent, deleted and replaced socket paths, fds and
credentials in flight.  Real processes, the real kernel; each refusal is held by a test."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader

from conftest import descendants, idle_script, wait_pid_free
from test_restore import _one_line, _restore


def _dump(ptckpt, t, image, *flags):
    return ptckpt("dump", t.pid, "-D", image, *flags)


def _dump_kill(ptckpt, t, image, *flags):
    res = _dump(ptckpt, t, image, "--kill", *flags)
    assert res.returncode == 0, res.stderr
    t.wait_exit(10)
    wait_pid_free(t.pid)


def _after(t, count: int) -> list[str]:
    """The lines the program wrote after SIGUSR1 (its log), once `count` are there."""
    t.signal(signal.SIGUSR1)
    assert t.wait_exit(10) == 0, t.describe()
    lines = t.out_lines()
    assert not [l for l in lines if l.startswith("FAIL")], t.describe()
    assert t.stderr_text().strip() == "", t.describe()
    return lines[-count:]


def _pending_lines(stype: str) -> list[str]:
    a = "[b'earlyA']" if stype == "stream" else "[b'early', b'A']"
    return ["MODE 0o140640", "SERVED [b'to accepted']", f"ACCEPT A {a}", "ACCEPT B []",
            "LATE B [b'late B']", "ACCEPT C [b'early C'] EOF", "QUEUE empty"]


@pytest.mark.parametrize("stype", ["stream", "seqpacket"])
def test_connections_not_yet_accepted_come_back_with_their_data(spawn, ptckpt, tmp_path, stype):
    """Three connections waiting in a listener's queue (one with two messages, one with
    nothing, one whose client closed after sending): after the round trip accept() returns
    them in order, each with its data (and EOF for the closed one); the socket file keeps
    its mode."""
    t = spawn("unixkinds.py", "pending", stype)
    assert "PENDING 3" in t.preamble
    _dump_kill(ptckpt, t, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        pending = [u for u in image.unix_sockets if u.pending]
    assert [u.queue for u in pending] == [(b"earlyA",) if stype == "stream" else (b"early", b"A"),
                                          (), (b"early C",)]
    _restore(ptckpt, tmp_path / "img")
    assert _after(t, 7) == _pending_lines(stype)


def test_pending_data_refuses_a_leave_running_dump(spawn, ptckpt, tmp_path):
    """Reading what a pending connection holds means accepting it: a leave-running dump is
    refused by name, and the program finds its queue as it was."""
    t = spawn("unixkinds.py", "pending", "stream")
    res = _dump(ptckpt, t, tmp_path / "img")
    _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, f"process {t.pid}", "not yet accepted", "--kill")
    assert not (tmp_path / "img").exists()
    assert _after(t, 7) == _pending_lines("stream")


def test_pending_connection_from_outside_the_tree_is_refused(spawn, ptckpt, tmp_path):
    t = spawn("unixkinds.py", "pending", "stream")
    with socket.socket(socket.AF_UNIX) as outside:
        outside.connect(str(t.out_path) + ".sock")
        res = _dump(ptckpt, t, tmp_path / "img", "--kill")
        _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, f"process {t.pid}", "waits to be accepted",
                  f"held by pid {os.getpid()}")
    assert t.poll() is None or not t.poll()


@pytest.mark.parametrize("stype", ["stream", "seqpacket"])
def test_deleted_and_replaced_socket_paths_stay_deleted(spawn, ptckpt, tmp_path, stype):
    """An accepted socket whose listener's path was unlinked keeps its name and the path
    stays absent; a listener whose path now names another listener's file keeps its name,
    and the path still leads to the other one."""
    t = spawn("unixkinds.py", "deleted", stype)
    gone, replaced = f"{t.out_path}.d", f"{t.out_path}.x"
    _dump_kill(ptckpt, t, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        flags = {(u.name.decode(), u.state, u.deleted) for u in image.unix_sockets if u.name}
    assert (gone, 1, True) in flags and (replaced, 10, True) in flags and (replaced, 10, False) in flags
    _restore(ptckpt, tmp_path / "img")
    lines = _after(t, 5)
    assert lines == [f"NAME {gone}", "GONE True", "SERVED [b'after']", f"Y {replaced}", "X reached [b'to x']"]
    assert not os.path.lexists(gone)
    assert not [n for n in os.listdir(tmp_path) if ".ptckpt-aside" in n]


def test_relative_names_bound_before_a_chdir(spawn, ptckpt, tmp_path):
    """Relative names are bound and connected to from the directory they were bound in, not
    the process's cwd at dump (it moved to / after binding): a datagram socket whose name
    is now a FIFO's keeps its connected sender, and the FIFO stays; an accepted socket
    keeps its listener's relative name."""
    t = spawn("unixkinds.py", "relative")
    _dump_kill(ptckpt, t, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        dirs = {(u.name, u.name_dir) for u in image.unix_sockets if u.name}
    assert (b"r.sock", f"{t.out_path}.rel") in dirs
    _restore(ptckpt, tmp_path / "img")
    assert _after(t, 4) == ["CWD /", "DGRAM [b'rel'] r.sock r.sock", "FIFO True", "STREAM [b'to l'] l.sock"]


@pytest.mark.parametrize("stype", ["stream", "seqpacket"])
def test_deleted_names_in_a_removed_directory(spawn, ptckpt, tmp_path, stype):
    """Sockets bound to names whose directory was removed after them come back (the
    directory made for the while and removed again); two datagram sockets bound in turn to
    one deleted name each keep their own sender."""
    t = spawn("unixkinds.py", "gone-dir", stype)
    _dump_kill(ptckpt, t, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    assert _after(t, 3) == ["DGRAM [b'one'] [b'three']", "STREAM [b'first'] [b'second']", "SUB gone"]
    assert os.listdir(f"{t.out_path}.g") == []


SCM_LINES = ["PIPE b'pipe' b'through pipe'", "FILE b'file' b'345'", "SOCK b'sock' b'inside' b'back'",
             "PLAIN b'plain'"]


@pytest.mark.parametrize("stype", ["stream", "seqpacket", "dgram"])
def test_fds_in_flight_come_back_with_their_files(spawn, ptckpt, tmp_path, stype):
    """A pipe end, a file at its offset and a socket with its own queue, each in flight
    and closed by the sender: after the round trip each message comes with its file."""
    t = spawn("unixkinds.py", "scm", stype)
    _dump_kill(ptckpt, t, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        kinds = sorted(f.kind.name for f in image.in_flight)
        carried = [u.queue_fds for u in image.unix_sockets if u.queue_fds]
    assert kinds == ["PIPE", "REGULAR", "SOCKET"]
    assert len(carried) == 1 and sum(map(len, carried[0])) == 3
    _restore(ptckpt, tmp_path / "img")
    assert _after(t, 4) == SCM_LINES


@pytest.mark.parametrize("stype", ["stream", "seqpacket", "dgram"])
def test_messages_of_a_closed_sender_still_arrive(spawn, ptckpt, tmp_path, stype):
    """The sending end closed, its messages (with fds in flight) still queued on the
    reader (CRIU's scm09, socket_close_data): they all arrive after the round trip, then
    the end of the stream, or nothing more for a datagram socket."""
    t = spawn("unixkinds.py", "scm", stype, "closed")
    _dump_kill(ptckpt, t, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    end = "END nothing queued" if stype == "dgram" else "END b''"
    assert _after(t, 5) == SCM_LINES + [end]


def test_fds_in_flight_stay_queued_after_a_leave_running_dump(spawn, ptckpt, tmp_path):
    """The dump peeks at them (copies, closed again): the program then reads every
    message with its file, as if no dump had happened."""
    t = spawn("unixkinds.py", "scm", "stream")
    res = _dump(ptckpt, t, tmp_path / "img")
    assert res.returncode == 0, res.stderr
    assert _after(t, 4) == SCM_LINES


def test_an_fd_in_flight_of_a_kind_not_passed_again_is_refused(spawn, ptckpt, tmp_path):
    t = spawn("unixkinds.py", "scm-eventfd")
    res = _dump(ptckpt, t, tmp_path / "img", "--kill")
    _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, f"process {t.pid}", "in flight", "eventfd")
    assert _after(t, 1) == ["EVENTFD 7"]


def _creds_lines(child: str = "child") -> list[str]:
    me, other = f"{os.getuid()} {os.getgid()}", "4321 4321" if os.getuid() == 0 else f"{os.getuid()} {os.getgid()}"
    return [f"CREDS self1 me {me}", f"CREDS child {child} {other}", f"CREDS self2 me {me}"]


@pytest.mark.parametrize("stype,pidns", [("stream", False), ("seqpacket", False), ("dgram", False),
                                         ("stream", True)])
def test_queued_credentials_come_back_with_each_message(spawn, ptckpt, tmp_path, stype, pidns):
    """Messages queued for a reader with SO_PASSCRED carry their senders' pid, uid and gid:
    the process's own, then a child's (another uid and gid), then its own again.  After the
    round trip each read gets one sender's message with that sender's credentials (a
    stream's reads stop where they change), the pids as the tree sees them (with --pidns
    too, where the restored processes have other pids outside)."""
    t = spawn("unixkinds.py", "scm-creds", stype)
    (child,) = descendants(t.pid)
    _dump_kill(ptckpt, t, tmp_path / "img")
    wait_pid_free(child)
    with ImageReader(tmp_path / "img") as image:
        creds = [u.queue_creds for u in image.unix_sockets if u.queue_creds]
    assert [[c[0] for c in q] for q in creds] == [[t.pid, child, t.pid]]
    outer = _restore(ptckpt, tmp_path / "img", *(["--pidns"] if pidns else []))
    if not pidns:
        assert _after(t, 3) == _creds_lines()
        return
    assert outer != t.pid
    t.adopt(outer)                   # its exit status goes to the namespace's init: not seen here
    t.signal(signal.SIGUSR1)
    t.wait_exit(10)
    assert t.out_lines()[-3:] == _creds_lines()


def test_queued_credentials_of_a_sender_gone_are_refused(spawn, ptckpt, tmp_path):
    """A message whose sender has exited carries a pid no restore can give it again (the
    kernel takes only a live one): refused by name, and the program then reads its
    messages with their credentials, as if no dump had been tried."""
    t = spawn("unixkinds.py", "scm-creds", "dgram", "gone")
    res = _dump(ptckpt, t, tmp_path / "img", "--kill")
    _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, f"process {t.pid}", "credentials of pid",
              "not a process of the tree", "SO_PASSCRED")
    assert _after(t, 3) == _creds_lines()


def test_a_datagram_peer_outside_the_tree_with_ext_unix_sk(spawn, ptckpt, tmp_path):
    """A datagram socket connected to a socket outside the tree bound to a path (CRIU's
    socket-ext): refused by name, the way out said; with --ext-unix-sk it is connected to
    that path again at restore, and what it sends reaches the socket outside."""
    path = str(tmp_path / "outside.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as outside:
        outside.bind(path)
        outside.settimeout(10)
        script = idle_script(tmp_path, "extsk.py", (
            "import os, signal, socket, time\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            f"s.connect({path!r})\n"
            "signal.signal(signal.SIGUSR1, lambda *_: s.send(b'after restore'))\n"))
        t = spawn(str(script), out=False)
        res = _dump(ptckpt, t, tmp_path / "refused", "--kill")
        _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, "outside.sock", "--ext-unix-sk")
        assert t.alive()
        _dump_kill(ptckpt, t, tmp_path / "img", "--ext-unix-sk")
        t.adopt(_restore(ptckpt, tmp_path / "img"))
        t.signal(signal.SIGUSR1)
        assert outside.recv(100) == b"after restore"

"""What the members of a tree share survives a round trip: pipes with their bytes, shared
descriptions, zombies, unix sockets, shared memory, SysV IPC."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader

from conftest import needs, kill_pids, reap_orphans, wait_until
from test_restore import _dump_kill, _one_line, _restore

PRODUCER = r'''
import sys
n = 0
out = sys.stdout.buffer
while True:
    n += 1
    out.write(b"%d\n" % n)
    if n % 64 == 0:
        out.flush()
'''

CONSUMER = r'''
import sys, time
log = sys.argv[1]
expect = 1
for line in sys.stdin.buffer:
    n = int(line)
    if n != expect:
        open(log, "w").write(f"FAIL got {n} expected {expect}\n")
        sys.exit(3)
    expect += 1
    if n % 2000 == 0:
        with open(log + ".tmp", "w") as f:
            f.write(f"{n}\n")
        import os; os.replace(log + ".tmp", log)
        time.sleep(0.02)          # slower than the producer: the pipes stay full
'''


def _tree_of(pid: int) -> list[int]:
    out = [pid]
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        for c in map(int, f.read().split()):
            out += _tree_of(c)
    return out


def _stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return {"state": fields[0], "ppid": int(fields[1]), "pgid": int(fields[2]), "sid": int(fields[3])}


def _seen(log) -> int:
    try:
        text = open(log).read()
    except FileNotFoundError:
        return 0
    assert not text.startswith("FAIL"), text
    return int(text) if text.strip() else 0


@pytest.mark.parametrize("pidns", [False, True], ids=["same-pids", "pidns"])
def test_shell_pipeline_loses_and_repeats_nothing(spawn, ptckpt, tmp_path, pidns):
    """bash -c 'producer | cat | consumer': the pipes are full at the dump; after the round
    trip the consumer goes on seeing 1, 2, 3 ... with no number lost or repeated (also in a
    fresh pid namespace, where the members keep their pids inside)."""
    (tmp_path / "producer.py").write_text(PRODUCER)
    (tmp_path / "consumer.py").write_text(CONSUMER)
    log = tmp_path / "seen"
    py = shutil.which("python3")
    bash = spawn(shutil.which("bash"), "-c",
                 f"{py} {tmp_path}/producer.py | cat | {py} {tmp_path}/consumer.py {log}",
                 out=False, ready=False)
    wait_until(lambda: _seen(log) >= 20000, 20, message="the pipeline runs")
    members = _tree_of(bash.pid)
    assert len(members) == 4
    before = {p: _stat(p) for p in members}
    before_pids = list(members)
    try:
        _dump_kill(ptckpt, bash, tmp_path / "img")
        with ImageReader(tmp_path / "img") as image:
            buffered = sum(len(p.data) for p in image.pipes)
            assert len(image.pipes) == 2 and buffered > 4096, [len(p.data) for p in image.pipes]
        for p in members:
            wait_until(lambda: not os.path.exists(f"/proc/{p}"), 5, message=f"{p} gone")
        at_dump = _seen(log)
        outer = _restore(ptckpt, tmp_path / "img", *(["--pidns"] if pidns else []))
        wait_until(lambda: _seen(log) >= at_dump + 40000, 30, message="the consumer goes on")
        if pidns:
            members = _tree_of(outer)
            assert len(members) == 4
            init = _stat(outer)["ppid"]
            members.append(init)
            with open(f"/proc/{members[-2]}/status") as f:
                assert next(l for l in f if l.startswith("NSpid:")).split()[-1] == str(before_pids[-1])
            return
        for p in members:
            after = _stat(p)
            assert {k: after[k] for k in ("ppid", "pgid", "sid")} == \
                   {k: before[p][k] for k in ("ppid", "pgid", "sid")}, p
    finally:
        kill_pids(members)
        reap_orphans()


FAMILY = r'''
import ctypes, os, signal, sys, time
libc = ctypes.CDLL(None)
out = sys.argv[1]
def prctl_int(option):
    v = ctypes.c_int(0)
    libc.prctl(option, ctypes.byref(v), 0, 0, 0)
    return v.value
def report(name, text):
    with open(out + "." + name + ".tmp", "w") as f:
        f.write(text + "\n")
    os.replace(out + "." + name + ".tmp", out + "." + name)
libc.prctl(36, 1, 0, 0, 0)                       # PR_SET_CHILD_SUBREAPER
zombie = os.fork()
if zombie == 0:
    os._exit(7)
killed = os.fork()
if killed == 0:
    while True: time.sleep(1)
os.kill(killed, signal.SIGTERM)
stopped = os.fork()
if stopped == 0:
    os.kill(os.getpid(), signal.SIGSTOP)
    while True: time.sleep(1)
child = os.fork()
if child == 0:
    libc.prctl(1, signal.SIGUSR1, 0, 0, 0)       # PR_SET_PDEATHSIG
    import threading                             # a member with a second thread
    threading.Thread(target=lambda: [time.sleep(0.01) for _ in iter(int, 1)], daemon=True).start()
    signal.signal(signal.SIGUSR2, lambda *a: report("child", f"{prctl_int(2)} {os.getppid()}"))
    while True: time.sleep(0.05)
def on_usr2(*a):
    got = [os.waitpid(z, os.WNOHANG) for z in (zombie, killed)]
    report("parent", f"{prctl_int(37)} {got[0][1]} {got[1][1]}")
signal.signal(signal.SIGUSR2, on_usr2)
while os.waitid(os.P_PID, killed, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
    time.sleep(0.01)
print("KIDS", zombie, killed, stopped, child, flush=True)
print("READY", os.getpid(), flush=True)
while True: time.sleep(0.05)
'''


def test_zombies_stopped_children_subreaper_and_pdeath_survive(spawn, ptckpt, tmp_path):
    script = tmp_path / "family.py"
    script.write_text(FAMILY)
    parent = spawn(str(script))
    zombie, killed, stopped, child = (int(x) for x in next(
        line for line in parent.preamble if line.startswith("KIDS")).split()[1:])
    wait_until(lambda: _stat(stopped)["state"] == "T", 5)
    members = [parent.pid, zombie, killed, stopped, child]
    try:
        wait_until(lambda: len(os.listdir(f"/proc/{child}/task")) == 2, 5)
        tids = sorted(os.listdir(f"/proc/{child}/task"))
        res = ptckpt("dump", parent.pid, "-D", tmp_path / "img", "--kill")
        assert res.returncode == 0, res.stderr
        assert "3 processes" in res.stderr and "not dumped" not in res.stderr     # the summary line
        with ImageReader(tmp_path / "img") as image:
            assert {(z.pid, z.wait_status) for z in image.zombies} == {(zombie, 7 << 8),
                                                                        (killed, signal.SIGTERM)}
            assert image.process(parent.pid).task.child_subreaper
            assert image.process(child).task.pdeath_signal == signal.SIGUSR1
        parent.wait_exit(10)
        for p in members:
            wait_until(lambda: not os.path.exists(f"/proc/{p}"), 5, message=f"{p} gone")
        _restore(ptckpt, tmp_path / "img")
        assert _stat(zombie)["state"] == "Z" and _stat(killed)["state"] == "Z"
        assert _stat(zombie)["ppid"] == parent.pid
        wait_until(lambda: _stat(stopped)["state"] == "T", 5, message="the stopped child stops again")
        os.kill(child, signal.SIGUSR2)
        os.kill(parent.pid, signal.SIGUSR2)
        report = lambda name: open(f"{parent.out_path}.{name}").read().split()
        wait_until(lambda: os.path.exists(f"{parent.out_path}.parent") and
                   os.path.exists(f"{parent.out_path}.child"), 5)
        subreaper, zstatus, kstatus = map(int, report("parent"))
        assert (subreaper, zstatus, kstatus) == (1, 7 << 8, signal.SIGTERM), "the parent reaps both as before"
        assert list(map(int, report("child"))) == [signal.SIGUSR1, parent.pid]
        assert not os.path.exists(f"/proc/{zombie}")
        assert sorted(os.listdir(f"/proc/{child}/task")) == tids, "the child's thread, same tid"
    finally:
        kill_pids(members)
        reap_orphans()


ORPHANS = r"""
import ctypes, os, signal, sys, time
libc = ctypes.CDLL(None)
libc.prctl(36, 1, 0, 0, 0)                       # PR_SET_CHILD_SUBREAPER
killed = os.fork()
if killed == 0:
    os.kill(os.getpid(), signal.SIGKILL)
r, w = os.pipe()
leader = os.fork()
if leader == 0:                                  # leads a group, leaves a child in it, exits
    os.setpgid(0, 0)
    if os.fork() == 0:
        os.read(r, 1)                            # until the leader has been reaped
        os._exit(5)
    os._exit(0)
os.waitpid(leader, 0)
os.write(w, b"x")
def stat(p):                                     # [] for a process that ended meanwhile
    try:
        return open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return []
while True:                                      # the orphan is ours now: wait for its exit
    got = [int(p) for p in os.listdir("/proc") if p.isdigit() and p != str(os.getpid())]
    orphans = [p for p in got if stat(p)[1:3] == [str(os.getpid()), str(leader)]]
    if orphans and stat(orphans[0])[:1] == ["Z"]:
        break
    time.sleep(0.01)
os.waitid(os.P_PID, killed, os.WEXITED | os.WNOWAIT)
def on_usr2(*a):
    st = [os.waitpid(p, 0)[1] for p in (killed, orphans[0])]
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(" ".join(map(str, st)))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
signal.signal(signal.SIGUSR2, on_usr2)
print("KIDS", killed, orphans[0], leader, flush=True)
print("READY", os.getpid(), flush=True)
while True: time.sleep(0.05)
"""


def test_zombies_killed_by_sigkill_or_left_in_a_group_whose_leader_is_gone(spawn, ptckpt, tmp_path):
    """A zombie of SIGKILL, and one whose process group's leader was reaped: the group
    is made again around it and its parent reaps both with their statuses."""
    script = tmp_path / "orphans.py"
    script.write_text(ORPHANS)
    parent = spawn(str(script))
    killed, orphan, leader = (int(x) for x in next(
        line for line in parent.preamble if line.startswith("KIDS")).split()[1:])
    members = [parent.pid, killed, orphan]
    try:
        assert ptckpt("dump", parent.pid, "-D", tmp_path / "img", "--kill").returncode == 0
        parent.wait_exit(10)
        for p in members:
            wait_until(lambda: not os.path.exists(f"/proc/{p}"), 5, message=f"{p} gone")
        _restore(ptckpt, tmp_path / "img")
        assert _stat(killed)["state"] == "Z" and _stat(orphan)["state"] == "Z"
        assert _stat(orphan)["pgid"] == leader, "the orphan is still in its dead leader's group"
        assert not os.path.exists(f"/proc/{leader}"), "the group's stand-in leader is gone"
        os.kill(parent.pid, signal.SIGUSR2)
        wait_until(lambda: os.path.exists(parent.out_path), 5)
        assert open(parent.out_path).read().split() == [str(signal.SIGKILL), str(5 << 8)]
    finally:
        kill_pids(members)
        reap_orphans()


SHARED_OFFSET = r'''
import os, sys, time
out = sys.argv[1]
fd = os.open(out + ".data", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
dup = os.dup(fd)                               # one description: parent's two fds, the child's
child = os.fork()
me = b"c" if child == 0 else b"p"
use = fd if child == 0 else dup
n = 0
print("READY", os.getpid(), flush=True) if child else None
while True:
    os.write(use, me)
    n += 1
    with open(f"{out}.{me.decode()}.tmp", "w") as f:
        f.write(f"{n}\n")
    os.replace(f"{out}.{me.decode()}.tmp", f"{out}.{me.decode()}")
    time.sleep(0.002)
'''


def test_fds_sharing_one_description_share_it_again_offset_included(spawn, ptckpt, tmp_path):
    """Parent (through a dup) and child write through one open file description: with the
    offset shared, no write lands on another and the file holds every byte written."""
    script = tmp_path / "shared.py"
    script.write_text(SHARED_OFFSET)
    parent = spawn(str(script))
    wait_until(lambda: os.path.exists(f"{parent.out_path}.c"), 5)
    members = _tree_of(parent.pid)
    data = f"{parent.out_path}.data"
    try:
        _dump_kill(ptckpt, parent, tmp_path / "img")
        with ImageReader(tmp_path / "img") as image:
            descs = {f.desc for p in members for f in image.process(p).fds if f.path == data}
            assert len(descs) == 1
        size_at_dump = os.path.getsize(data)
        _restore(ptckpt, tmp_path / "img")
        wait_until(lambda: os.path.getsize(data) > size_at_dump + 200, 10, message="both write on")
        for p in members:
            os.kill(p, signal.SIGSTOP)
        wait_until(lambda: all(_stat(p)["state"] == "T" for p in members), 5)
        counts = sum(int(open(f"{parent.out_path}.{w}").read()) for w in "pc")
        content = open(data, "rb").read()
        assert set(content) == {ord("p"), ord("c")}
        # each process's count is written after its byte: at most one byte each ahead
        assert counts <= len(content) <= counts + 2, (counts, len(content))
    finally:
        kill_pids(members)
        reap_orphans()


def _totals(target) -> tuple[int, int]:
    text = open(target.out_path).read()
    assert not text.startswith("FAIL"), text
    return tuple(map(int, text.split()))


def _objects(pid: int, addr: int) -> str:
    """The maps line's device and inode of the mapping at `addr`: which object it shows."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return " ".join(fields[3:5] + fields[5:6])
    raise AssertionError(f"{addr:#x} not mapped in {pid}")


def test_forking_server_counts_in_one_shared_object_again(spawn, ptckpt, tmp_path):
    """MAP_SHARED|MAP_ANONYMOUS and memfd mappings inherited across fork: after the round
    trip every worker maps the same object as the parent, and the totals go on."""
    server = spawn("forkserver")
    workers = [int(line.split()[2]) for line in server.preamble if line.startswith("WORKER")]
    shared, board = server.symbols["shared"], server.symbols["board"]
    members = [server.pid] + workers
    wait_until(lambda: _totals(server)[0] > 100, 5)
    try:
        _dump_kill(ptckpt, server, tmp_path / "img")
        for p in workers:
            wait_until(lambda: not os.path.exists(f"/proc/{p}"), 5)
        _restore(ptckpt, tmp_path / "img")
        for addr, name in ((shared, "/dev/zero"), (board, "/memfd:board")):
            objs = {_objects(p, addr) for p in members}
            assert len(objs) == 1 and name in objs.pop(), "one object, shared by all"
        at_restore = _totals(server)
        wait_until(lambda: all(t > a + 300 for t, a in zip(_totals(server), at_restore)), 10,
                   message="the parent sees the workers count on")
        server.assert_ok()
    finally:
        kill_pids(members)
        reap_orphans()


SYSV = r'''
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
out = sys.argv[1]
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
shmid = libc.shmget(IPC_PRIVATE, 8192, IPC_CREAT | 0o600)
semid = libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600)
class sembuf(ctypes.Structure):
    _fields_ = [("num", ctypes.c_ushort), ("op", ctypes.c_short), ("flg", ctypes.c_short)]
def sem(op):
    b = sembuf(0, op, 0)
    while libc.semop(semid, ctypes.byref(b), 1) != 0:
        assert ctypes.get_errno() == 4            # EINTR: a ptrace stop, retry
libc.semctl(semid, 0, 16, 1)                     # SETVAL 1: a mutex
base = libc.shmat(shmid, None, 0)
counter = ctypes.c_uint64.from_address(base)
per = (ctypes.c_uint64 * 2).from_address(base + 8)
msqid = libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600)
for mtype, text in ((1, b"first"), (2, b"second"), (1, b"third")):
    msg = ctypes.create_string_buffer(8 + len(text))
    ctypes.c_long.from_buffer(msg).value = mtype
    msg[8:8 + len(text)] = text
    assert libc.msgsnd(msqid, msg, len(text), 0) == 0
print("IDS", shmid, semid, msqid, flush=True)
child = os.fork()
me = 1 if child == 0 else 0
if child:
    print("READY", os.getpid(), flush=True)
written = 0
while True:
    sem(-1)
    value = counter.value                         # only the holder of the semaphore may be here
    time.sleep(0.0005)
    if counter.value != value:
        open(out, "w").write("FAIL two processes inside the critical section\n")
        os._exit(4)
    counter.value = value + 1
    per[me] += 1
    sem(1)
    if me == 0 and counter.value >= written + 50:
        written = counter.value
        with open(out + ".tmp", "w") as f:
            f.write(f"{counter.value} {per[0]} {per[1]}\n")
        os.replace(out + ".tmp", out)
    time.sleep(0.0005)
'''


@needs("ipcrm")
def test_sysv_segment_semaphore_and_queue_shared_by_two_processes(spawn, ptckpt, tmp_path):
    """A SysV segment holds a counter guarded by a SysV semaphore; two processes take turns.
    The objects are removed after the dump, so the restore must make them again, with the
    same ids, the segment's bytes, the semaphore's value and the queued messages."""
    target = spawn(str(_write(tmp_path, "sysv.py", SYSV)))
    shmid, semid, msqid = (int(x) for x in next(l for l in target.preamble if l.startswith("IDS")).split()[1:])
    members = _tree_of(target.pid)
    state = lambda: list(map(int, _text(target.out_path).split()))
    try:
        wait_until(lambda: os.path.exists(target.out_path) and state()[0] > 100, 10)
        _dump_kill(ptckpt, target, tmp_path / "img")
        with ImageReader(tmp_path / "img") as image:
            kinds = sorted(type(o).__name__ for o in image.sysv)
            assert kinds == ["MsgImage", "SemImage", "ShmImage"], kinds
        for p in members:
            wait_until(lambda: not os.path.exists(f"/proc/{p}"), 5)
        count, *_ = state()
        _ipcrm(shmid, semid, msqid)
        _restore(ptckpt, tmp_path / "img")
        assert f" {shmid} " in open("/proc/sysvipc/shm").read()
        [queue] = [line.split() for line in open("/proc/sysvipc/msg") if line.split()[1] == str(msqid)]
        assert queue[3:5] == [str(len(b"firstsecondthird")), "3"], queue     # cbytes, qnum
        wait_until(lambda: state()[0] > count + 200, 10, message="both go on counting")
        total, a, b = state()
        assert a > 0 and b > 0 and total >= a + b - 1
        target.assert_ok()
    finally:
        kill_pids(members)
        reap_orphans()
        _ipcrm(shmid, semid, msqid)


def _lines(path) -> list[str]:
    try:
        return open(path).read().splitlines()
    except FileNotFoundError:
        return []


def _write(directory, name, text):
    path = directory / name
    path.write_text(text)
    return path


def _text(path) -> str:
    text = open(path).read()
    assert not text.startswith("FAIL"), text
    return text


def _ipcrm(shmid: int, semid: int, msqid: int) -> None:
    for flag, ipc_id in (("-m", shmid), ("-s", semid), ("-q", msqid)):
        subprocess.run(["ipcrm", flag, str(ipc_id)], capture_output=True)


SOCKETS = r'''
import os, signal, socket, sys, time
out, where = sys.argv[1], sys.argv[2]
def log(text):
    with open(out, "a") as f:
        f.write(text + "\n")
TYPES = (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET)
pairs = {t: socket.socketpair(socket.AF_UNIX, t) for t in TYPES}
path = os.path.join(where, "server.sock")
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(4)
abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
abstract.bind(b"\0ptckpt-test-%d" % os.getpid())
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
client.connect(path)
served, _ = listener.accept()
child = os.fork()
if child == 0:
    for a, b in pairs.values():
        a.close()
    for s in (listener, served, abstract):
        s.close()
    for t, (a, b) in pairs.items():
        b.send(b"from child %d" % t)
    client.send(b"hello server")
    os.kill(os.getpid(), signal.SIGSTOP)        # until the test has restored us
    for t, (a, b) in pairs.items():
        got = [b.recv(100)] if t == socket.SOCK_STREAM else [b.recv(100) for _ in range(3)]
        log(f"child {t} {got!r}")
    log(f"child client {client.recv(100)!r} {client.getpeername()!r}")
    while True: time.sleep(0.05)
client.close()
for t, (a, b) in pairs.items():
    b.close()
    a.send(b"from parent %d" % t)
    if t != socket.SOCK_STREAM:
        a.send(b"")                             # a zero-length message keeps its place
        a.send(b"second %d" % t)
served.send(b"hello client")
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
    sender.sendto(b"to the abstract name", abstract.getsockname())
print("CHILD", child, flush=True)
print("READY", os.getpid(), flush=True)
while not os.path.exists(out + ".go"):
    time.sleep(0.02)
for t, (a, b) in pairs.items():
    log(f"parent {t} {a.recv(100)!r}")
log(f"parent served {served.recv(100)!r} {served.getsockname()!r}")
log(f"parent abstract {abstract.recv(100)!r}")
c2 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c2.connect(path)
s2, _ = listener.accept()
c2.send(b"new connection")
log(f"parent listener {s2.recv(100)!r}")
while True: time.sleep(0.05)
'''


def test_unix_sockets_keep_names_connections_and_queued_data(spawn, ptckpt, tmp_path):
    '''Socketpairs of the three types with data queued both ways (zero-length datagrams
    included), a listener bound to a path with an accepted connection, a datagram socket
    bound to an abstract name: after the round trip every message arrives once, in order.'''
    where = tmp_path / "sockets"
    where.mkdir()
    target = spawn(str(_write(tmp_path, "sockets.py", SOCKETS)), where)
    child = int(next(l for l in target.preamble if l.startswith("CHILD")).split()[1])
    wait_until(lambda: _stat(child)["state"] == "T", 5)
    try:
        _dump_kill(ptckpt, target, tmp_path / "img")
        with ImageReader(tmp_path / "img") as image:
            queued = sorted(m for u in image.unix_sockets for m in u.queue)
        assert queued == sorted([b"from child 1", b"from child 2", b"from child 5", b"from parent 1",
                                 b"from parent 2", b"", b"second 2", b"from parent 5", b"", b"second 5",
                                 b"hello server", b"hello client", b"to the abstract name"])
        wait_until(lambda: not os.path.exists(f"/proc/{child}"), 5)
        _restore(ptckpt, tmp_path / "img")
        open(f"{target.out_path}.go", "w").close()
        os.kill(child, signal.SIGCONT)
        wait_until(lambda: len(_lines(target.out_path)) == 10, 10,
                   message=lambda: "\n".join(_lines(target.out_path)))
        lines = set(_lines(target.out_path))
        path = str(where / "server.sock")
        assert lines == {
            "child 1 [b'from parent 1']",
            "child 2 [b'from parent 2', b'', b'second 2']",
            "child 5 [b'from parent 5', b'', b'second 5']",
            f"child client b'hello client' {path!r}",
            "parent 1 b'from child 1'",
            "parent 2 b'from child 2'",
            "parent 5 b'from child 5'",
            f"parent served b'hello server' {path!r}",
            "parent abstract b'to the abstract name'",
            "parent listener b'new connection'",
        }, lines
    finally:
        kill_pids([target.pid, child])
        reap_orphans()


def test_socket_connected_outside_the_tree_is_refused_naming_both_ends(spawn, ptckpt, tmp_path):
    path = tmp_path / "outside.sock"
    server = spawn(str(_write(tmp_path, "server.py",
                              "import os, socket, time\n"
                              f"l = socket.socket(socket.AF_UNIX); l.bind({str(path)!r}); l.listen(1)\n"
                              "print('READY', os.getpid(), flush=True)\n"
                              "s, _ = l.accept()\n"
                              "while True: time.sleep(1)\n")), out=False)
    client = spawn(str(_write(tmp_path, "client.py",
                              "import os, socket, time\n"
                              f"c = socket.socket(socket.AF_UNIX); c.connect({str(path)!r})\n"
                              "print('READY', os.getpid(), flush=True)\n"
                              "while True: time.sleep(1)\n")), out=False)
    wait_until(lambda: len([f for f in os.listdir(f"/proc/{server.pid}/fd")
                            if os.readlink(f"/proc/{server.pid}/fd/{f}").startswith("socket:")]) == 2, 5)
    res = ptckpt("dump", client.pid, "-D", tmp_path / "img")
    _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, f"process {client.pid} fd", "socket:[",
              "outside the tree", f"held by pid {server.pid} fd")
    assert not (tmp_path / "img").exists()
    with open(f"/proc/{client.pid}/status") as f:
        assert "TracerPid:\t0" in f.read()


POSIX_SHM = r'''
import mmap, os, sys, time
from multiprocessing import shared_memory
out = sys.argv[1]
shm = shared_memory.SharedMemory(create=True, size=4096)
print("SHM", shm.name, flush=True)
child = os.fork()
if child == 0:
    n = 0
    while True:
        n += 1
        shm.buf[0:8] = n.to_bytes(8, "little")
        time.sleep(0.002)
print("READY", os.getpid(), flush=True)
while True:
    with open(out + ".tmp", "w") as f:
        f.write(f"{int.from_bytes(shm.buf[0:8], 'little')}\n")
    os.replace(out + ".tmp", out)
    time.sleep(0.01)
'''


def test_posix_shm_under_dev_shm_is_shared_again(spawn, ptckpt, tmp_path):
    target = spawn(str(_write(tmp_path, "pshm.py", POSIX_SHM)))
    name = next(l for l in target.preamble if l.startswith("SHM")).split()[1]
    members = _tree_of(target.pid)
    seen = lambda: int(_text(target.out_path) or 0)
    try:
        wait_until(lambda: os.path.exists(target.out_path) and seen() > 20, 5)
        _dump_kill(ptckpt, target, tmp_path / "img")
        for p in members:
            wait_until(lambda: not os.path.exists(f"/proc/{p}"), 5)
        at_dump = seen()
        _restore(ptckpt, tmp_path / "img")
        wait_until(lambda: seen() > at_dump + 100, 10, message="the parent sees the child count on")
    finally:
        kill_pids(members)
        reap_orphans()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


def test_a_socket_path_still_bound_by_the_original_is_refused_at_restore(spawn, ptckpt, tmp_path):
    """dump --leave-running, then restore while the original still listens: the restore must
    not steal its path; it fails naming the path, and kills what it built."""
    path = tmp_path / "live.sock"
    target = spawn(str(_write(tmp_path, "live.py",
                              "import os, socket, time\n"
                              f"l = socket.socket(socket.AF_UNIX); l.bind({str(path)!r}); l.listen(1)\n"
                              "print('READY', os.getpid(), flush=True)\n"
                              "while True: time.sleep(1)\n")), out=False)
    assert ptckpt("dump", target.pid, "-D", tmp_path / "img").returncode == 0
    res = ptckpt("restore", "-D", tmp_path / "img", "--pidns", "--detach")
    _one_line(res, ExitCode.REMOTE_SYSCALL, str(path), "bound by a live socket")
    with socket.socket(socket.AF_UNIX) as c:
        c.connect(str(path))                        # the original still owns its path


FIFO = r'''
import os, sys, time
out = sys.argv[1]
fifo = out + ".fifo"
os.mkfifo(fifo)
r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
child = os.fork()
if child == 0:
    w = os.open(fifo, os.O_WRONLY)
    for i in range(1, 101):
        os.write(w, b"%d\n" % i)
    while True: time.sleep(0.05)
print("READY", os.getpid(), flush=True)
while not os.path.exists(out + ".go"):
    time.sleep(0.02)
data = b""
while True:
    try:
        chunk = os.read(r, 65536)
    except BlockingIOError:
        break
    data += chunk
with open(out + ".got", "w") as f:
    f.write(data.decode())
while True: time.sleep(0.05)
'''


def test_fifo_between_members_keeps_its_bytes(spawn, ptckpt, tmp_path):
    target = spawn(str(_write(tmp_path, "fifo.py", FIFO)))
    members = _tree_of(target.pid)
    fifo = f"{target.out_path}.fifo"
    try:
        wait_until(lambda: len(members) == 2 and any(
            os.readlink(f"/proc/{members[1]}/fd/{n}") == fifo for n in os.listdir(f"/proc/{members[1]}/fd")), 5)
        time.sleep(0.2)                                  # the child has written its 100 lines
        _dump_kill(ptckpt, target, tmp_path / "img")
        with ImageReader(tmp_path / "img") as image:
            [buf] = image.pipes
            assert buf.path == fifo and buf.data == b"".join(b"%d\n" % i for i in range(1, 101))
        for p in members:
            wait_until(lambda: not os.path.exists(f"/proc/{p}"), 5)
        _restore(ptckpt, tmp_path / "img")
        open(f"{target.out_path}.go", "w").close()
        wait_until(lambda: os.path.exists(f"{target.out_path}.got"), 5)
        assert open(f"{target.out_path}.got").read().split() == [str(i) for i in range(1, 101)]
    finally:
        kill_pids(members)
        reap_orphans()

"""`ptckpt show` backend on a small synthetic image (pure: no processes)."""

from __future__ import annotations

import dataclasses
import json
import re
import zlib

import pytest

from ptckpt.errors import CorruptImage, NotAnImage
from ptckpt.formats.records import FORMAT_VERSION
from ptckpt.formats.image import ImageReader, ImageWriter
from ptckpt.formats.model import (
    GP_REG_NAMES,
    PAGE_SIZE,
    Creds,
    Fd,
    FdKind,
    Inventory,
    Mm,
    PendingSignal,
    ProcessImage,
    Restart,
    Rlimit,
    Sigaction,
    Task,
    Thread,
    Vma,
    VmaKind,
)
from ptckpt.show import image_summary, image_to_json
from conftest import needs_network_lock

PID = 4242
HEAP = 0x55550000
STACK = 0x7ffd0000


def _regs(rip: int, rsp: int) -> tuple[int, ...]:
    regs = dict.fromkeys(GP_REG_NAMES, 0) | {"rip": rip, "rsp": rsp, "orig_rax": 2**64 - 1}
    return tuple(regs[n] for n in GP_REG_NAMES)


def _thread(tid: int, restart: Restart, nr: int) -> Thread:
    return Thread(tid=tid, regs=_regs(0x401000 + tid, STACK + 0xf00), xstate=b"\x01" * 576, xfeatures=3,
                  sigmask=0, rseq_addr=0, rseq_len=0, rseq_sig=0, rseq_flags=0, robust_list=0,
                  robust_list_len=0, clear_child_tid=0, sas_sp=0, sas_flags=2, sas_size=0,
                  restart=restart, syscall_nr=nr, comm="worker")


def _vma(start: int, npages: int, prot: int, kind, path: str, shared=False) -> Vma:
    return Vma(start=start, end=start + npages * PAGE_SIZE, prot=prot, shared=shared, kind=kind, pgoff=0,
               dev_major=0, dev_minor=0, inode=0, path=path, vmflags="rd wr mr mw me ac")


def _fd(fd: int, kind, path: str, flags: int, pos: int) -> Fd:
    return Fd(fd=fd, kind=kind, path=path, flags=flags, pos=pos, cloexec=False, mnt_id=1, dev=0, ino=fd,
              mode=0o100644, rdev=0, size=0, mtime_ns=0)


PROC = ProcessImage(
    task=Task(pid=PID, ppid=1, pgid=PID, sid=PID, comm="demo", state="S", exe="/usr/bin/demo", cwd="/srv",
              root="/", umask=0o22, personality=0, nice=0, sched_policy=0, rt_priority=0, oom_score_adj=0,
              timerslack_ns=50000, exit_signal=17, tids=(PID, PID + 1), cmdline=("demo", "-v")),
    creds=Creds(uids=(0, 0, 0, 0), gids=(0, 0, 0, 0), groups=(), cap_inh=0, cap_prm=0, cap_eff=0, cap_bnd=0,
                cap_amb=0, no_new_privs=0, seccomp=0),
    mm=Mm(start_code=0x400000, end_code=0x401000, start_data=0, end_data=0, start_brk=HEAP, brk=HEAP + 0x3000,
          start_stack=STACK + 0xff0, arg_start=0, arg_end=0, env_start=0, env_end=0, exe_file="/usr/bin/demo",
          auxv=((6, 4096),)),
    rlimits=(Rlimit(7, 1024, 1024),),
    vmas=(_vma(HEAP, 3, 3, VmaKind.HEAP, "[heap]"),
          _vma(0x7f0000000000, 256, 5, VmaKind.FILE_PRIVATE, b"/lib/libx\xff.so".decode("utf-8", "surrogateescape")),
          _vma(STACK, 2, 3, VmaKind.STACK, "[stack]"),
          _vma(0x7f1000000000, 1, 3, VmaKind.ANON_SHARED, "/dev/zero (deleted)", shared=True)),
    threads=(_thread(PID, Restart.NONE, -1), _thread(PID + 1, Restart.REEXECUTE, 202)),
    sigactions=(Sigaction(15, 0x401500, 0x04000000, 0x401600, 0),),
    pending=(PendingSignal(0, bytes([15]) + bytes(127)),),
    fds=(_fd(0, FdKind.TTY, "/dev/console", 0o2, 0), _fd(3, FdKind.REGULAR, "/srv/data.log", 0o102001, 123456),
         _fd(10, FdKind.PIPE, "pipe:[991]", 0o0, 0)),
)

HEAP_PAGES = b"H" * (2 * PAGE_SIZE)          # 2 of the 3 heap pages
STACK_PAGES = b"S" * (2 * PAGE_SIZE)


INVENTORY = Inventory(
    ptckpt_version="0.1.0", kernel_release="6.8.0", arch="x86_64", page_size=PAGE_SIZE, xfeatures=3,
    xstate_size=576, root_pid=PID, pids=(PID,), realtime_ns=1_700_000_000 * 10**9, monotonic_ns=1,
    boottime_ns=2, hostname="box")


@pytest.fixture
def image_dir(tmp_path):
    target = tmp_path / "img"
    with ImageWriter(target) as image:
        image.write_inventory(INVENTORY)
        image.write_process(PROC)
        with image.pages_writer(PID) as pages:
            pages.add_run(HEAP, 2, pages.write(HEAP_PAGES))
            pages.add_run(STACK, 2, pages.write(STACK_PAGES))
    return target


def test_json_holds_every_record(image_dir):
    data = image_to_json(image_dir)
    json.loads(json.dumps(data))                       # JSON-able as is
    assert data["format_version"] == FORMAT_VERSION
    assert data["zombies"] == data["pipes"] == data["unix_sockets"] == []
    assert data["inventory"]["pids"] == [PID] and data["inventory"]["hostname"] == "box"
    [proc] = data["processes"]
    assert proc["pid"] == PID
    assert proc["task"]["tids"] == [PID, PID + 1] and proc["task"]["cmdline"] == ["demo", "-v"]
    assert proc["mm"]["auxv"] == [[6, 4096]]
    assert [v["kind"] for v in proc["vmas"]] == ["HEAP", "FILE_PRIVATE", "STACK", "ANON_SHARED"]
    assert proc["vmas"][3]["shared"] is True
    t0, t1 = proc["threads"]
    assert t0["restart"] == "NONE" and t1["restart"] == "REEXECUTE" and t1["syscall_nr"] == 202
    assert t1["regs"]["rip"] == 0x401000 + PID + 1 and t1["regs"]["orig_rax"] == 2**64 - 1
    assert t0["xstate"] == {"size": 576, "crc32": zlib.crc32(b"\x01" * 576)}
    assert proc["pending_signals"][0]["siginfo"] == "0f" + "00" * 127
    assert [f["kind"] for f in proc["fds"]] == ["TTY", "REGULAR", "PIPE"]
    assert proc["sigactions"][0]["handler"] == 0x401500 and proc["rlimits"][0]["resource"] == 7
    assert proc["unknown_entries"] == []
    pages = proc["pages"]
    assert pages["run_count"] == 2 and pages["total_pages"] == 4 and pages["total_bytes"] == 4 * PAGE_SIZE
    assert pages["crc32"] == zlib.crc32(HEAP_PAGES + STACK_PAGES)
    assert pages["runs"] == [{"vaddr": HEAP, "npages": 2, "offset": 0},
                             {"vaddr": STACK, "npages": 2, "offset": 2 * PAGE_SIZE}]


def test_json_keeps_undecodable_path_bytes(image_dir):
    text = json.dumps(image_to_json(image_dir))
    path = json.loads(text)["processes"][0]["vmas"][1]["path"]
    assert path.encode("utf-8", "surrogateescape") == b"/lib/libx\xff.so"


def _table_after(text: str, title: str) -> list[str]:
    lines = text.split("\n\n")
    [block] = [b for b in lines if b.startswith(title)]
    return block.splitlines()[1:]


def test_summary_tables(image_dir):
    text = image_summary(image_dir)
    assert "ptckpt 0.1.0" in text and "root pid 4242" in text and "2023-11-14T22:13:20+00:00" in text

    tasks = _table_after(text, "tasks:")
    assert tasks[0].split() == ["PID", "PPID", "COMM", "THREADS", "EXE"]
    assert tasks[1].split() == ["4242", "1", "demo", "2", "/usr/bin/demo"]

    threads = _table_after(text, f"threads of {PID}:")
    assert threads[0].split() == ["TID", "RIP", "RSP", "RESTART", "SYSCALL", "COMM"]
    assert threads[1].split() == [str(PID), hex(0x401000 + PID), hex(STACK + 0xf00), "NONE", "-", "worker"]
    assert threads[2].split()[3:5] == ["REEXECUTE", "202"]

    vmas = _table_after(text, f"memory of {PID}")
    assert vmas[0].split() == ["START-END", "PROT", "KIND", "PAGES", "PATH"]
    rows = [line.split(None, 4) for line in vmas[1:]]
    assert [r[1:4] for r in rows] == [["rw-p", "HEAP", "2"], ["r-xp", "FILE_PRIVATE", "0"],
                                      ["rw-p", "STACK", "2"], ["rw-s", "ANON_SHARED", "0"]]
    assert rows[1][4] == r"/lib/libx\xff.so"
    assert rows[0][0] == f"{HEAP:012x}-{HEAP + 3 * PAGE_SIZE:012x}"

    fds = _table_after(text, f"files of {PID}:")
    assert fds[0].split() == ["FD", "KIND", "FLAGS", "POS", "PATH"]
    assert fds[2].split() == ["3", "REGULAR", "0102001", "123456", "/srv/data.log"]


def _check_aligned(header: str, rows: list[str], right: set[int]) -> None:
    """Left-aligned cells start under their header word, right-aligned ones end under it."""
    words = [(m_start, word) for m_start, word in _words(header)]
    for row in rows:
        for col, (start, word) in enumerate(words):
            end = start + len(word)
            if col in right:
                assert row[end - 1] != " " and row[end:end + 1] in ("", " "), (header, row, word)
            else:
                assert row[start] != " " and (start == 0 or row[start - 1] == " "), (header, row, word)


def _words(line: str) -> list[tuple[int, str]]:
    out, i = [], 0
    for word in line.split():
        i = line.index(word, i)
        out.append((i, word))
        i += len(word)
    return out


def test_summary_columns_are_aligned(image_dir):
    text = image_summary(image_dir)
    for title, right in (("tasks:", {0, 1, 3}), (f"threads of {PID}:", {0, 4}),
                         (f"memory of {PID}", {3}), (f"files of {PID}:", {0, 2, 3})):
        header, *rows = _table_after(text, title)
        _check_aligned(header, rows, right)


def test_show_reports_image_errors(tmp_path, image_dir):
    with pytest.raises(NotAnImage):
        image_to_json(tmp_path / "nothing")
    core = image_dir / f"core-{PID}.img"
    raw = bytearray(core.read_bytes())
    raw[-1] ^= 1
    core.write_bytes(bytes(raw))
    with pytest.raises(CorruptImage, match="checksum mismatch"):
        image_summary(image_dir)


def test_summary_lists_what_the_tree_shares(tmp_path):
    from ptckpt.formats.model import PipeBuffer, UnixSocket, Zombie
    target = tmp_path / "img"
    with ImageWriter(target) as image:
        image.write_inventory(INVENTORY, [
                Zombie(pid=PID + 5, ppid=PID, pgid=PID, sid=1, wait_status=7 << 8),
                PipeBuffer(ino=99, capacity=65536, data=b"abc"),
                UnixSocket(ino=77, type=1, state=10, name=b"\0srv", peer=0, peer_name=b"", backlog=4,
                           shutdown=0, queue=())])
        image.write_process(PROC)
        with image.pages_writer(PID) as pages:
            pages.add_run(HEAP, 2, pages.write(HEAP_PAGES))
    text = image_summary(target)
    rows = _table_after(text, "shared by the tree:")
    assert rows[0].split() == ["KIND", "ID", "WHAT"]
    assert rows[1].split()[:2] == ["zombie", str(PID + 5)] and "0x700" in rows[1]
    assert rows[2].split()[:2] == ["pipe", "99"] and "3 bytes buffered" in rows[2]
    assert len(rows) == 3, "sockets have their own table"
    [listener] = _table_after(text, "sockets:")[1:]
    assert listener.split() == ["-", "unix", "stream", "@srv", "-", "LISTEN", "(backlog", "4)", "0", "-"]
    data = image_to_json(target)
    assert data["zombies"][0]["wait_status"] == 7 << 8 and data["pipes"][0]["data"] == "616263"


# --- sockets -------------------------------------------------------------------------------

def _sock_fd(fd: int, ino: int, details: dict, external: str = "") -> Fd:
    return Fd(fd=fd, kind=FdKind.SOCKET, path=f"socket:[{ino}]", flags=0o2, pos=0, cloexec=False, mnt_id=1,
              dev=8, ino=ino, mode=0o140777, rdev=0, size=0, mtime_ns=0, details=tuple(details.items()),
              desc=fd, external=external)


def _socket_image(tmp_path):
    """Every kind of socket record, held by PROC's fds 3-12 (one in an accept queue: no fd)."""
    from ptckpt.formats.model import InetMode, InetSocket, NetlinkSocket, UnixSocket
    records = [
        InetSocket(ino=103, family=2, type=1, protocol=6, state=10, src="0.0.0.0", sport=8080, backlog=16),
        InetSocket(ino=104, family=10, type=2, protocol=17, state=7, src="::1", sport=5353,
                   datagrams=(("::1", 40000, b"abc"), ("::1", 40001, b"defgh"))),
        InetSocket(ino=105, family=2, type=1, protocol=6, state=8, mode=InetMode.REPAIRED, src="127.0.0.1",
                   sport=8080, dst="127.0.0.1", dport=50000, shutdown=1, rcv_seq=7, snd_seq=9,
                   recv_queue=b"r" * 100, send_queue=b"s" * 30, unsent=12),
        InetSocket(ino=106, family=2, type=1, protocol=6, state=7, mode=InetMode.CLOSED, src="127.0.0.1",
                   sport=50001, dst="10.1.1.1", dport=443),
        InetSocket(ino=(1 << 62) + 1, family=2, type=1, protocol=6, state=1, mode=InetMode.PENDING,
                   src="127.0.0.1", sport=8080, dst="127.0.0.1", dport=50002, recv_queue=b"hello", listener=103),
        NetlinkSocket(ino=108, type=3, protocol=0, portid=PID, groups=0x11),
        UnixSocket(ino=109, type=1, state=1, name=b"", peer=110, peer_name=b"", backlog=0, shutdown=0,
                   queue=(b"x" * 7,)),
        UnixSocket(ino=110, type=1, state=1, name=b"", peer=109, peer_name=b"", backlog=0, shutdown=2, queue=()),
        UnixSocket(ino=111, type=2, state=7, name=b"/run/log.sock", peer=0, peer_name=b"", backlog=0,
                   shutdown=0, queue=(b"m1", b"m22")),
    ]
    inet4 = {"family": "AF_INET", "type": "SOCK_STREAM", "protocol": "6"}
    fds = (_sock_fd(3, 103, inet4), _sock_fd(4, 104, {"family": "AF_INET6", "type": "SOCK_DGRAM"}),
           _sock_fd(5, 105, inet4), _sock_fd(6, 106, inet4),
           _sock_fd(8, 108, {"family": "AF_NETLINK"}), _sock_fd(9, 109, {"family": "AF_UNIX"}),
           _sock_fd(10, 110, {"family": "AF_UNIX"}), _sock_fd(11, 111, {"family": "AF_UNIX"}),
           _sock_fd(12, 112, inet4 | {"local": "('10.0.0.2', 41000)", "peer": "('10.0.0.1', 80)"},
                    external="tcp:10.0.0.1:80"),
           _sock_fd(13, 109, {"family": "AF_UNIX"}))
    target = tmp_path / "img"
    with ImageWriter(target) as image:
        image.write_inventory(dataclasses.replace(INVENTORY, netlock="c0ffee123456"), records)
        image.write_process(dataclasses.replace(PROC, fds=tuple(f for f in PROC.fds if f.fd not in {s.fd for s in fds})
                                                + fds))
        with image.pages_writer(PID) as pages:
            pages.add_run(HEAP, 2, pages.write(HEAP_PAGES))
    return target


def test_json_lists_every_socket_with_queues_summarised(tmp_path):
    data = image_to_json(_socket_image(tmp_path))
    json.loads(json.dumps(data))
    listener, udp, repaired, closed, pending = data["inet_sockets"]
    assert listener["holders"] == [[PID, 3]] and listener["backlog"] == 16 and listener["state_name"] == "LISTEN"
    assert [d for d in udp["datagrams"]] == [
        {"sender": "::1", "port": 40000, "size": 3, "crc32": zlib.crc32(b"abc")},
        {"sender": "::1", "port": 40001, "size": 5, "crc32": zlib.crc32(b"defgh")}]
    assert "state_name" not in udp
    assert repaired["mode"] == "REPAIRED" and repaired["state_name"] == "CLOSE_WAIT"
    assert repaired["recv_queue"] == {"size": 100, "crc32": zlib.crc32(b"r" * 100)}
    assert repaired["send_queue"] == {"size": 30, "crc32": zlib.crc32(b"s" * 30)} and repaired["unsent"] == 12
    assert closed["mode"] == "CLOSED"
    assert pending["mode"] == "PENDING" and pending["holders"] == [] and pending["listener"] == 103
    [nl] = data["netlink_sockets"]
    assert nl["portid"] == PID and nl["groups"] == 0x11 and nl["holders"] == [[PID, 8]]
    pair = data["unix_sockets"][0]
    assert pair["holders"] == [[PID, 9], [PID, 13]] and pair["peer"] == 110
    assert data["inventory"]["netlock"] == "c0ffee123456"
    assert "rrrr" not in json.dumps(data) and "7272" not in json.dumps(data["inet_sockets"])


def test_summary_sockets_table_one_line_per_socket(tmp_path):
    text = image_summary(_socket_image(tmp_path))
    heading = "sockets (network lock c0ffee123456 holds the repaired connections until a restore releases it):"
    header, *rows = _table_after(text, heading)
    assert header.split() == ["PID:FD", "FAMILY", "TYPE", "LOCAL", "PEER", "STATE", "RECV-Q", "SEND-Q"]
    _check_aligned(header, rows, set())
    cells = [re.split(r"\s{2,}", r) for r in rows]
    assert cells == [
        [f"{PID}:3", "IPv4", "TCP", "0.0.0.0:8080", "-", "LISTEN (backlog 16)", "-", "-"],
        ["-", "IPv4", "TCP", "127.0.0.1:8080", "127.0.0.1:50002", f"ESTABLISHED, queued on {PID}:3", "5", "0"],
        [f"{PID}:4", "IPv6", "UDP", "[::1]:5353", "-", "bound", "8 (2 dgrams)", "-"],
        [f"{PID}:5", "IPv4", "TCP", "127.0.0.1:8080", "127.0.0.1:50000", "CLOSE_WAIT, repaired, shut rd",
         "100", "30 (12 unsent)"],
        [f"{PID}:6", "IPv4", "TCP", "127.0.0.1:50001", "10.1.1.1:443", "closed (comes back reset)", "-", "-"],
        [f"{PID}:8", "netlink", "raw", f"NETLINK_ROUTE port {PID}", "-", "bound, groups 0x11", "-", "-"],
        [f"{PID}:9,{PID}:13", "unix", "stream", "-", "socket:[110]", "ESTABLISHED", "7", "-"],
        [f"{PID}:10", "unix", "stream", "-", "socket:[109]", "ESTABLISHED, shut wr", "0", "-"],
        [f"{PID}:11", "unix", "dgram", "/run/log.sock", "-", "unconnected", "5 (2 msgs)", "-"],
        [f"{PID}:12", "IPv4", "TCP", "10.0.0.2:41000", "10.0.0.1:80", "external: tcp:10.0.0.1:80", "-", "-"],
    ]


@needs_network_lock()
def test_show_lists_the_sockets_of_a_real_dump(spawn, ptckpt, tmp_path):
    """A tree holding a listener with a connection not accepted yet, a UDP socket with a datagram
    queued, a unix socketpair with bytes queued and an established loopback connection, dumped
    --tcp-established --kill."""
    from ptckpt import netlock
    from conftest import idle_script, reap_orphans
    script = idle_script(tmp_path, "socks.py", SOCKS)
    target = spawn(str(script), out=False)
    fd = dict(line.split()[1:] for line in target.preamble if line.startswith("FD "))
    fd = {name: int(n) for name, n in fd.items()}
    port = int(next(l for l in target.preamble if l.startswith("PORT")).split()[1])
    image = tmp_path / "img"
    res = ptckpt("dump", target.pid, "-D", image, "--tcp-established", "--kill")
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    reap_orphans()
    try:
        shown = ptckpt("show", image)
        assert shown.returncode == 0, shown.stderr
        data = json.loads(shown.stdout)
        inet_by_fd = {tuple(s["holders"][0])[1]: s for s in data["inet_sockets"] if s["holders"]}
        assert inet_by_fd[fd["listener"]]["state_name"] == "LISTEN" and inet_by_fd[fd["listener"]]["backlog"] == 7
        udp = inet_by_fd[fd["udp"]]
        assert [(d["sender"], d["port"], d["size"]) for d in udp["datagrams"]] == [("127.0.0.1", fd["sender_port"], 9)]
        client, server = inet_by_fd[fd["client"]], inet_by_fd[fd["server"]]
        assert client["mode"] == server["mode"] == "REPAIRED"
        assert client["recv_queue"] == {"size": 9, "crc32": zlib.crc32(b"to client")}
        assert server["recv_queue"] == {"size": 13, "crc32": zlib.crc32(b"to server 123")}
        [pending] = [s for s in data["inet_sockets"] if s["mode"] == "PENDING"]
        assert pending["recv_queue"]["size"] == 5 and pending["holders"] == []
        [nl] = data["netlink_sockets"]
        assert nl["holders"] == [[target.pid, fd["netlink"]]]
        unix = {s["holders"][0][1]: s for s in data["unix_sockets"]}
        assert unix[fd["unix_b"]]["queue"] == [b"unix bytes".hex()]
        lock = data["inventory"]["netlock"]
        assert lock

        summary = ptckpt("show", image, "--summary")
        assert summary.returncode == 0, summary.stderr
        header, *rows = _table_after(summary.stdout, f"sockets (network lock {lock} holds")
        cells = {r.split()[0]: re.split(r"\s{2,}", r) for r in rows}
        at = lambda name: cells[f"{target.pid}:{fd[name]}"]
        assert at("listener")[1:6] == ["IPv4", "TCP", f"127.0.0.1:{port}", "-", "LISTEN (backlog 7)"]
        assert at("udp")[2] == "UDP" and at("udp")[6] == "9 (1 dgram)"
        assert at("client")[4:] == [f"127.0.0.1:{port}", "ESTABLISHED, repaired", "9", "0"]
        assert at("server")[5:] == ["ESTABLISHED, repaired", "13", "0"]
        assert at("unix_b")[1:3] == ["unix", "stream"] and at("unix_b")[6] == "10"
        assert at("netlink")[1:3] == ["netlink", "raw"]
        [queued] = [r for r in cells.values() if r[0] == "-"]
        assert queued[5] == f"ESTABLISHED, queued on {target.pid}:{fd['listener']}" and queued[6] == "5"
        assert rows.index(next(r for r in rows if r.startswith("-"))) == \
            rows.index(next(r for r in rows if r.startswith(f"{target.pid}:{fd['listener']} "))) + 1, \
            "a connection in the accept queue comes right under its listener"
    finally:
        with ImageReader(image) as reader:            # the lock a --kill dump leaves for its restore
            if reader.inventory.netlock:
                netlock.unlock(reader.inventory.netlock)


SOCKS = """
import os, socket, time
lst = socket.create_server(("127.0.0.1", 0), backlog=7)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("127.0.0.1", 0))
snd = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); snd.bind(("127.0.0.1", 0))
snd.sendto(b"hello udp", udp.getsockname())
a, b = socket.socketpair()
a.send(b"unix bytes")
c = socket.create_connection(lst.getsockname())
s, _ = lst.accept()
c.send(b"to server 123")
s.send(b"to client")
waiting = socket.create_connection(lst.getsockname())
waiting.send(b"queue")
nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0); nl.bind((0, 0))
for name, sock in (("listener", lst), ("udp", udp), ("unix_b", b), ("client", c), ("server", s),
                   ("netlink", nl)):
    print("FD", name, sock.fileno(), flush=True)
print("FD sender_port", snd.getsockname()[1], flush=True)
print("PORT", lst.getsockname()[1], flush=True)
time.sleep(0.2)
"""

"""The emulator scenario: fixtures/emulator/emulator.py and testbench.c.

Real processes only, no ptrace: the emulator server and its line protocol,
SAVE_STATE/LOAD_STATE between two emulators, and the testbench run to
completion - deterministic when uninterrupted, different when the emulator's
state or the testbench's design_state was tampered with, unharmed by
SIGSTOP/SIGCONT; --per-connection (a fresh state per concurrent client) and
the testbench's `width` key.  Protocol and interfaces: fixtures/emulator/README.md.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import (EXIT_BADVALUE, EXIT_SYSCALL, EXIT_USAGE, FIXTURES_DIR, fixture_build,
                      proc_stat, process_table, wait_until)

EMU_DIR = FIXTURES_DIR / "emulator"
EMULATOR = EMU_DIR / "emulator.py"
TESTBENCH_SRC = EMU_DIR / "testbench.c"
SOCKET_FD = 100

# A run of about 0.25 s (defaults: 40 x 25 ms + 200 x 10 ms, about 3 s).
FAST = "init_steps 40\ninit_sleep_us 1000\nvectors 200\nvector_sleep_us 1000\n"


@pytest.fixture(scope="module")
def testbench_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = fixture_build.find_cc()
    if cc is None:
        pytest.skip("gcc is not installed: testbench.c cannot be compiled")
    exe = tmp_path_factory.mktemp("emulator-bin") / "testbench"
    argv = [cc, *fixture_build.BASE_CFLAGS, "-Wextra", "-I", str(FIXTURES_DIR),
            "-o", str(exe), str(TESTBENCH_SRC)]
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        pytest.fail(f"cannot compile testbench.c: {' '.join(argv)}\n{proc.stdout}{proc.stderr}",
                    pytrace=False)
    assert not proc.stderr.strip(), f"testbench.c compiles with warnings:\n{proc.stderr}"
    return exe


# --- helpers ----------------------------------------------------------------------

class Emulator:
    """A running emulator.py (a spawn Target) and the address it listens on."""

    def __init__(self, target, address: str):
        self.target = target
        self.address = address          # the testbench's ADDRESS argument

    def client(self) -> "Client":
        return Client(self.address)


def start_emulator(spawn, where: str = "tcp", path: Path | None = None,
                   options: tuple[str, ...] = ()) -> Emulator:
    """options: more emulator arguments, e.g. ("--per-connection",)."""
    if where == "tcp":
        target = spawn(str(EMULATOR), "--tcp", "127.0.0.1:0", *options, out=False)
    else:
        target = spawn(str(EMULATOR), "--unix", path, *options, out=False)
    assert len(target.preamble) == 1, target.describe()
    m = re.fullmatch(r"LISTENING (tcp) (\S+) (\d+)|LISTENING (unix) (\S+)", target.preamble[0])
    assert m, target.describe()
    if m.group(1):
        assert m.group(2) == "127.0.0.1" and int(m.group(3)) > 0
        address = f"tcp:{m.group(2)}:{m.group(3)}"
    else:
        assert m.group(5) == str(path)
        address = f"unix:{m.group(5)}"
    return Emulator(target, address)


class Client:
    """A test-side connection to an emulator (one reply line per command)."""

    def __init__(self, address: str):
        kind, _, rest = address.partition(":")
        if kind == "tcp":
            host, _, port = rest.rpartition(":")
            self.sock = socket.create_connection((host, int(port)), timeout=10)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(10)
            self.sock.connect(rest)
        self.rfile = self.sock.makefile("rb")

    def send(self, *lines: str) -> None:
        self.sock.sendall("".join(line + "\n" for line in lines).encode())

    def reply(self) -> str:
        line = self.rfile.readline()
        assert line.endswith(b"\n"), f"no complete reply line: {line!r}"
        return line.decode().rstrip("\n")

    def raw(self, line: str) -> str:
        self.send(line)
        return self.reply()

    def __call__(self, line: str) -> str:
        """Send a command, require OK, return what follows "OK "."""
        reply = self.raw(line)
        assert reply == "OK" or reply.startswith("OK "), f"{line[:60]!r} -> {reply!r}"
        return reply[3:]

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_testbench(spawn, exe: Path, tmp_path: Path, address: str, config: str = FAST,
                    name: str = "slot", display: str | None = None, ready: bool = True):
    slot = tmp_path / name
    slot.mkdir()
    (slot / "config").write_text(config)
    env = {k: v for k, v in os.environ.items() if k != "DISPLAY"}
    if display is not None:
        env["DISPLAY"] = display
    target = spawn(str(exe), slot, address, env=env, ready=ready)
    target.slot = slot
    return target


def finish(target, timeout: float = 15.0) -> dict[str, str]:
    """Wait for a successful exit; the report lines as {KEY: value}."""
    status = target.wait_exit(timeout)
    assert status == 0, f"testbench exited with {status}\n{target.describe()}"
    target.assert_ok()
    lines = target.stdout_lines()
    after = lines[lines.index(f"READY {target.pid}") + 1:]
    assert [line.split(" ", 1)[0] for line in after] == ["REGION", "SIGNATURE", "DISPLAY",
                                                         "SLOT"], target.describe()
    assert target.out_lines() == after           # OUTFILE logs the same lines
    report = dict(line.split(" ", 1) for line in after)
    assert report["REGION"] == "1"
    assert re.fullmatch(r"[0-9a-f]{16}", report["SIGNATURE"]), report
    return report


def peek(pid: int, addr: int, size: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(addr)
        return mem.read(size)


def poke(pid: int, addr: int, data: bytes) -> None:
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(addr)
        mem.write(data)


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: proc_stat(pid).state == "T", 5, message=f"pid {pid} to stop")


def stop_between_transactions(tb) -> None:
    """SIGSTOP the testbench at a moment with no command outstanding."""
    for _ in range(100):
        stop(tb.pid)
        if peek(tb.pid, tb.symbols["txn_pending"], 4) == b"\0\0\0\0":
            return
        os.kill(tb.pid, signal.SIGCONT)
        time.sleep(0.001)
    pytest.fail("the testbench always had a transaction pending")


def children_of(pid: int) -> dict[int, str]:
    """The child processes of pid: {pid: state}."""
    return {child: st.state for child, st in process_table().items() if st.ppid == pid}


# --- the emulator alone ------------------------------------------------------------------

def test_emulator_protocol(spawn):
    emu = start_emulator(spawn)
    with emu.client() as c:
        assert c("PING") == "PONG"
        assert c("READ_REG 15") == "0x" + "0" * 16
        assert c("WRITE_REG 3 0x1122334455667788") == ""
        assert c("write_reg 15 18446744073709551615") == ""      # any case, decimal
        assert c("READ_REG 3") == "0x1122334455667788"
        assert c("READ_REG 0xf") == "0xffffffffffffffff"
        assert c("WRITE_MEM 0xfffc a1b2c3d4") == "4"
        assert c("READ_MEM 65532 4") == "a1b2c3d4"
        assert c("READ_MEM 0 2") == "0000"
        assert c("STEP 0") == "0"
        assert c("STEP 5") == "5"
        assert c("STEP 3") == "8"
        hash_before = c("HASH")
        for bad in ["", "NOPE", "PING x", "READ_REG 16", "READ_REG -1", "READ_REG x",
                    "WRITE_REG 1", "WRITE_REG 1 0x10000000000000000", "WRITE_MEM 0 abc",
                    "WRITE_MEM 0 zz", "WRITE_MEM 0xffff 0102", "READ_MEM 0 0",
                    "READ_MEM 65535 2", "STEP -1", "STEP 100001", "LOAD_STATE", "LOAD_STATE !!",
                    "LOAD_STATE " + "QUFBQQ==", "QUIT now"]:
            reply = c.raw(bad)
            assert reply.startswith("ERR "), f"{bad!r} -> {reply!r}"
        assert c("HASH") == hash_before                          # errors change nothing
        # Pipelined commands: one reply each, in order.
        r3 = c("READ_REG 3")
        c.send("PING", "READ_REG 3", "BAD", "STEP 1", "PING")
        assert [c.reply() for _ in range(5)] == ["OK PONG", f"OK {r3}",
                                                 "ERR unknown command BAD", "OK 9", "OK PONG"]
        assert c.raw("QUIT") == "OK BYE"
        assert c.rfile.readline() == b""                         # closed by the emulator
    # The next client finds the state as it was (one client at a time).
    with emu.client() as c:
        assert c("STEP 0") == "9"
        assert c("READ_MEM 0xfffc 4") != "" and c("PING") == "PONG"
        assert c.raw("SHUTDOWN") == "OK BYE"
    assert emu.target.wait_exit(5) == 0
    assert emu.target.stderr_text() == ""


def test_emulator_step_mixes_registers_and_memory(spawn, tmp_path):
    """Same commands -> same state; one memory bit more -> every register differs."""
    emus = [start_emulator(spawn), start_emulator(spawn),
            start_emulator(spawn, "unix", tmp_path / "emu.sock")]
    clients = [e.client() for e in emus]
    try:
        for c in clients:
            c("WRITE_REG 0 0x1234")
            c("WRITE_MEM 4096 00112233445566778899")
        clients[2]("WRITE_MEM 40000 01")                       # the only difference
        for c in clients:
            assert c("STEP 600") == "600"
        regs = [[c(f"READ_REG {r}") for r in range(16)] for c in clients]
        hashes = [c("HASH") for c in clients]
        assert regs[0] == regs[1] and hashes[0] == hashes[1]
        assert all(a != b for a, b in zip(regs[0], regs[2])), "a memory word did not spread"
        assert hashes[0] != hashes[2]
        assert len(set(regs[0])) == 16
        # STEP changes memory too, not only the registers.
        assert clients[0]("READ_MEM 0 65536") != "00" * 65536
        # STEP stays fast: 10000 cycles well under a second.
        t0 = time.monotonic()
        clients[0]("STEP 10000")
        assert time.monotonic() - t0 < 1.0
    finally:
        for c in clients:
            c.close()


def test_save_load_state_round_trip(spawn, tmp_path):
    src, dst = start_emulator(spawn), start_emulator(spawn)
    assert src.address != dst.address
    with src.client() as a, dst.client() as b:
        for r in range(16):
            a(f"WRITE_REG {r} {(r + 1) * 0x0101010101010101}")
        a("WRITE_MEM 100 " + bytes(range(256)).hex())
        a("STEP 123")
        state = a("SAVE_STATE")
        assert re.fullmatch(r"[A-Za-z0-9+/]+=*", state)
        b("WRITE_REG 7 99")
        b("STEP 5")
        # A damaged state is refused and leaves the target as it was.
        good_hash, b_hash = a("HASH"), b("HASH")
        flipped = state[:40] + ("A" if state[40] != "A" else "B") + state[41:]
        assert b.raw("LOAD_STATE " + flipped).startswith("ERR ")
        assert b("HASH") == b_hash
        assert b("LOAD_STATE " + state) == "123"
        assert b("HASH") == good_hash
        assert b("SAVE_STATE") == state
        # Both continue identically.
        for i in range(30):
            seq = [f"WRITE_REG {i % 16} {i * 7919}", f"STEP {1 + i % 5}",
                   f"READ_REG {(i * 5) % 16}", f"READ_MEM {(i * 997) % 65000} 16"]
            assert [a.raw(cmd) for cmd in seq] == [b.raw(cmd) for cmd in seq]
        assert a("HASH") == b("HASH")
    # A state carries over between transports (the restart may use another one).
    unix = start_emulator(spawn, "unix", tmp_path / "u.sock")
    with src.client() as a, unix.client() as u:
        assert u("LOAD_STATE " + a("SAVE_STATE")) == a("STEP 0")
        assert u("HASH") == a("HASH")


def test_emulator_unix_socket_file(spawn, tmp_path):
    path = tmp_path / "stale.sock"
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old.bind(str(path))                 # a stale socket file is replaced
    old.close()
    emu = start_emulator(spawn, "unix", path)
    with emu.client() as c:
        assert c("PING") == "PONG"
    emu.target.signal(signal.SIGTERM)
    assert emu.target.wait_exit(5) == 0
    assert not path.exists()


def test_emulator_per_connection(spawn):
    """--per-connection: concurrent clients, each with a fresh state of its own
    (a forked child each); clients that leave are reaped; SHUTDOWN from any
    client stops the whole server, exit 0."""
    emu = start_emulator(spawn, options=("--per-connection",))
    clients = []
    try:
        a, b = emu.client(), emu.client()
        clients += [a, b]
        fresh = b("HASH")
        # Both are served at once: without --per-connection b would wait in
        # the backlog until a leaves, and these replies would never come.
        assert a("WRITE_REG 3 0x1234") == ""
        assert a("READ_REG 3") == "0x0000000000001234"
        assert b("READ_REG 3") == "0x" + "0" * 16
        assert b("STEP 5") == "5"
        assert a("STEP 0") == "0"
        assert b("WRITE_MEM 0 ff") == "1"
        assert a("READ_MEM 0 1") == "00"
        a.send("STEP 2", "PING")            # pipelined, interleaved with b
        b.send("STEP 1")
        assert b.reply() == "OK 6"
        assert [a.reply(), a.reply()] == ["OK 2", "OK PONG"]
        assert a("HASH") != b("HASH") != fresh
        # One child per connection; one that left is reaped (no zombie).
        wait_until(lambda: len(children_of(emu.target.pid)) == 2, 5,
                   message=lambda: f"two children: {children_of(emu.target.pid)}")
        assert a.raw("QUIT") == "OK BYE"
        assert a.rfile.readline() == b""
        a.close()
        wait_until(lambda: len(children_of(emu.target.pid)) == 1, 5,
                   message=lambda: f"the QUIT child reaped: {children_of(emu.target.pid)}")
        # A new client starts from zero again; the state of b is untouched.
        c = emu.client()
        clients.append(c)
        assert c("HASH") == fresh and c("STEP 0") == "0"
        assert b("STEP 0") == "6" and b("READ_MEM 0 1") == "ff"
        kids = set(children_of(emu.target.pid))
        assert len(kids) == 2
        # SHUTDOWN from one client ends the server and the other clients.
        assert c.raw("SHUTDOWN") == "OK BYE"
        assert emu.target.wait_exit(10) == 0
        assert b.rfile.readline() == b""
        wait_until(lambda: all(proc_stat(pid) is None for pid in kids), 5,
                   message=lambda: f"children stopped and reaped: {kids}")
        assert emu.target.stderr_text() == ""
    finally:
        for cl in clients:
            cl.close()


def test_emulator_per_connection_sigterm(spawn, tmp_path):
    """SIGTERM on a --per-connection server stops it and its children, exit 0,
    and the unix socket file is removed."""
    path = tmp_path / "pc.sock"
    emu = start_emulator(spawn, "unix", path, options=("--per-connection",))
    with emu.client() as a, emu.client() as b:
        a("WRITE_REG 0 1")
        assert b("READ_REG 0") == "0x" + "0" * 16
        kids = set(children_of(emu.target.pid))
        assert len(kids) == 2
        emu.target.signal(signal.SIGTERM)
        assert emu.target.wait_exit(10) == 0
        wait_until(lambda: all(proc_stat(pid) is None for pid in kids), 5,
                   message=lambda: f"children stopped and reaped: {kids}")
        assert a.rfile.readline() == b"" and b.rfile.readline() == b""
    assert not path.exists()
    assert emu.target.stderr_text() == ""


# --- the testbench ------------------------------------------------------------------------

def test_testbench_uninterrupted_runs_agree(spawn, testbench_bin, tmp_path):
    """Two full default runs (about 3 s, concurrently), fresh emulators."""
    emus = [start_emulator(spawn), start_emulator(spawn)]
    benches = [start_testbench(spawn, testbench_bin, tmp_path, emus[0].address, "",
                               "slot0"),
               start_testbench(spawn, testbench_bin, tmp_path, emus[1].address,
                               "# defaults\nseed = 1\n", "slot1", display=":7.0")]
    for tb in benches:
        pre = tb.preamble
        assert f"SOCKET_FD {SOCKET_FD}" in pre
        assert set(tb.symbols) == {"design_state", "txn_pending", "txn_count"}
        fds = {line.split()[0]: int(line.split()[1]) for line in pre if "_FD " in line}
        assert os.readlink(f"/proc/{tb.pid}/fd/{SOCKET_FD}").startswith("socket:")
        assert os.readlink(f"/proc/{tb.pid}/fd/{fds['LOG_FD']}") == str(tb.slot / "run.log")
        assert os.readlink(f"/proc/{tb.pid}/fd/{fds['CONFIG_FD']}") == str(tb.slot / "config")
        flags = Path(f"/proc/{tb.pid}/fdinfo/{fds['LOG_FD']}").read_text()
        assert int(re.search(r"flags:\s+(\d+)", flags).group(1), 8) & os.O_APPEND
    t0 = time.monotonic()
    reports = [finish(tb) for tb in benches]
    assert time.monotonic() - t0 > 2.0, "the default run is not slow"
    assert reports[0]["SIGNATURE"] == reports[1]["SIGNATURE"]
    assert reports[0]["DISPLAY"] == "(unset)" and reports[1]["DISPLAY"] == ":7.0"
    for tb, rep in zip(benches, reports):
        assert rep["SLOT"] == str(tb.slot / "run.log")
        log = (tb.slot / "run.log").read_text().splitlines()
        assert log[0].startswith(f"start pid {tb.pid} seed 1 init_steps 40 vectors 200")
        assert sum(line.startswith("init ") for line in log) == 40
        assert sum(line.startswith("vector ") for line in log) == 200
        assert log[-2:] == [f"signature {rep['SIGNATURE']}", "done eintr_retries 0"]
        assert not any("jump" in line for line in log)
    # The testbench QUIT; its emulator serves the next client, in the same state.
    hashes = []
    for emu in emus:
        with emu.client() as c:
            assert c("STEP 0") == str(40 * 8 + sum(1 + i % 7 for i in range(200)))
            hashes.append(c("HASH"))
    assert hashes[0] == hashes[1]


def test_testbench_signature_depends_on_emulator_state(spawn, testbench_bin, tmp_path):
    """Reference runs over TCP and a unix socket agree; a changed initial
    register, a changed memory byte, another seed each change the signature."""
    ref = start_emulator(spawn)
    unix = start_emulator(spawn, "unix", tmp_path / "emu.sock")
    reg = start_emulator(spawn)
    mem = start_emulator(spawn)
    other = start_emulator(spawn)
    with reg.client() as c:
        c("WRITE_REG 13 1")
    with mem.client() as c:
        c("WRITE_MEM 0x8000 80")
    runs = {
        "ref": start_testbench(spawn, testbench_bin, tmp_path, ref.address, FAST, "ref"),
        "unix": start_testbench(spawn, testbench_bin, tmp_path, unix.address, FAST, "unix"),
        "reg": start_testbench(spawn, testbench_bin, tmp_path, reg.address, FAST, "reg"),
        "mem": start_testbench(spawn, testbench_bin, tmp_path, mem.address, FAST, "mem"),
        "seed": start_testbench(spawn, testbench_bin, tmp_path, other.address,
                                FAST + "seed 2\n", "seed"),
    }
    sig = {name: finish(tb)["SIGNATURE"] for name, tb in runs.items()}
    assert sig["unix"] == sig["ref"]
    for name in ("reg", "mem", "seed"):
        assert sig[name] != sig["ref"], name
    assert len(set(sig.values())) == 4
    # A second run against the same emulator (its state went on) differs, and
    # the testbench notices nothing wrong: the cycle counter is consistent.
    again = start_testbench(spawn, testbench_bin, tmp_path, ref.address, FAST, "again")
    assert finish(again)["SIGNATURE"] != sig["ref"]


def test_testbench_stop_cont_and_design_state_faults(spawn, testbench_bin, tmp_path):
    """SIGSTOP/SIGCONT during the vectors changes nothing; flipping bits of
    design_state (what a fault-injecting plugin would do) changes the signature."""
    config = "init_steps 20\ninit_sleep_us 2000\nvectors 150\nvector_sleep_us 5000\n"
    emus = [start_emulator(spawn) for _ in range(3)]
    ref, stopped, faulty = (start_testbench(spawn, testbench_bin, tmp_path, e.address, config,
                                            f"slot{i}") for i, e in enumerate(emus))
    for tb in (stopped, faulty):
        tb.wait_for_line(r"^REGION 1$")
    # Fault injection, the testbench stopped between two transactions.
    addr = faulty.symbols["design_state"]
    stop_between_transactions(faulty)
    words = struct.unpack("<4Q", peek(faulty.pid, addr, 32))
    assert any(words), "design_state was never filled"
    poke(faulty.pid, addr, struct.pack("<4Q", *(w ^ 1 for w in words)))
    count = struct.unpack("<Q", peek(faulty.pid, faulty.symbols["txn_count"], 8))[0]
    assert count >= 1 + 20 + 5 + 20 + 4        # PING, the initialisation, READ_REGs
    os.kill(faulty.pid, signal.SIGCONT)
    # Stop/continue the other one a few times, wherever it is.
    for _ in range(5):
        stop(stopped.pid)
        time.sleep(0.03)
        os.kill(stopped.pid, signal.SIGCONT)
        time.sleep(0.05)
    sig = [finish(tb)["SIGNATURE"] for tb in (ref, stopped, faulty)]
    assert sig[1] == sig[0]
    assert sig[2] != sig[0]


def fake_emulator(replies: list[bytes]) -> tuple[str, threading.Thread]:
    """A one-shot TCP server answering each command line with the next of replies."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve():
        with listener:
            conn, _ = listener.accept()
            with conn, conn.makefile("rb") as rfile:
                for answer in replies:
                    if not rfile.readline():
                        return
                    conn.sendall(answer)
                rfile.readline()            # until the testbench gives up

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp:127.0.0.1:{listener.getsockname()[1]}", thread


def test_testbench_failures(spawn, testbench_bin, tmp_path):
    exe = str(testbench_bin)
    emu = start_emulator(spawn)
    # No config in the slot: exit 5, reported on stderr and in OUTFILE.
    (tmp_path / "empty").mkdir()
    tb = spawn(exe, tmp_path / "empty", emu.address, ready=False)
    assert tb.wait_exit(5) == EXIT_SYSCALL
    assert "config" in tb.stderr_text() and tb.out_lines()[0].startswith("FAIL ERROR open")
    # A bad address, a bad config: exit 2.
    tb = start_testbench(spawn, testbench_bin, tmp_path, "udp:1.2.3.4:5", FAST, "addr",
                         ready=False)
    assert tb.wait_exit(5) == EXIT_USAGE
    tb = start_testbench(spawn, testbench_bin, tmp_path, emu.address, "vectors lots\n",
                         "badcfg", ready=False)
    assert tb.wait_exit(5) == EXIT_USAGE
    assert "vectors" in tb.stderr_text()
    # Nobody listening: exit 5.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tb = spawn(exe, tmp_path / "addr", f"tcp:127.0.0.1:{port}", ready=False)
    assert tb.wait_exit(5) == EXIT_SYSCALL
    assert "connect" in tb.stderr_text()
    # An ERR reply, bytes after a reply: exit 4.
    address, thread = fake_emulator([b"ERR no\n"])
    tb = spawn(exe, tmp_path / "addr", address, ready=False)
    assert tb.wait_exit(5) == EXIT_BADVALUE
    assert "BAD reply to PING: ERR no" in tb.stderr_text()
    thread.join(5)
    address, thread = fake_emulator([b"OK PONG\nOK\n"])
    tb = spawn(exe, tmp_path / "addr", address, ready=False)
    assert tb.wait_exit(5) == EXIT_BADVALUE
    assert "BAD 3 bytes after the reply to PING" in tb.stderr_text()
    thread.join(5)
    # The config changed under the running testbench: exit 4.
    tb = start_testbench(spawn, testbench_bin, tmp_path, emu.address,
                         "init_steps 1\nvectors 20\nvector_sleep_us 10000\n", "cfg")
    tb.wait_for_line(r"^REGION 1$")
    (tb.slot / "config").write_text("changed\n")
    assert tb.wait_exit(5) == EXIT_BADVALUE
    assert "BAD config changed" in tb.stderr_text()
    # The emulator dies mid-run: exit 5, neither a hang nor SIGPIPE.
    tb = start_testbench(spawn, testbench_bin, tmp_path, emu.address,
                         "init_sleep_us 1000\nvector_sleep_us 2000\n", "dies")
    tb.wait_for_line(r"^REGION 1$")
    emu.target.kill()
    assert tb.wait_exit(5) == EXIT_SYSCALL
    assert re.search(r"ERROR (emulator closed|send|recv)", tb.stderr_text())


# A short run for the width tests (about 0.1 s).
SHORT = "init_steps 8\ninit_sleep_us 1000\nvectors 40\nvector_sleep_us 1000\n"


def test_testbench_width(spawn, testbench_bin, tmp_path):
    """width 64 is the default (same signature), width 32 differs; the runs on
    one --per-connection emulator agree with a run on a fresh plain emulator."""
    plain = start_emulator(spawn)
    shared = start_emulator(spawn, options=("--per-connection",))
    runs = {
        "plain": start_testbench(spawn, testbench_bin, tmp_path, plain.address, SHORT, "plain"),
        "none": start_testbench(spawn, testbench_bin, tmp_path, shared.address, SHORT, "none"),
        "w64": start_testbench(spawn, testbench_bin, tmp_path, shared.address,
                               SHORT + "width 64\n", "w64"),
        "w32": start_testbench(spawn, testbench_bin, tmp_path, shared.address,
                               SHORT + "width=32\n", "w32"),
    }
    sig = {name: finish(tb)["SIGNATURE"] for name, tb in runs.items()}
    assert sig["none"] == sig["plain"]
    assert sig["w64"] == sig["none"]
    assert sig["w32"] != sig["w64"]
    for bad in ("0", "65", "-1"):
        tb = start_testbench(spawn, testbench_bin, tmp_path, shared.address,
                             SHORT + f"width {bad}\n", f"bad{bad}", ready=False)
        assert tb.wait_exit(5) == EXIT_USAGE, tb.describe()
        assert "width" in tb.stderr_text()


def test_testbench_width_masks_upper_faults(spawn, testbench_bin, tmp_path):
    """With width 32, a bit flipped in the upper half of design_state is masked
    (the same signature), one in the lower half is not."""
    config = "init_steps 8\ninit_sleep_us 1000\nvectors 100\nvector_sleep_us 10000\nwidth 32\n"
    emu = start_emulator(spawn, options=("--per-connection",))
    ref, upper, lower = (start_testbench(spawn, testbench_bin, tmp_path, emu.address, config,
                                         name) for name in ("ref", "upper", "lower"))
    for tb, bit in ((upper, 40), (lower, 0)):
        tb.wait_for_line(r"^REGION 1$")
        stop_between_transactions(tb)
        addr = tb.symbols["design_state"]
        words = struct.unpack("<4Q", peek(tb.pid, addr, 32))
        poke(tb.pid, addr, struct.pack("<4Q", *(w ^ (1 << bit) for w in words)))
        vectors_done = sum(line.startswith("vector ")
                           for line in (tb.slot / "run.log").read_text().splitlines())
        os.kill(tb.pid, signal.SIGCONT)
        assert vectors_done < 90, "the fault came too late to be seen"
    sig = {name: finish(tb)["SIGNATURE"] for name, tb in
           (("ref", ref), ("upper", upper), ("lower", lower))}
    assert sig["upper"] == sig["ref"]
    assert sig["lower"] != sig["ref"]

"""What an emulator vendor would ship: a ptckpt plugin written only against the public API
(ptckpt.plugins).  It drops the testbench's connection to the emulator at checkpoint, with the
emulator's state saved in the image, and re-makes it at restart against a fresh emulator
(address in $EMULATOR_ADDRESS, e.g. tcp:127.0.0.1:5000 or unix:/run/emu.sock), or, without
$EMULATOR_ADDRESS, against the address the connection led to at checkpoint (the same
emulator, still running: with --per-connection every restored testbench gets a run slot of
its own and LOAD_STATEs its state into it).

In a group dump or restore (ptckpt group: testbenches on several hosts) the members meet at
two barriers (ctx.barrier): "drained" at dump, once every member is frozen between
transactions and before any saves its emulator state, so the states saved are one cut of
the whole computation; "linked" at restore, once every member's connection is re-made and
its state loaded, before any member goes on.  Every member comes to them, with or without
an emulator link; outside a group they return at once.
"""

import os
import socket
import struct
import time

from ptckpt.plugins import Plugin

LINK_FD = 100          # the testbench keeps its emulator connection at fd 100


def _command(sock: socket.socket, line: str) -> str:
    sock.sendall(line.encode() + b"\n")
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise RuntimeError("the emulator closed the connection")
        reply += chunk
    text = reply.decode().rstrip("\n")
    if not text.startswith("OK"):
        raise RuntimeError(f"emulator: {line.split()[0]} -> {text}")
    return text[3:]


def _connect(address: str) -> socket.socket:
    kind, _, rest = address.partition(":")
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        return socket.create_connection((host, int(port)), timeout=10)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(rest)
    return sock


class EmulatorLink(Plugin):
    name = "emulator-link"
    version = "2.3"

    def _holds_link(self, proc) -> bool:
        return any(f.fd == LINK_FD and f.kind.name == "SOCKET" for f in proc.fds) if proc.image else \
            os.path.exists(f"/proc/{proc.pid}/fd/{LINK_FD}")

    def pre_dump(self, proc, ctx):
        if not self._holds_link(proc):
            return
        # claimed before the freeze: a dump with --tcp-established locks the tree's TCP
        # connections as it freezes, all but those claimed, and frozen talks over this one
        ctx.claim_external(proc.vpid, LINK_FD, "emulator-link: the emulator connection")
        # drain: wait until no transaction is in flight
        deadline = time.monotonic() + 5
        while struct.unpack("<i", proc.read_symbol("txn_pending", 4))[0]:
            if time.monotonic() > deadline:
                raise RuntimeError("a transaction stayed in flight for 5 s")
            time.sleep(0.001)

    def busy(self, proc, ctx):
        # frozen between transactions, or not at all: the dump thaws it, waits again
        # (pre_dump) and freezes it again
        if self._holds_link(proc) and struct.unpack("<i", proc.read_symbol("txn_pending", 4))[0]:
            return "frozen in the middle of a transaction"
        return None

    def frozen(self, proc, ctx):
        ctx.barrier("drained")             # every member frozen, none in a transaction
        if not self._holds_link(proc):
            return
        if struct.unpack("<i", proc.read_symbol("txn_pending", 4))[0]:
            raise RuntimeError("frozen in the middle of a transaction; dump again")
        # a copy shares the testbench's open file description: leave its flags alone
        with socket.socket(fileno=proc.fd_copy(LINK_FD)) as link:
            state = _command(link, "SAVE_STATE")
            peer = link.getpeername()       # where a restart reconnects without $EMULATOR_ADDRESS
            address = f"tcp:{peer[0]}:{peer[1]}" if link.family == socket.AF_INET else f"unix:{peer}"
        ctx.save(state.encode(), key="emulator-state", pid=proc.vpid)
        ctx.save(address.encode(), key="emulator-address", pid=proc.vpid)
        ctx.claim_external(proc.vpid, LINK_FD, "emulator-link: the emulator connection")

    def pre_restore(self, proc, ctx):
        if ctx.load(key="emulator-state", pid=proc.vpid) is not None:
            ctx.claim_external(proc.vpid, LINK_FD)

    def restored(self, proc, ctx):
        state = ctx.load(key="emulator-state", pid=proc.vpid)
        if state is not None:
            saved = ctx.load(key="emulator-address", pid=proc.vpid)
            address = os.environ.get("EMULATOR_ADDRESS") or (saved or b"").decode()
            if not address:
                raise RuntimeError("no EMULATOR_ADDRESS to reconnect to")
            with _connect(address) as link:
                _command(link, "LOAD_STATE " + state.decode())
                link.settimeout(None)      # blocking again: the testbench gets this description
                proc.install_fd(LINK_FD, link.fileno())
        ctx.barrier("linked")              # every member's link re-made and loaded

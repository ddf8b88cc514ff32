"""Built-in virtualisation, each a plugin on the public API (ptckpt.plugins).

* :class:`SetEnv` -- ``restore --set-env NAME=VALUE`` / ``--unset-env NAME``: after
  the restore getenv() in every process of the tree returns the new values (the
  environment is rewritten through libc's `environ`, by :meth:`ProcessHandle.set_environ`).
* :class:`External` -- ``dump --external tcp:HOST:PORT|unix:PATH|listen:HOST:PORT|
  listen-unix:PATH|fd:N``: those connections (or listeners) lead outside the checkpoint
  (an emulator, a licence server, an X server; a port other programs connect to): not
  saved, marked external with the address they went to (a listener: the address it
  listens on, its backlog and options).
* :class:`Reconnect` -- ``restore --reconnect [--remap-addr OLD=NEW]``: claims every
  external connection that has an address, dials it again (or its NEW address) and
  installs the new socket at the same fd; every external listener is bound to its
  address (or its NEW one) and listens again, at the same fd.
* :class:`RemapPath` -- ``restore --remap-path OLD=NEW``: every fd, file mapping, cwd,
  root and exe under OLD is reopened under NEW (pre_restore rewrites the image's
  paths); and the tree runs in a private mount namespace where NEW is bind-mounted
  on OLD, so paths under OLD that it opens later land under NEW too.
* :class:`InheritStdio` -- ``restore --inherit-stdio``: the root's fds 0, 1 and 2 are
  ptckpt's own instead of what they were at dump (a campaign gives each run its files).
* :class:`Inject` -- ``restore --inject SPEC --seed N``: faults (bit flips, values,
  registers; ptckpt.faults) made in the restored process before it runs, every
  random choice from the seed, each logged.
"""

from __future__ import annotations

import ast
import dataclasses
import errno
import fcntl
import ipaddress
import json
import logging
import os
import random
import socket
import stat
import struct
from collections.abc import Sequence

from . import faults, sockdiag
from .errors import PluginError, UsageError
from .plugins import Plugin

log = logging.getLogger("ptckpt.faults")


def _pairs(values: Sequence[str], option: str) -> list[tuple[str, str]]:
    out = []
    for v in values:
        name, sep, value = v.partition("=")
        if not sep or not name:
            raise UsageError(f"{option} {v!r}: expected NAME=VALUE")
        out.append((name, value))
    return out


class External(Plugin):
    name = "external"
    version = "1"
    recorded = False                     # a restore does not need it: Reconnect or a vendor's

    KINDS = ("tcp", "unix", "listen", "listen-unix", "fd")

    def __init__(self, specs: Sequence[str]):
        self.specs = []
        for spec in specs:
            kind, sep, rest = spec.partition(":")
            if kind not in self.KINDS or not sep or not rest:
                raise UsageError(f"--external {spec!r}: expected tcp:HOST:PORT, unix:PATH, listen:HOST:PORT, "
                                 f"listen-unix:PATH or fd:N")
            if kind == "fd" and not rest.isdigit():
                raise UsageError(f"--external {spec!r}: N must be an fd number")
            if kind in ("tcp", "listen"):
                _host_port(spec, "--external")
            self.specs.append(spec if kind == "fd" else canonical_address(spec))

    def frozen(self, proc, ctx) -> None:
        for f in proc.fds:
            address = peer_address(f) or listen_address(f)
            if f"fd:{f.fd}" in self.specs or (address and canonical_address(address) in self.specs):
                note = address or f"fd:{f.fd}"
                if address.startswith("listen"):
                    note = _listener_note(proc, f, address)
                ctx.claim_external(proc.vpid, f.fd, note)


# --- addresses ------------------------------------------------------------------------
#
# An external connection is recorded as the address it leads to: tcp:HOST:PORT (an IPv6
# HOST in brackets, tcp:[::1]:8080) or unix:PATH for a connected socket, listen:HOST:PORT
# or listen-unix:PATH for a listening one (an abstract unix name as @NAME).  A listener's
# note goes on with what listening again needs: "listen:127.0.0.1:8080 backlog=5
# SO_REUSEADDR=1" (IPV6_V6ONLY=0|1 for IPv6, SO_REUSEPORT=1 when set, type=SOCK_SEQPACKET
# for such a unix listener).

_LISTEN_OPTIONS = ("backlog", "SO_REUSEADDR", "SO_REUSEPORT", "IPV6_V6ONLY", "type")


def _host_port(address: str, option: str) -> tuple[str, str, int]:
    """(kind, host without brackets, port) of tcp:HOST:PORT or listen:HOST:PORT."""
    kind, _, rest = address.partition(":")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"{option} {address!r}: expected {kind}:HOST:PORT ({kind}:[::1]:PORT for IPv6)")
    return kind, host[1:-1] if host.startswith("[") and host.endswith("]") else host, int(port)


def _join(kind: str, host: str, port: int) -> str:
    return f"{kind}:[{host}]:{port}" if ":" in host else f"{kind}:{host}:{port}"


def canonical_address(address: str) -> str:
    """The address as recorded: a numeric host in its short form, IPv6 in brackets
    ("tcp:0:0::1:80" -> "tcp:[::1]:80"); unix paths as they are."""
    kind = address.partition(":")[0]
    if kind not in ("tcp", "listen"):
        return address
    kind, host, port = _host_port(address, "address")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        pass                                    # a host name: compared as written
    return _join(kind, host, port)


def _details(f) -> dict[str, str]:
    return dict(f.details) if f.kind.name == "SOCKET" else {}


def _unix_name(text: str) -> str:
    """A unix address as files.py recorded it: a path as is, an abstract name (repr of
    bytes b'\\x00...') as @NAME; "" for an unnamed socket."""
    if text.startswith(("b'", 'b"')):
        raw = ast.literal_eval(text)
        return "@" + os.fsdecode(raw[1:]) if raw[:1] == b"\0" else os.fsdecode(raw)
    return text


def peer_address(f) -> str:
    """tcp:HOST:PORT or unix:PATH of the peer a stream socket fd was connected to, "" if none."""
    d = _details(f)
    peer, family = d.get("peer", ""), d.get("family", "")
    if family == "AF_UNIX":
        return f"unix:{peer}" if peer and peer.startswith("/") else ""
    if family in ("AF_INET", "AF_INET6") and peer.startswith("(") and d.get("type") == "SOCK_STREAM":
        host, port = ast.literal_eval(peer)[:2]
        return _join("tcp", host, port) if port else ""
    return ""


def listen_address(f) -> str:
    """listen:HOST:PORT or listen-unix:PATH of a listening socket fd, "" for any other fd."""
    d = _details(f)
    if d.get("listening") != "1":
        return ""
    local, family = d.get("local", ""), d.get("family", "")
    if family == "AF_UNIX":
        name = _unix_name(local)
        return f"listen-unix:{name}" if name else ""
    if family in ("AF_INET", "AF_INET6") and local.startswith("("):
        host, port = ast.literal_eval(local)[:2]
        return _join("listen", host, port)
    return ""


def _listener_note(proc, f, address: str) -> str:
    """The address of listener `f` with its backlog and the options binding again needs."""
    options: dict[str, object] = {}
    copy = proc.fd_copy(f.fd)
    with socket.socket(fileno=copy) as sock:
        if sock.family == socket.AF_UNIX:
            diag = sockdiag.unix_sockets({f.ino}).get(f.ino)
            options["backlog"] = diag.wqueue if diag is not None else socket.SOMAXCONN
            if sock.type != socket.SOCK_STREAM:
                options["type"] = sock.type.name
        else:
            # tcp_info's tcpi_sacked holds a listener's backlog (net/ipv4/tcp.c tcp_get_info)
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32)
            options["backlog"] = struct.unpack_from("I", info, 28)[0]
            options["SO_REUSEADDR"] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT):
                options["SO_REUSEPORT"] = 1
            if sock.family == socket.AF_INET6:
                options["IPV6_V6ONLY"] = sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
    return " ".join([address] + [f"{k}={v}" for k, v in options.items()])


@dataclasses.dataclass(frozen=True)
class Listener:
    """What an external listener's note says: its address, backlog and options."""

    address: str                         # listen:HOST:PORT or listen-unix:PATH
    backlog: int = socket.SOMAXCONN
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_note(cls, note: str) -> Listener:
        options = []
        while True:
            head, sep, last = note.rpartition(" ")
            key, eq, value = last.partition("=")
            if not sep or not eq or key not in _LISTEN_OPTIONS:
                break
            options.insert(0, (key, value))
            note = head
        found = dict(options)
        backlog = int(found.pop("backlog", socket.SOMAXCONN))
        return cls(note, backlog, tuple(found.items()))

    def option(self, name: str) -> str | None:
        return dict(self.options).get(name)


def external_listener(f) -> Listener | None:
    """The listener an external fd was, from its note (or, for an image that recorded it as
    fd:N, from its socket details: backlog SOMAXCONN, SO_REUSEADDR set); None if not one."""
    if f.external.startswith(("listen:", "listen-unix:")):
        return Listener.from_note(f.external)
    if f.external.startswith("fd:") and listen_address(f):
        return Listener(listen_address(f))
    return None


class Reconnect(Plugin):
    """Re-makes external connections (dials their address again) and external listeners
    (binds their address again and listens), each at its fd with its O_NONBLOCK."""

    name = "reconnect"
    version = "1"
    recorded = False

    def __init__(self, remaps: Sequence[str] = ()):
        self.remaps = dict(self._remap(r) for r in remaps)
        self._made: dict = {}             # open file description -> the socket made for it

    @staticmethod
    def _remap(value: str) -> tuple[str, str]:
        groups = (("tcp:", "unix:"), ("listen:", "listen-unix:"))
        for group in groups:
            if value.startswith(group):
                for kind in group:
                    at = value.find("=" + kind)
                    if at > 0:
                        return canonical_address(value[:at]), canonical_address(value[at + 1:])
                if "=" in value:
                    what = "listener" if group[0] == "listen:" else "connection"
                    raise UsageError(f"--remap-addr {value!r}: a {what} moves to a "
                                     f"{' or '.join(k + '...' for k in group)} address")
        raise UsageError(f"--remap-addr {value!r}: expected OLD=NEW, each tcp:HOST:PORT or unix:PATH (a "
                         f"connection), or listen:HOST:PORT or listen-unix:PATH (a listener)")

    def _connections(self, proc):
        return [f for f in proc.fds if f.external.startswith(("tcp:", "unix:"))]

    def pre_restore(self, proc, ctx) -> None:
        for f in self._connections(proc):
            ctx.claim_external(proc.vpid, f.fd)
        for f in proc.fds:
            spec = external_listener(f) if f.external else None
            if spec is not None:              # bound now: a busy address fails the restore early
                address = self.remaps.get(canonical_address(spec.address), spec.address)
                sock = self._shared(proc, f, "pre_restore",
                                    lambda: listen_again(dataclasses.replace(spec, address=address)))
                ctx.install_fd(proc.vpid, f.fd, sock.fileno())

    def restored(self, proc, ctx) -> None:
        for f in self._connections(proc):
            address = self.remaps.get(canonical_address(f.external), f.external)
            proc.install_fd(f.fd, self._shared(proc, f, "restored", lambda: dial(address)).fileno())

    def resumed(self, proc, ctx) -> None:
        for sock in self._made.values():      # the processes hold their copies
            sock.close()
        self._made.clear()

    def _shared(self, proc, f, event: str, make) -> socket.socket:
        """One socket per open file description: processes that shared the old one (a
        listener inherited by workers) share the new one."""
        key = f.desc or (proc.vpid, f.fd)
        if key not in self._made:
            try:
                sock = make()
            except OSError as err:
                raise PluginError(self.name, event, f"process {proc.vpid} fd {f.fd}: {err.strerror}") from None
            _set_nonblock(sock, f.flags)
            self._made[key] = sock
        return self._made[key]


def _set_nonblock(sock: socket.socket, flags: int) -> None:
    fcntl.fcntl(sock.fileno(), fcntl.F_SETFL, flags & os.O_NONBLOCK)


def _unix_address(name: str) -> str | bytes:
    return b"\0" + os.fsencode(name[1:]) if name.startswith("@") else name


def dial(address: str) -> socket.socket:
    """A connected stream socket to tcp:HOST:PORT (tcp:[::1]:PORT) or unix:PATH (blocking)."""
    kind, _, rest = address.partition(":")
    try:
        if kind == "tcp":
            _kind, host, port = _host_port(address, "--reconnect")
            sock = socket.create_connection((host, port), timeout=10)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            try:
                sock.connect(_unix_address(rest))
            except OSError:
                sock.close()
                raise
    except OSError as err:
        raise OSError(err.errno, f"cannot reconnect to {address}: {err.strerror or err}") from None
    sock.settimeout(None)
    return sock


def listen_again(spec: Listener) -> socket.socket:
    """A socket bound to the listener's address and listening with its backlog (blocking).

    SO_REUSEADDR is on for the bind (the old listener's connections in TIME_WAIT do not
    stop it) and then set as the original had it.  A unix path still holding a socket
    file that nobody listens on (the dumped process died) is unlinked first."""
    kind, _, rest = spec.address.partition(":")
    try:
        if kind == "listen":
            _kind, host, port = _host_port(spec.address, "--reconnect")
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if spec.option("SO_REUSEPORT") == "1":
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6 and spec.option("IPV6_V6ONLY") is not None:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(spec.option("IPV6_V6ONLY")))
                sock.bind((host, port))
                sock.listen(spec.backlog)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(spec.option("SO_REUSEADDR") or 1))
            except OSError:
                sock.close()
                raise
        else:
            kinds = {"SOCK_SEQPACKET": socket.SOCK_SEQPACKET, "SOCK_DGRAM": socket.SOCK_DGRAM}
            sock = socket.socket(socket.AF_UNIX, kinds.get(spec.option("type") or "", socket.SOCK_STREAM))
            try:
                _bind_unix(sock, rest)
                sock.listen(spec.backlog)
            except OSError:
                sock.close()
                raise
    except OSError as err:
        hint = ""
        if err.errno == errno.EADDRINUSE:
            hint = (" (another socket holds it: the dumped process still runs, or, for a listener "
                    "without SO_REUSEADDR, connections it closed are still in TIME_WAIT)")
        raise OSError(err.errno, f"cannot listen again on {spec.address}: {err.strerror or err}{hint}") from None
    return sock


def _bind_unix(sock: socket.socket, name: str) -> None:
    try:
        sock.bind(_unix_address(name))
    except OSError as err:
        if err.errno != errno.EADDRINUSE or name.startswith("@") or not _stale_socket_file(name):
            raise
        os.unlink(name)
        sock.bind(name)


def _stale_socket_file(path: str) -> bool:
    """`path` is a socket file that nobody listens on any more."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


class SetEnv(Plugin):
    name = "set-env"
    version = "1"
    recorded = False

    def __init__(self, set_values: Sequence[str] = (), unset: Sequence[str] = ()):
        self.set_values = _pairs(set_values, "--set-env")
        self.unset = list(unset)

    def restored(self, proc, ctx) -> None:
        from . import symbols
        env = proc.environ()
        for name, value in self.set_values:
            env = symbols.set_env(env, name, value)
        for name in self.unset:
            env = symbols.unset_env(env, name)
        proc.set_environ(env)


def remap(path: str, pairs: Sequence[tuple[str, str]]) -> str:
    """`path` with the first OLD prefix (a whole path component) replaced by NEW."""
    suffix = " (deleted)" if path.endswith(" (deleted)") else ""
    core = path[:-len(suffix)] if suffix else path
    for old, new in pairs:
        if core == old or core.startswith(old.rstrip("/") + "/"):
            return new.rstrip("/") + core[len(old.rstrip("/")):] + suffix
    return path


class RemapPath(Plugin):
    name = "remap-path"
    version = "1"
    recorded = False

    def __init__(self, values: Sequence[str]):
        self.pairs = [(os.path.normpath(o), os.path.normpath(n)) for o, n in _pairs(values, "--remap-path")]
        for old, new in self.pairs:
            if not old.startswith("/") or not new.startswith("/"):
                raise UsageError(f"--remap-path {old}={new}: both paths must be absolute")
            if not os.path.isdir(new):
                raise UsageError(f"--remap-path {old}={new}: {new} is not a directory")

    def rewrite(self, proc_image):
        """The ProcessImage with every path under an OLD moved under its NEW."""
        r = lambda p: remap(p, self.pairs)
        kept = lambda p: p if p.endswith(" (deleted)") else r(p)    # a removed cwd or root: from the image
        task = dataclasses.replace(proc_image.task, cwd=kept(proc_image.task.cwd), exe=r(proc_image.task.exe),
                                   root=kept(proc_image.task.root))
        mm = dataclasses.replace(proc_image.mm, exe_file=r(proc_image.mm.exe_file))
        fds = tuple(dataclasses.replace(f, path=r(f.path)) if f.path.startswith("/") else f
                    for f in proc_image.fds)
        vmas = tuple(dataclasses.replace(v, path=r(v.path)) if v.path.startswith("/") else v
                     for v in proc_image.vmas)
        return dataclasses.replace(proc_image, task=task, mm=mm, fds=fds, vmas=vmas)

    def pre_restore(self, proc, ctx) -> None:
        proc.image = self.rewrite(proc.image)
        if not ctx.moved_dirs:                       # once for the tree
            for old, new in self.pairs:
                ctx.moved(new)
                if os.path.isdir(old) and old != new:
                    ctx.bind_mount(new, old)


class Inject(Plugin):
    """Faults made at restore, in the restored event (memory, fds and registers in place,
    nothing run yet): each spec in order, in the root or the process its pid= names.
    `faults` lists what was done; with `log_path` it is also written there as JSON."""

    name = "inject"
    version = "1"
    recorded = False

    def __init__(self, specs: Sequence[str], seed: int, log_path: str | None = None):
        self.specs = [faults.parse_spec(s) for s in specs]
        self.seed = seed
        self.rng = random.Random(seed)
        self.log_path = log_path
        self.faults: list[faults.Fault] = []
        self._members: list[int] = []

    def pre_restore(self, proc, ctx) -> None:
        self._members.append(proc.vpid)

    def restored(self, proc, ctx) -> None:
        root = self._members[0] if self._members else proc.vpid
        unknown = sorted({s.pid for s in self.specs if s.pid and s.pid not in self._members})
        if unknown:
            raise PluginError(self.name, "restored", f"--inject pid={unknown[0]}: the image has no such "
                                                     f"process (it has {' '.join(map(str, self._members))})")
        for spec in self.specs:
            if (spec.pid or root) != proc.vpid:
                continue
            if spec.kind == "call":
                faults.at_call(proc, spec, self.rng, self._record)
            else:
                self._record(faults.inject(proc, spec, self.rng))
        if self.log_path and proc.vpid == self._members[-1]:
            self.write_log()

    def _record(self, fault: faults.Fault) -> None:
        log.info("fault (seed %d): %s", self.seed, fault)
        self.faults.append(fault)
        if self.log_path:
            self.write_log()

    def write_log(self) -> None:
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"seed": self.seed, "specs": [s.text for s in self.specs],
                       "faults": [x.to_dict() for x in self.faults]}, f, indent=2)


class InheritStdio(Plugin):
    """The root gets ptckpt's stdin, stdout and stderr at fds 0-2 (the image's are left out)."""

    name = "inherit-stdio"
    version = "1"
    recorded = False

    def __init__(self):
        self.root = 0

    def pre_restore(self, proc, ctx) -> None:
        if self.root:
            return
        self.root = proc.vpid
        proc.image = dataclasses.replace(proc.image, fds=tuple(
            dataclasses.replace(f, skipped=True) if f.fd <= 2 else f for f in proc.image.fds))
        for number in (0, 1, 2):
            try:
                os.fstat(number)
            except OSError:
                continue
            ctx.install_fd(proc.vpid, number, number)

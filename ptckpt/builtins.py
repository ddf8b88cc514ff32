"""Built-in virtualisation, each a plugin on the public API (ptckpt.plugins).

* :class:`SetEnv` -- ``restore --set-env NAME=VALUE`` / ``--unset-env NAME``: after
  the restore getenv() in every process of the tree returns the new values (the
  environment is rewritten through libc's `environ`, by :meth:`ProcessHandle.set_environ`).
* :class:`External` -- ``dump --external tcp:HOST:PORT|unix:PATH|fd:N``: those
  connections lead outside the checkpoint (an emulator, a licence server, an X
  server): not saved, marked external with the address they went to.
* :class:`Reconnect` -- ``restore --reconnect [--remap-addr OLD=NEW]``: claims every
  external connection that has an address, dials it again (or its NEW address) and
  installs the new socket at the same fd.
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
import fcntl
import json
import logging
import os
import random
import socket
from collections.abc import Sequence

from . import faults
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

    def __init__(self, specs: Sequence[str]):
        self.specs = []
        for spec in specs:
            kind, sep, rest = spec.partition(":")
            if kind not in ("tcp", "unix", "fd") or not sep or not rest:
                raise UsageError(f"--external {spec!r}: expected tcp:HOST:PORT, unix:PATH or fd:N")
            if kind == "fd" and not rest.isdigit():
                raise UsageError(f"--external {spec!r}: N must be an fd number")
            self.specs.append((kind, rest))

    def frozen(self, proc, ctx) -> None:
        for f in proc.fds:
            address = peer_address(f)
            for kind, rest in self.specs:
                if (kind == "fd" and f.fd == int(rest)) or (address and address == f"{kind}:{rest}"):
                    ctx.claim_external(proc.vpid, f.fd, address or f"fd:{f.fd}")


def peer_address(f) -> str:
    """tcp:HOST:PORT or unix:PATH of the peer a socket fd was connected to, "" if none."""
    if f.kind.name != "SOCKET":
        return ""
    peer = dict(f.details).get("peer", "")
    family = dict(f.details).get("family", "")
    if family == "AF_UNIX":
        return f"unix:{peer}" if peer and peer.startswith("/") else ""
    if family in ("AF_INET", "AF_INET6") and peer.startswith("("):
        host, port = ast.literal_eval(peer)[:2]
        return f"tcp:{host}:{port}"
    return ""


class Reconnect(Plugin):
    name = "reconnect"
    version = "1"
    recorded = False

    def __init__(self, remaps: Sequence[str] = ()):
        self.remaps = dict(self._remap(r) for r in remaps)

    @staticmethod
    def _remap(value: str) -> tuple[str, str]:
        for kind in ("tcp:", "unix:"):
            at = value.find("=" + kind)
            if value.startswith(("tcp:", "unix:")) and at > 0:
                return value[:at], value[at + 1:]
        raise UsageError(f"--remap-addr {value!r}: expected OLD=NEW, each tcp:HOST:PORT or unix:PATH")

    def _targets(self, proc):
        return [f for f in proc.fds if f.external.startswith(("tcp:", "unix:"))]

    def pre_restore(self, proc, ctx) -> None:
        for f in self._targets(proc):
            ctx.claim_external(proc.vpid, f.fd)

    def restored(self, proc, ctx) -> None:
        for f in self._targets(proc):
            address = self.remaps.get(f.external, f.external)
            with dial(address) as sock:
                fcntl.fcntl(sock.fileno(), fcntl.F_SETFL, f.flags & os.O_NONBLOCK)
                proc.install_fd(f.fd, sock.fileno())


def dial(address: str) -> socket.socket:
    """A connected stream socket to tcp:HOST:PORT or unix:PATH (blocking)."""
    kind, _, rest = address.partition(":")
    try:
        if kind == "tcp":
            host, _, port = rest.rpartition(":")
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(rest)
    except OSError as err:
        raise OSError(err.errno, f"cannot reconnect to {address}: {err.strerror}") from None
    sock.settimeout(None)
    return sock


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
        task = dataclasses.replace(proc_image.task, cwd=r(proc_image.task.cwd), exe=r(proc_image.task.exe),
                                   root=r(proc_image.task.root))
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

"""The network lock: nftables rules that silence TCP connections while they are checkpointed.

From the moment a TCP connection is frozen (TCP_REPAIR) until it is restored,
or until a failed dump lets the target run on, the peer must see nothing: no
ACK, no RST.  Every packet of a locked connection is dropped, in both
directions, so the peer just retransmits, and the connection survives as long
as the peer keeps retransmitting (minutes, tcp_retries2).

One lock is one nft table of ptckpt's own, ``table inet ptckpt-<id>``, made,
filled and removed by ``nft -f -`` transactions (one rule set per dump)::

    table inet ptckpt-<id> {
        comment "ptckpt network lock, owner pid N (see set lockinfo)"
        set lockinfo { type inet_service;
            elements = { 0 comment "<header>", 1 comment "<dir part>", ... } }
        set conns4 { type ipv4_addr . inet_service . ipv4_addr . inet_service;
            elements = { SRC . SPORT . DST . DPORT comment "ino=.. reuseaddr=..", ... } }
        set conns6 { type ipv6_addr . inet_service . ipv6_addr . inet_service; ... }
        chain lock_out { type filter hook output priority -300; policy accept;
            meta mark PTCKPT_MARK accept
            ip saddr . tcp sport . ip daddr . tcp dport @conns4 drop
            ip6 saddr . tcp sport . ip6 daddr . tcp dport @conns6 drop }
        chain lock_in { type filter hook input priority 150; policy accept;
            meta mark PTCKPT_MARK accept
            ip daddr . tcp dport . ip saddr . tcp sport @conns4 drop
            ip6 daddr . tcp dport . ip6 saddr . tcp sport @conns6 drop }
    }

Each connection is ONE set element, (local addr, local port, remote addr,
remote port) as the dumped socket sees it: the output chain matches it as
(saddr, sport, daddr, dport), the input chain as (daddr, dport, saddr, sport).
A set lookup costs the same for 1 or 10,000 connections, and 1,000 of them
lock in one transaction (measured, Linux 6.18, nft 1.0.6, medians of 10: lock
1 connection 4 ms, 1,000 16 ms, 10,000 133 ms; unlock 12-30 ms whatever the
size: the kernel's teardown of a table costs that even for an empty one).
An IPv4-mapped IPv6 connection (``::ffff:a.b.c.d`` on an AF_INET6 socket)
travels as IPv4 packets, so it goes into conns4, its element comment saying
``v4mapped`` so that list_locks() gives it back as it was given.

Chain priorities
----------------
* output, -300 (the "raw" priority): before conntrack (-200), so conntrack
  never sees what is dropped, and before the output DNAT hook (-100), so the
  packet still carries the addresses the socket has (a connection to a
  locally DNATed address - a kube-proxy service IP, a Docker published
  port - would not match after it).
* input, 150: after the input SNAT hook (NF_IP_PRI_NAT_SRC, 100).  That hook
  is where the kernel undoes the DNAT of a locally originated connection on
  its replies (the source goes back from the backend to the address the
  socket connected to), so only after it does an incoming packet carry the
  socket's addresses.  Conntrack sees the dropped input packets; that is
  harmless (the peer retransmits them unchanged).  (The NAT cases are read
  from the kernel's hook order, net/netfilter/nf_nat_proto.c; the tests only
  cover plain loopback, where both priorities see the same addresses.)
A drop is final whatever other tables do: an accept in another base chain
does not end the traversal of ours.

The mark
--------
Both chains first accept packets whose mark (SO_MARK) is exactly
:data:`PTCKPT_MARK`: the few packets ptckpt sends itself on a locked
connection (a FIN during restore ...) must pass.  On loopback the mark
survives from output to input, so the input rule matters there too.  The
value spells "ptck"; tools that mark packets use a few low or high bits
under a mask, so an exact match on this value will not catch theirs.

Where the metadata lives, and what a SIGKILL leaves behind
----------------------------------------------------------
The single source of truth is the nft table itself; there is no state file.
The owner (pid, start time from /proc/self/stat field 22, pid namespace
inode), the creation time and the image directory are the comments of set
``lockinfo`` (element 0 the header, elements 1..n the image directory,
percent-encoded, 120 characters a part: nft caps every comment at 128
characters, and a path can be 4096 bytes); each connection's socket inode and
SO_REUSEADDR are its element's comment.  ``nft -j`` (JSON) shows element
comments; nft 1.0.6 leaves table comments out of JSON, so the table comment
is only a hint for people reading ``nft list ruleset``.

Each operation is one nft transaction, which the kernel commits whole or not
at all (the batch is applied on its END message, and nft sends the whole
batch in one sendmsg - seen with strace for 10,000 elements, 524 kB - so a
killed nft leaves nothing), and no operation needs a second step to be
consistent:

* lock(): before the commit nothing exists; after it, the table exists with
  its rules, its metadata and every connection's ino/reuseaddr.  A dumper
  killed at any instant leaves either no lock or a complete one.  (Its
  caller must read ino and SO_REUSEADDR before it calls lock() and put the
  sockets in repair mode only after: then every socket in repair mode is
  described by a lock.)
* add(): the new elements come with their comments, atomically.
* unlock(): one ``delete table``: locked with all metadata, or gone.
A state file under /run would need two steps (file, then table; table,
then file) and a rule for each window between them; the table alone has no
window.

list_locks() reads every ``inet ptckpt-*`` table of this network namespace;
owner_alive() says whether its owner (pid AND start time, so a reused pid
does not count) still runs; a lock made from another pid namespace cannot
be checked and counts as alive.  What to do about a stale lock (sockets left in
repair mode, the lock itself) is the caller's decision.  A lock is per
network namespace: a process in another one neither sees nor is blocked by it.

Errors: every failure is a :class:`NetLockError` (exit code MISSING_FEATURE:
the network lock, which checkpointing TCP needs, cannot be made to work
here) carrying nft's stderr in one line; :class:`NetLockUnavailable` when nft
is missing or cannot run, :class:`NetLockGone` when add() finds the lock
removed.  Bad arguments raise :class:`~ptckpt.errors.UsageError`.  No
OSError, subprocess or JSON exception leaves this module.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

from ptckpt import procfs
from ptckpt.errors import ExitCode, PtckptError, UsageError

log = logging.getLogger("ptckpt.netlock")

PTCKPT_MARK = 0x7074636B          # SO_MARK of the packets ptckpt sends itself ("ptck")

TABLE_FAMILY = "inet"
TABLE_PREFIX = "ptckpt-"
OUTPUT_PRIORITY = -300            # before conntrack (-200) and output DNAT (-100)
INPUT_PRIORITY = 150              # after input SNAT (100), which un-DNATs replies

FORMAT = "ptckpt-netlock/1"       # first word of the lockinfo header

_SET4 = "conns4"
_SET6 = "conns6"
_INFO = "lockinfo"
_CHAIN_OUT = "lock_out"
_CHAIN_IN = "lock_in"
_COMMENT_MAX = 128                # nft: "comment too long, 128 characters maximum allowed"
_DIR_PART = 120                   # characters of the encoded image dir per lockinfo element
_NFT_TIMEOUT = 60.0               # seconds; a transaction takes milliseconds
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
_MISSING_HINT = "nft is not installed: apt-get install nftables"


# --- errors of this layer ---------------------------------------------------------

class NetLockError(PtckptError):
    """An nft operation of the network lock failed (``reason`` is nft's stderr, one line)."""

    exit_code = ExitCode.MISSING_FEATURE

    def __init__(self, what: str, reason: str):
        super().__init__(f"network lock: {what}: {reason}")
        self.what = what
        self.reason = reason


class NetLockUnavailable(NetLockError):
    """nft is not installed, cannot run, or this kernel / user cannot use nf_tables."""


class NetLockGone(NetLockError):
    """The lock's table no longer exists (someone unlocked it)."""


# --- records ----------------------------------------------------------------------

def _parse_addr(value, family: int, what: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        addr = ipaddress.ip_address(value)
    except ValueError:
        raise UsageError(f"connection {what} {value!r} is not an IP address") from None
    want = 4 if family == socket.AF_INET else 6
    if addr.version != want:
        raise UsageError(f"connection {what} {value} is not an IPv{want} address "
                         f"(family {socket.AddressFamily(family).name})")
    return addr


def _check_int(value, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"connection {what} {value!r} is not an integer in {low}..{high}")
    return value


@dataclass(frozen=True, slots=True)
class Connection:
    """One TCP connection as the dumped side sees it: src/sport local, dst/dport remote.

    Addresses are normalised (``ipaddress`` text form) at construction.
    ``ino`` and ``reuseaddr`` are not part of the match: they are recorded in
    the lock so that a later command can find the socket and undo repair mode.
    """

    family: int            # socket.AF_INET / AF_INET6
    src: str
    sport: int
    dst: str
    dport: int
    ino: int = 0           # the dumped socket's inode
    reuseaddr: int = 0     # its SO_REUSEADDR before repair mode

    def __post_init__(self):
        if self.family not in (socket.AF_INET, socket.AF_INET6):
            raise UsageError(f"connection family {self.family!r} is neither AF_INET nor AF_INET6")
        src = _parse_addr(self.src, self.family, "source")
        dst = _parse_addr(self.dst, self.family, "destination")
        if self.family == socket.AF_INET6 and (src.ipv4_mapped is None) != (dst.ipv4_mapped is None):
            raise UsageError(f"connection {src} -> {dst}: one address is IPv4-mapped, the other not")
        object.__setattr__(self, "src", str(src))
        object.__setattr__(self, "dst", str(dst))
        _check_int(self.sport, "source port", 0, 65535)
        _check_int(self.dport, "destination port", 0, 65535)
        _check_int(self.ino, "inode", 0, 2**64 - 1)
        _check_int(self.reuseaddr, "reuseaddr", 0, 2**31 - 1)

    @property
    def v4mapped(self) -> bool:
        """An AF_INET6 socket talking IPv4 (::ffff:a.b.c.d at both ends)."""
        return (self.family == socket.AF_INET6
                and ipaddress.IPv6Address(self.src).ipv4_mapped is not None)

    @property
    def key(self) -> tuple[int, str, int, str, int]:
        """(4 or 6, src, sport, dst, dport) as the packets carry them: what the lock matches."""
        if self.v4mapped:
            return (4, str(ipaddress.IPv6Address(self.src).ipv4_mapped), self.sport,
                    str(ipaddress.IPv6Address(self.dst).ipv4_mapped), self.dport)
        version = 4 if self.family == socket.AF_INET else 6
        # nft takes no zone index (fe80::1%eth0): packets carry none either
        return (version, self.src.split("%")[0], self.sport, self.dst.split("%")[0], self.dport)

    def __str__(self) -> str:
        def ep(addr, port):
            return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        return f"{ep(self.src, self.sport)} -> {ep(self.dst, self.dport)}"


@dataclass(frozen=True, slots=True)
class NetLock:
    """A lock this process made (lock()) or extended (add())."""

    id: str
    connections: tuple[Connection, ...]
    image_dir: str = ""

    @property
    def table(self) -> str:
        return TABLE_PREFIX + self.id


@dataclass(frozen=True, slots=True)
class LockInfo:
    """A lock as found in nftables by list_locks(), whoever made it."""

    id: str
    owner_pid: int
    owner_start_time: int       # clock ticks after boot (/proc/PID/stat field 22)
    owner_pidns: int            # inode of the owner's pid namespace, 0 if unknown
    image_dir: str
    created: float              # time.time() when the lock was made
    connections: tuple[Connection, ...]

    @property
    def table(self) -> str:
        return TABLE_PREFIX + self.id


# --- running nft ------------------------------------------------------------------

def _nft_path() -> str | None:
    path = os.environ.get("PATH") or os.defpath
    return shutil.which("nft", path=path + os.pathsep + "/usr/sbin:/sbin")


def _one_line(stderr: str) -> str:
    """nft's error output in one line: its "Error:" lines, without the echoed input and carets."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = []
    for ln in lines:
        if "Error:" in ln:
            msg = ln.split("Error:", 1)[1].strip()
            if msg not in errors:
                errors.append(msg)
    text = "; ".join(errors) if errors else " | ".join(lines)
    text = text or "nft failed without a message"
    return text if len(text) <= 400 else text[:397] + "..."


def _failure(what: str, stderr: str) -> NetLockError:
    reason = _one_line(stderr)
    if "Operation not permitted" in reason:
        return NetLockUnavailable(what, f"{reason} (nft needs root / CAP_NET_ADMIN)")
    if any(s in reason for s in ("Protocol not supported", "Address family not supported",
                                 "Operation not supported")):
        return NetLockUnavailable(what, f"{reason} (kernel without nf_tables?)")
    return NetLockError(what, reason)


def _run_nft(args: list[str], script: str | None, what: str) -> str:
    """Run nft with args (script on stdin); its stdout, or raise NetLockError."""
    nft = _nft_path()
    if nft is None:
        raise NetLockUnavailable(what, _MISSING_HINT)
    try:
        proc = subprocess.run([nft, *args], input=script, capture_output=True, text=True,
                              errors="replace", timeout=_NFT_TIMEOUT,
                              stdin=None if script is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise NetLockError(what, f"nft did not finish in {_NFT_TIMEOUT:g} s") from None
    except OSError as err:
        raise NetLockUnavailable(what, f"cannot run {nft}: {err.strerror or err}") from err
    if proc.returncode != 0:
        raise _failure(what, proc.stderr)
    return proc.stdout


def _run_script(script: str, what: str, *, check_only: bool = False) -> None:
    _run_nft(["--check", "-f", "-"] if check_only else ["-f", "-"], script, what)


def _json(text: str, what: str) -> list[dict]:
    try:
        doc = json.loads(text)
        items = doc["nftables"]
        if not isinstance(items, list):
            raise TypeError("'nftables' is not a list")
        return items
    except (ValueError, KeyError, TypeError) as err:
        raise NetLockError(what, f"cannot parse nft's JSON output: {err}") from None


# --- building scripts -------------------------------------------------------------

def _table_ref(table: str) -> str:
    return f"{TABLE_FAMILY} {table}"


def _check_comment(text: str) -> str:
    # every comment is built here from digits, words and percent-encoded text
    assert len(text) <= _COMMENT_MAX and '"' not in text and "\n" not in text, text
    return text


def _conn_comment(conn: Connection) -> str:
    text = f"ino={conn.ino} reuseaddr={conn.reuseaddr}"
    if conn.v4mapped:
        text += " v4mapped"
    return _check_comment(text)


def _add_elements(table: str, conns: Iterable[Connection]) -> list[str]:
    """`add element` statements (one per set that gets any) for the connections."""
    per_set: dict[str, list[str]] = {_SET4: [], _SET6: []}
    for conn in conns:
        version, src, sport, dst, dport = conn.key
        per_set[_SET4 if version == 4 else _SET6].append(
            f'{src} . {sport} . {dst} . {dport} comment "{_conn_comment(conn)}"')
    return [f"add element {_table_ref(table)} {name} {{ " + ",\n  ".join(elems) + " }"
            for name, elems in per_set.items() if elems]


def _encode_dir(image_dir: str) -> list[str]:
    encoded = urllib.parse.quote(os.fsencode(image_dir), safe="/")
    return [encoded[i:i + _DIR_PART] for i in range(0, len(encoded), _DIR_PART)]


def _decode_dir(parts: list[str]) -> str:
    return os.fsdecode(urllib.parse.unquote_to_bytes("".join(parts)))


def _lockinfo_comments(pid: int, start: int, pidns: int, created: float, image_dir: str) -> list[str]:
    parts = _encode_dir(image_dir)
    header = (f"{FORMAT} pid={pid} start={start} pidns={pidns} "
              f"created={created:.6f} dirparts={len(parts)}")
    return [_check_comment(header)] + [_check_comment(p) for p in parts]


def _create_script(table: str, info: list[str], conns: Iterable[Connection], owner_pid: int) -> str:
    t = _table_ref(table)
    set_type4 = "ipv4_addr . inet_service . ipv4_addr . inet_service"
    set_type6 = "ipv6_addr . inet_service . ipv6_addr . inet_service"
    info_elems = ", ".join(f'{i} comment "{c}"' for i, c in enumerate(info))
    mark = f"meta mark {PTCKPT_MARK:#x} accept"
    lines = [
        # `create` fails if the table exists: an id is never reused behind a live lock
        f'create table {t} {{ comment "ptckpt network lock, owner pid {owner_pid} '
        f'(see set {_INFO})"; }}',
        f"add set {t} {_INFO} {{ type inet_service; }}",
        f"add element {t} {_INFO} {{ {info_elems} }}",
        f"add set {t} {_SET4} {{ type {set_type4}; }}",
        f"add set {t} {_SET6} {{ type {set_type6}; }}",
        *_add_elements(table, conns),
        f"add chain {t} {_CHAIN_OUT} {{ type filter hook output priority {OUTPUT_PRIORITY}; "
        f"policy accept; }}",
        f"add rule {t} {_CHAIN_OUT} {mark}",
        f"add rule {t} {_CHAIN_OUT} ip saddr . tcp sport . ip daddr . tcp dport @{_SET4} drop",
        f"add rule {t} {_CHAIN_OUT} ip6 saddr . tcp sport . ip6 daddr . tcp dport @{_SET6} drop",
        f"add chain {t} {_CHAIN_IN} {{ type filter hook input priority {INPUT_PRIORITY}; "
        f"policy accept; }}",
        f"add rule {t} {_CHAIN_IN} {mark}",
        f"add rule {t} {_CHAIN_IN} ip daddr . tcp dport . ip saddr . tcp sport @{_SET4} drop",
        f"add rule {t} {_CHAIN_IN} ip6 daddr . tcp dport . ip6 saddr . tcp sport @{_SET6} drop",
    ]
    return "\n".join(lines) + "\n"


def _unique(conns: Iterable[Connection], seen: set | None = None) -> list[Connection]:
    """The connections whose key is not in `seen` (nor earlier in conns); updates `seen`."""
    seen = set() if seen is None else seen
    out = []
    for conn in conns:
        if not isinstance(conn, Connection):
            raise UsageError(f"{conn!r} is not a netlock.Connection")
        if conn.key not in seen:
            seen.add(conn.key)
            out.append(conn)
    return out


# --- the owner --------------------------------------------------------------------

def _own_pidns() -> int:
    try:
        return procfs.stat_namespace("self", "pid").st_ino
    except (OSError, PtckptError):
        return 0


def _start_time(pid: int) -> int:
    return procfs.read_stat(pid).start_time


# --- public API -------------------------------------------------------------------

def lock(connections: Iterable[Connection], *, image_dir: str,
         lock_id: str | None = None) -> NetLock:
    """Block every packet of these connections, both ways, in one new table; the lock.

    The owner recorded is this process; image_dir is recorded (made absolute)
    for whoever cleans up a stale lock.  lock_id names the table
    ``ptckpt-<lock_id>`` (letters, digits, '-', '_'; a random one by
    default); an existing table of that name is an error.  An empty
    connection list is fine (add() fills it later).
    """
    conns = _unique(connections)
    if lock_id is None:
        lock_id = secrets.token_hex(6)
    elif not isinstance(lock_id, str) or not _ID_RE.match(lock_id):
        raise UsageError(f"network lock id {lock_id!r}: use 1-64 letters, digits, '-' or '_'")
    image_dir = os.path.abspath(os.fspath(image_dir))
    pid = os.getpid()
    what = f"lock {len(conns)} connection(s) (table {_table_ref(TABLE_PREFIX + lock_id)})"
    try:
        start = _start_time(pid)
    except PtckptError as err:
        raise NetLockError(what, f"cannot read this process's start time: {err}") from err
    info = _lockinfo_comments(pid, start, _own_pidns(), time.time(), image_dir)
    table = TABLE_PREFIX + lock_id
    t0 = time.perf_counter()
    _run_script(_create_script(table, info, conns, pid), what)
    log.debug("locked %d connection(s) in table %s in %.1f ms", len(conns), table,
              (time.perf_counter() - t0) * 1e3)
    return NetLock(lock_id, tuple(conns), image_dir)


def _lock_id(lock_or_id: NetLock | LockInfo | str) -> str:
    if isinstance(lock_or_id, (NetLock, LockInfo)):
        return lock_or_id.id
    if isinstance(lock_or_id, str) and _ID_RE.match(lock_or_id):
        return lock_or_id
    raise UsageError(f"{lock_or_id!r} is not a network lock or lock id")


def unlock(lock_or_id: NetLock | LockInfo | str) -> None:
    """Remove the lock: every connection of it passes again.  An absent lock is fine.

    One transaction that adds the table (a no-op when it exists) and deletes
    it: nft 1.0.6 has no `destroy`, and this needs no parsing of an error.
    """
    table = TABLE_PREFIX + _lock_id(lock_or_id)
    t = _table_ref(table)
    t0 = time.perf_counter()
    _run_script(f"add table {t}\ndelete table {t}\n", f"unlock (table {t})")
    log.debug("unlocked table %s in %.1f ms", table, (time.perf_counter() - t0) * 1e3)


def add(lock_: NetLock | LockInfo | str, connections: Iterable[Connection]) -> NetLock:
    """Add connections to an existing lock, atomically; the lock with all its connections.

    Connections it already holds (same addresses and ports) are skipped.  For
    a lock given by id, its connections are read from nft first.  Raises
    NetLockGone if the lock's table no longer exists.
    """
    lock_id = _lock_id(lock_)
    table = TABLE_PREFIX + lock_id
    what = f"add connections to table {_table_ref(table)}"
    if isinstance(lock_, str):
        found = _read_lock(table)
        if found is None:
            raise NetLockGone(what, "no such lock")
        lock_ = found
    old = tuple(lock_.connections)
    seen = {c.key for c in old}
    new = _unique(connections, seen)
    if new:
        script = "\n".join(_add_elements(table, new)) + "\n"
        try:
            _run_script(script, what)
        except NetLockError as err:
            if "No such file or directory" in err.reason:
                raise NetLockGone(what, f"the lock was removed ({err.reason})") from err
            raise
        log.debug("added %d connection(s) to table %s", len(new), table)
    return NetLock(lock_id, old + tuple(new), lock_.image_dir)


def _elements(set_obj: dict) -> list[tuple[object, str]]:
    """(value, comment) of each element of a set in nft's JSON."""
    out = []
    for item in set_obj.get("elem", ()):
        if isinstance(item, dict) and "elem" in item:
            out.append((item["elem"].get("val"), item["elem"].get("comment", "")))
        else:
            out.append((item, ""))
    return out


def _port(value) -> int:
    if isinstance(value, int):
        return value
    return socket.getservbyname(str(value), "tcp")


def _fields(text: str) -> dict[str, str]:
    return dict(w.split("=", 1) for w in text.split() if "=" in w)


def _connection(version: int, value, comment: str) -> Connection:
    src, sport, dst, dport = value["concat"]
    fields = _fields(comment)
    ino = int(fields.get("ino", 0))
    reuseaddr = int(fields.get("reuseaddr", 0))
    if version == 4 and "v4mapped" in comment.split():
        return Connection(socket.AF_INET6, f"::ffff:{src}", _port(sport), f"::ffff:{dst}",
                          _port(dport), ino, reuseaddr)
    family = socket.AF_INET if version == 4 else socket.AF_INET6
    return Connection(family, src, _port(sport), dst, _port(dport), ino, reuseaddr)


def _parse_lock(table: str, items: list[dict]) -> LockInfo | None:
    sets = {o["set"]["name"]: o["set"] for o in items
            if isinstance(o, dict) and "set" in o and o["set"].get("table") == table}
    info = dict(_elements(sets.get(_INFO, {})))
    header = info.get(0, "")
    if not isinstance(header, str) or not header.startswith("ptckpt-netlock/"):
        log.warning("table %s has no ptckpt lock header; not a lock of this ptckpt", table)
        return None
    fields = _fields(header)
    nparts = int(fields.get("dirparts", 0))
    parts = [info.get(i) for i in range(1, nparts + 1)]
    if any(not isinstance(p, str) for p in parts):
        raise ValueError(f"image directory parts missing in set {_INFO}")
    conns = [_connection(4, v, c) for v, c in _elements(sets.get(_SET4, {}))]
    conns += [_connection(6, v, c) for v, c in _elements(sets.get(_SET6, {}))]
    return LockInfo(id=table.removeprefix(TABLE_PREFIX), owner_pid=int(fields["pid"]),
                    owner_start_time=int(fields["start"]), owner_pidns=int(fields.get("pidns", 0)),
                    image_dir=_decode_dir(parts), created=float(fields.get("created", 0)),
                    connections=tuple(conns))


def _read_lock(table: str) -> LockInfo | None:
    """The lock in table, None if the table is gone (or not a ptckpt lock)."""
    what = f"read table {_table_ref(table)}"
    try:
        out = _run_nft(["-j", "list", "table", TABLE_FAMILY, table], None, what)
    except NetLockError as err:
        if type(err) is NetLockError and "No such file or directory" in err.reason:
            return None                 # unlocked meanwhile
        raise
    try:
        return _parse_lock(table, _json(out, what))
    except (KeyError, ValueError, TypeError, OSError) as err:
        log.warning("table %s: unreadable ptckpt lock metadata (%s); skipped", table, err)
        return None


def list_locks() -> list[LockInfo]:
    """Every ptckpt network lock of this network namespace, oldest first."""
    what = "list tables"
    items = _json(_run_nft(["-j", "list", "tables"], None, what), what)
    names = sorted(o["table"]["name"] for o in items
                   if isinstance(o, dict) and "table" in o
                   and o["table"].get("family") == TABLE_FAMILY
                   and str(o["table"].get("name", "")).startswith(TABLE_PREFIX))
    locks = [info for info in map(_read_lock, names) if info is not None]
    return sorted(locks, key=lambda i: (i.created, i.id))


def owner_alive(info: LockInfo) -> bool:
    """Whether the process that made the lock still runs (same pid AND same start time).

    A zombie counts as dead.  A lock made in another pid namespace cannot be
    checked from here: it counts as alive (the safe answer: it is not
    cleaned by mistake).
    """
    if info.owner_pidns and info.owner_pidns != _own_pidns():
        return True
    if info.owner_pid <= 0:
        return False
    try:
        st = procfs.read_stat(info.owner_pid)
    except PtckptError:
        return False                    # gone (NoSuchProcess) or unreadable
    return st.start_time == info.owner_start_time and st.state not in ("Z", "X")


def available() -> str | None:
    """None if network locks work here, else one line saying why not.

    Checks nft (``nft --check``: the kernel validates a whole lock
    transaction, v4 and v6 elements included, then discards it).
    """
    if _nft_path() is None:
        return _MISSING_HINT
    probe = [Connection(socket.AF_INET, "127.0.0.1", 1, "127.0.0.1", 2),
             Connection(socket.AF_INET6, "::1", 1, "::1", 2)]
    table = f"{TABLE_PREFIX}probe-{os.getpid()}"
    info = _lockinfo_comments(os.getpid(), 0, 0, time.time(), "/")
    try:
        _run_script(_create_script(table, info, probe, os.getpid()), "probe", check_only=True)
    except NetLockError as err:
        return err.reason
    return None

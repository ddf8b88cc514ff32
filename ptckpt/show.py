"""Backend of ``ptckpt show DIR``: an image as JSON-able data or as text tables.

Both open the image with :class:`~ptckpt.formats.image.ImageReader`, so a
corrupt image raises the same typed errors as a restore would.
"""

from __future__ import annotations

import dataclasses
import enum
import ast
import os
import stat
import socket
import zlib
from bisect import bisect_left
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import (GP_REG_NAMES, PAGE_SIZE, Fd, FdKind, GhostFile, InetMode, InetSocket, MemfdState,
                                  NetlinkSocket, PageRun, ProcessImage, SavedFile, ShmImage, Thread, UnixSocket, Vma)

from .resources import inet, netlink, tcp

_RIP = GP_REG_NAMES.index("rip")
_RSP = GP_REG_NAMES.index("rsp")

# Byte fields shown as {"size", "crc32"} rather than hex (they are kilobytes).
_BLOB_FIELDS = {(Thread, "xstate"), (GhostFile, "data"), (SavedFile, "data"), (MemfdState, "contents"),
                (ShmImage, "data"), (InetSocket, "recv_queue"), (InetSocket, "send_queue")}


def _json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, bool) or isinstance(value, (int, str)) or value is None:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    if dataclasses.is_dataclass(value):
        return record_to_json(value)
    raise TypeError(f"no JSON form for {type(value).__name__}")


def _blob(data: bytes) -> dict[str, int]:
    return {"size": len(data), "crc32": zlib.crc32(data)}


def record_to_json(record: Any) -> dict[str, Any]:
    """One record as a dict: enums by name, bytes as hex (xstate as size + crc32)."""
    out: dict[str, Any] = {}
    cls = type(record)
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if (cls, f.name) in _BLOB_FIELDS:
            out[f.name] = _blob(value)
        elif cls is Thread and f.name == "regs":
            out[f.name] = dict(zip(GP_REG_NAMES, value))
        elif cls is InetSocket and f.name == "mode":
            out[f.name] = _enum_name(InetMode, value)
        elif cls is InetSocket and f.name == "datagrams":
            out[f.name] = [{"sender": host, "port": port, **_blob(payload)} for host, port, payload in value]
        else:
            out[f.name] = _json_value(value)
    return out


def _enum_name(cls: type[enum.Enum], value: Any) -> Any:
    """An enum member's name; a number the enum does not know stays a number."""
    try:
        return cls(value).name
    except ValueError:
        return value


def _socket_holders(procs: Sequence[ProcessImage]) -> dict[int, list[tuple[int, int]]]:
    """Socket inode -> the (pid, fd) pairs holding it, in process and fd order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for p in procs:
        for f in p.fds:
            if f.kind is FdKind.SOCKET:
                out.setdefault(f.ino, []).append((p.task.pid, f.fd))
    return out


def _socket_json(record: Any, holders: dict[int, list[tuple[int, int]]]) -> dict[str, Any]:
    out = record_to_json(record)
    out["holders"] = [list(h) for h in holders.get(record.ino, ())]
    if isinstance(record, InetSocket) and record.protocol == socket.IPPROTO_TCP:
        out["state_name"] = tcp.state_name(record.state)
    return out


def _pages_json(reader: ImageReader, pid: int) -> dict[str, Any]:
    runs = reader.page_runs(pid)
    total = sum(r.npages for r in runs)
    return {
        "run_count": len(runs),
        "total_pages": total,
        "total_bytes": total * PAGE_SIZE,
        "data_bytes": reader.pages_length(pid),       # this image's own, uncompressed
        "stored_bytes": reader.stored_length(pid),    # as in pages-PID.img
        "compression": reader.compression(pid),       # "zstd:LEVEL" or ""
        "parent_pages": sum(p.npages for p in reader.parent_pages(pid)),
        "crc32": reader.pages_crc32(pid),
        "runs": [record_to_json(r) for r in runs],
    }


def _storage_lines(reader: ImageReader) -> str:
    """How the page data is kept: per process raw and stored bytes, the chain of parents."""
    inv = reader.inventory
    lines = []
    if inv.memory_only:
        lines.append("a pre-dump: memory only, the parent of a later dump --prev")
    if inv.parent:
        lines.append("incremental, on " + " <- ".join(_printable(p) for p in reader.chain()[1:]))
    for pid in reader.pids:
        raw, stored, how = reader.pages_length(pid), reader.stored_length(pid), reader.compression(pid)
        inherited = sum(p.npages for p in reader.parent_pages(pid)) * PAGE_SIZE
        lines.append(f"page data of {pid}: {raw} bytes, stored in {stored}"
                     + (f" ({how}, {stored / raw:.1%})" if how and raw else "")
                     + (f"; {inherited} bytes unchanged, in the parents" if inherited else ""))
    return "\n".join(lines)


def _pid_rows(reader: ImageReader) -> list[dict[str, Any]]:
    """Every process and thread: its virtual pid (the image's) and the real one at dump."""
    real = dict(reader.inventory.real_pids)
    return [{"virtual": tid, "real": real.get(tid, tid), "process": pid}
            for pid in reader.pids for tid in reader.process(pid).task.tids]


def _process_json(reader: ImageReader, pid: int) -> dict[str, Any]:
    proc = reader.process(pid)
    return {
        "pid": pid,
        "task": record_to_json(proc.task),
        "creds": record_to_json(proc.creds),
        "mm": record_to_json(proc.mm),
        "rlimits": [record_to_json(r) for r in proc.rlimits],
        "vmas": [record_to_json(v) for v in proc.vmas],
        "threads": [record_to_json(t) for t in proc.threads],
        "sigactions": [record_to_json(s) for s in proc.sigactions],
        "pending_signals": [record_to_json(p) for p in proc.pending],
        "fds": [record_to_json(f) for f in proc.fds],
        "fd_owners": [record_to_json(o) for o in proc.owners],
        "aio_rings": [record_to_json(r) for r in proc.aio_rings],
        "unknown_entries": [{"kind": e.kind, "size": len(e.payload)} for e in reader.unknown_entries(pid)],
        "pages": _pages_json(reader, pid),
    }


def image_to_json(directory: str | os.PathLike) -> dict[str, Any]:
    """The whole image as JSON-able data; page bytes and TCP queues are summarised
    ({"size", "crc32"}), not included; sockets carry the (pid, fd) pairs holding them.

    Example: ``json.dumps(image_to_json("/tmp/ckpt"), indent=2)``.
    Strings keep undecodable path bytes as surrogate escapes (json.dumps
    writes them as \\udcXX; os.fsencode of the loaded string gives the bytes back).
    """
    with ImageReader(directory) as reader:
        holders = _socket_holders([reader.process(pid) for pid in reader.pids])
        return {
            "path": reader.path,
            "format_version": reader.version,
            "inventory": record_to_json(reader.inventory),
            "chain": reader.chain(),
            "pids": _pid_rows(reader),
            "processes": [_process_json(reader, pid) for pid in reader.pids],
            "zombies": [record_to_json(z) for z in reader.zombies],
            "pipes": [record_to_json(p) for p in reader.pipes],
            "unix_sockets": [_socket_json(u, holders) for u in reader.unix_sockets],
            "inet_sockets": [_socket_json(r, holders) for r in reader.inet_sockets],
            "netlink_sockets": [_socket_json(r, holders) for r in reader.netlink_sockets],
            "in_flight": [record_to_json(f) for f in reader.in_flight],
            "sysv": [dict(record_to_json(o), record=type(o).__name__) for o in reader.sysv],
            "ghost_files": [record_to_json(g) for g in reader.ghost_files],
            "saved_files": [record_to_json(f) for f in reader.saved_files],
            "fd_states": [dict(record_to_json(st), record=type(st).__name__) for st in reader.fd_states],
            "terminals": [record_to_json(t) for t in reader.terminals],
            "ptys": [record_to_json(t) for t in reader.ptys],
        }


# --- text ----------------------------------------------------------------------

def _printable(text: str) -> str:
    """Undecodable bytes as \\xNN, control characters escaped, so a table stays one line per row."""
    raw = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in raw)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()) -> str:
    """Aligned columns; `right` lists the column indexes to right-align (numbers)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in cells])


def _prot(vma: Vma) -> str:
    return ("r" if vma.prot & 1 else "-") + ("w" if vma.prot & 2 else "-") + \
        ("x" if vma.prot & 4 else "-") + ("s" if vma.shared else "p")


def _name(value: Any) -> str:
    return value.name if isinstance(value, enum.Enum) else str(value)


def _pages_in(runs: list[PageRun], starts: list[int], vma: Vma) -> int:
    """Saved pages inside [vma.start, vma.end) (runs sorted by vaddr)."""
    i = max(bisect_left(starts, vma.start) - 1, 0)
    total = 0
    while i < len(runs) and runs[i].vaddr < vma.end:
        run = runs[i]
        lo = max(run.vaddr, vma.start)
        hi = min(run.vaddr + run.npages * PAGE_SIZE, vma.end)
        if hi > lo:
            total += (hi - lo) // PAGE_SIZE
        i += 1
    return total


def _section(title: str, body: str) -> str:
    return f"{title}\n{body}"


def _process_tables(proc: ProcessImage, runs: list[PageRun]) -> list[str]:
    pid = proc.task.pid
    runs = sorted(runs, key=lambda r: r.vaddr)
    starts = [r.vaddr for r in runs]
    threads = _table(
        ["TID", "RIP", "RSP", "RESTART", "SYSCALL", "COMM"],
        [[t.tid, f"{t.regs[_RIP]:#x}", f"{t.regs[_RSP]:#x}",
          _name(t.restart),
          t.syscall_nr if t.syscall_nr >= 0 else "-",
          _printable(t.comm)]
         for t in proc.threads],
        right=(0, 4))
    vmas = _table(
        ["START-END", "PROT", "KIND", "PAGES", "PATH"],
        [[f"{v.start:012x}-{v.end:012x}", _prot(v), _name(v.kind), _pages_in(runs, starts, v),
          _printable(v.path) + (" (deleted)" if v.file_deleted and not v.path.endswith(" (deleted)") else "")]
         for v in proc.vmas],
        right=(3,))
    fds = _table(
        ["FD", "KIND", "FLAGS", "POS", "PATH"],
        [[f.fd, _name(f.kind), f"0{f.flags:o}", f.pos, _printable(f.path)] for f in proc.fds],
        right=(0, 2, 3))
    saved = sum(r.npages for r in runs)
    return [
        _section(f"threads of {pid}:", threads),
        _section(f"memory of {pid} ({len(proc.vmas)} VMAs, {saved} pages = {saved * PAGE_SIZE} bytes saved "
                 f"in {len(runs)} runs):", vmas),
        _section(f"files of {pid}:", fds),
    ]


def _shared_table(reader: ImageReader) -> str:
    """One row per image-wide record: zombies, pipes, files, terminals, SysV objects
    (sockets have a table of their own)."""
    rows = []
    for z in reader.zombies:
        rows.append(["zombie", z.pid, f"child of {z.ppid}, wait status {z.wait_status:#x}"])
    for p in reader.pipes:
        rows.append(["fifo" if p.path else "pipe", p.ino,
                     f"{len(p.data)} bytes buffered of {p.capacity}" + (f", {_printable(p.path)}" if p.path else "")])
    for g in reader.ghost_files:
        what = ("directory" if stat.S_ISDIR(g.mode) else f"{max(g.size, len(g.data))} bytes"
                + (f", {len(g.data)} of data" if g.extents else ""))
        rows.append(["ghost file", g.ino, f"{_printable(g.path)} (deleted), {what}"])
    for f in reader.saved_files:
        rows.append(["saved file", "-", f"{_printable(f.path)}, {len(f.data)} bytes"])
    for st in reader.fd_states:
        rows.append([type(st).__name__.removesuffix("State").lower(), st.desc, "open file description"])
    for t in reader.terminals:
        rows.append(["terminal", t.desc, f"{t.cols}x{t.rows}, foreground group {t.fg_pgrp}"
                     + (", controlling" if t.controlling else "")])
    for t in reader.ptys:
        rows.append(["pty master", t.desc, f"/dev/pts/{t.index}, {t.cols}x{t.rows}, session {t.sid}, "
                     f"foreground group {t.fg_pgrp}, {len(t.output)} bytes unread"])
    for o in reader.sysv:
        kind = type(o).__name__.removesuffix("Image").lower()
        ident = getattr(o, "shmid", getattr(o, "semid", getattr(o, "msqid", 0)))
        rows.append([f"sysv {kind}", ident, f"key {o.key:#x}"])
    return _table(["KIND", "ID", "WHAT"], rows, right=(1,)) if rows else ""


# --- the sockets table ----------------------------------------------------------------

_SOCK_TYPES = {socket.SOCK_STREAM: "stream", socket.SOCK_DGRAM: "dgram", socket.SOCK_SEQPACKET: "seqpacket",
               socket.SOCK_RAW: "raw"}
_FAMILIES = {socket.AF_INET: "IPv4", socket.AF_INET6: "IPv6", socket.AF_UNIX: "unix", socket.AF_NETLINK: "netlink"}
_SHUTDOWN = {1: "shut rd", 2: "shut wr", 3: "shut rdwr"}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _inet_row(r: InetSocket, where: str) -> list[str]:
    is_tcp = r.protocol == socket.IPPROTO_TCP and not inet.is_raw(r)
    local = inet.endpoint(r.src, r.sport) if r.src or r.sport else "-"
    connected = r.state == 1 if inet.is_ping(r.protocol) or inet.is_raw(r) else bool(r.dport)
    peer = inet.endpoint(r.dst, r.dport) if connected else "-"
    if inet.is_raw(r):
        local, peer = r.src or "-", r.dst if connected else "-"
        state = "connected" if connected else "bound" if r.src else "unbound"
        recv = send = "-"
    elif not is_tcp:
        state = "connected" if connected else "bound" if r.sport else "unbound"
        size = sum(len(d[2]) for d in r.datagrams)
        recv, send = f"{size} ({_plural(len(r.datagrams), 'dgram')})", "-"
    else:
        state = tcp.state_name(r.state)
        if r.mode == InetMode.REPAIRED:
            state += ", repaired"
        elif r.mode == InetMode.CLOSED:
            state = "closed (comes back reset)"
        elif r.mode == InetMode.PENDING:
            state += f", queued on {where}"
        elif r.state == tcp.LISTEN:
            state += f" (backlog {r.backlog})"
        elif r.state == tcp.CLOSE:
            state = "bound" if r.sport else "unbound"
        if r.mode in (InetMode.REPAIRED, InetMode.PENDING):
            recv = str(len(r.recv_queue))
            send = str(len(r.send_queue)) + (f" ({r.unsent} unsent)" if r.unsent else "")
        else:
            recv = send = "-"                # a listener, an unconnected socket; a closed one's are dropped
    if r.shutdown in _SHUTDOWN and r.mode != InetMode.CLOSED:
        state += f", {_SHUTDOWN[r.shutdown]}"
    kind = inet.proto_name(r.type, r.protocol)
    return [_FAMILIES.get(r.family, str(r.family)), kind, local, peer, state, recv, send]


def _unix_name(name: bytes) -> str:
    return _printable(os.fsdecode(name.replace(b"\0", b"@", 1))) if name else "-"


def _unix_row(u: UnixSocket) -> list[str]:
    if u.state == tcp.LISTEN:
        state = f"LISTEN (backlog {u.backlog})"
    elif u.peer or u.peer_name:
        state = "ESTABLISHED" if u.type != socket.SOCK_DGRAM else "connected"
    else:
        state = "unconnected"
    if u.shutdown in _SHUTDOWN:
        state += f", {_SHUTDOWN[u.shutdown]}"
    peer = _unix_name(u.peer_name) if u.peer_name else f"socket:[{u.peer}]" if u.peer else "-"
    size = sum(map(len, u.queue))
    recv = str(size) if u.type == socket.SOCK_STREAM else f"{size} ({_plural(len(u.queue), 'msg')})"
    return ["unix", _SOCK_TYPES.get(u.type, str(u.type)), _unix_name(u.name), peer, state, recv, "-"]


def _netlink_row(r: NetlinkSocket) -> list[str]:
    proto = netlink.PROTOCOLS.get(r.protocol, f"protocol {r.protocol}")
    local = f"{proto} port {r.portid}" if r.portid else f"{proto} unbound"
    peer = f"port {r.dst_portid}" + (f" group {r.dst_group}" if r.dst_group else "") \
        if r.dst_portid or r.dst_group else "-"
    state = ("bound" if r.portid else "unbound") + (f", groups {r.groups:#x}" if r.groups else "")
    return ["netlink", _SOCK_TYPES.get(r.type, str(r.type)), local, peer, state, "-", "-"]


def _details_address(text: str) -> str:
    """An address as the fd's socket details hold it (repr of a tuple, a path) as one cell."""
    if text.startswith("("):
        host, port = ast.literal_eval(text)[:2]
        return inet.endpoint(host, port) if port or host not in ("0.0.0.0", "::") else "-"
    if text.startswith(("b'", 'b"')):
        return _unix_name(ast.literal_eval(text))
    return _printable(text) or "-"


def _unsaved_row(f: Fd, root: bool) -> list[str]:
    """A socket fd without a record: external (a plugin re-makes it), or the root's stdio."""
    d = dict(f.details)
    family = {"AF_INET": "IPv4", "AF_INET6": "IPv6", "AF_UNIX": "unix", "AF_NETLINK": "netlink"}.get(
        d.get("family", ""), d.get("family", "?"))
    kind = d.get("type", "?").removeprefix("SOCK_").lower()
    if family.startswith("IPv"):
        kind = {"stream": "TCP", "dgram": "UDP"}.get(kind, kind)
    if f.external:
        note = f.external.split(" ")[0] if f.external.startswith(("tcp:", "unix:", "listen")) else f.external
        state = f"external: {_printable(note)}"
    else:
        state = "not saved (stdio: the restore gives its own)" if root and f.fd <= 2 else "not saved"
    return [family, kind, _details_address(d.get("local", "")), _details_address(d.get("peer", "")), state, "-", "-"]


def _holder_text(holders: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{p}:{n}" for p, n in holders) or "-"


def _sockets_table(reader: ImageReader, procs: Sequence[ProcessImage]) -> str:
    """One line per socket: who holds it (pid:fd), family, type, addresses, state (and how it
    comes back), bytes queued each way."""
    holders = _socket_holders(procs)
    order = {p.task.pid: i for i, p in enumerate(procs)}

    def key(ino: int) -> tuple:
        first = holders.get(ino)
        return (order.get(first[0][0], len(order)), first[0][1]) if first else (len(order), 0)

    rows: list[tuple[tuple, list[str]]] = []
    recorded: set[int] = set()
    for r in reader.inet_sockets:
        recorded.add(r.ino)
        if r.mode == InetMode.PENDING:      # no fd yet: listed under its listener
            rows.append((key(r.listener) + (1, r.ino), ["-"] + _inet_row(r, _holder_text(holders.get(r.listener, ())))))
        else:
            rows.append((key(r.ino) + (0, 0), [_holder_text(holders.get(r.ino, ()))] + _inet_row(r, "")))
    for u in reader.unix_sockets:
        recorded.add(u.ino)
        rows.append((key(u.ino) + (0, 0), [_holder_text(holders.get(u.ino, ()))] + _unix_row(u)))
    for n in reader.netlink_sockets:
        recorded.add(n.ino)
        rows.append((key(n.ino) + (0, 0), [_holder_text(holders.get(n.ino, ()))] + _netlink_row(n)))
    for p in procs:
        for f in p.fds:
            if f.kind is FdKind.SOCKET and f.ino not in recorded:
                recorded.add(f.ino)
                rows.append((key(f.ino) + (0, 0), [_holder_text(holders.get(f.ino, ()))]
                             + _unsaved_row(f, p.task.pid == procs[0].task.pid if procs else False)))
    if not rows:
        return ""
    rows.sort(key=lambda row: row[0])
    return _table(["PID:FD", "FAMILY", "TYPE", "LOCAL", "PEER", "STATE", "RECV-Q", "SEND-Q"],
                  [r for _key, r in rows])


def _sockets_heading(inv, reader: ImageReader) -> str:
    if inv.netlock and any(r.mode == InetMode.REPAIRED for r in reader.inet_sockets):
        return (f"sockets (network lock {inv.netlock} holds the repaired connections until a "
                f"restore releases it):")
    if inv.netlock:
        return f"sockets (network lock {inv.netlock}):"
    return "sockets:"


def _pid_heading(inv) -> str:
    if inv.pid_level:
        return (f"pids (virtual -> real): the tree lived in a pid namespace {inv.pid_level} level(s) "
                f"below the dumper's; a restore gives it the virtual pids in a new one")
    return "pids (virtual -> real): the tree lived in the dumper's pid namespace, virtual = real"


def _pid_table(inv, procs) -> str:
    real = dict(inv.real_pids)
    rows = [[tid, real.get(tid, tid), "process" if tid == p.task.pid else f"thread of {p.task.pid}",
             _printable(p.task.comm)] for p in procs for tid in p.task.tids]
    return _table(["VIRTUAL", "REAL", "WHAT", "COMM"], rows, right=(0, 1))


def image_summary(directory: str | os.PathLike) -> str:
    """Human-readable tables of an image: tasks, pids, what the tree shares, its sockets,
    then threads, VMAs and fds per process.

    Example: ``print(image_summary("/tmp/ckpt"))``.
    """
    with ImageReader(directory) as reader:
        inv = reader.inventory
        procs = [reader.process(pid) for pid in reader.pids]
        runs = {pid: reader.page_runs(pid) for pid in reader.pids}
        storage = _storage_lines(reader)
        shared = _shared_table(reader)
        sockets = _sockets_table(reader, procs)
        sockets_heading = _sockets_heading(inv, reader)
    when = datetime.fromtimestamp(inv.realtime_ns / 1e9, tz=timezone.utc).isoformat(timespec="seconds")
    head = (f"image {_printable(str(directory))}: format {reader.version}, ptckpt {inv.ptckpt_version}, "
            f"dumped {when} on {_printable(inv.hostname)} ({_printable(inv.kernel_release)} {inv.arch}), "
            f"{len(procs)} process(es), root pid {inv.root_pid}")
    tasks = _table(
        ["PID", "PPID", "COMM", "THREADS", "EXE"],
        [[p.task.pid, p.task.ppid, _printable(p.task.comm), len(p.threads), _printable(p.task.exe)]
         for p in procs],
        right=(0, 1, 3))
    parts = [head, storage, _section("tasks:", tasks), _section(_pid_heading(inv), _pid_table(inv, procs))]
    if shared:
        parts.append(_section("shared by the tree:", shared))
    if sockets:
        parts.append(_section(sockets_heading, sockets))
    if inv.fd_kinds_unsupported:
        parts.append(_section("not restorable:", "\n".join("  " + _printable(s) for s in inv.fd_kinds_unsupported)))
    for proc in procs:
        parts.extend(_process_tables(proc, runs[proc.task.pid]))
    return "\n\n".join(parts) + "\n"

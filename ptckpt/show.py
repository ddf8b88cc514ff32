"""Backend of ``ptckpt show DIR``: an image as JSON-able data or as text tables.

Both open the image with :class:`~ptckpt.formats.image.ImageReader`, so a
corrupt image raises the same typed errors as a restore would.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import zlib
from bisect import bisect_left
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import (GP_REG_NAMES, PAGE_SIZE, GhostFile, MemfdState, PageRun, ProcessImage,
                                  SavedFile, ShmImage, Thread, Vma)

_RIP = GP_REG_NAMES.index("rip")
_RSP = GP_REG_NAMES.index("rsp")

# Byte fields shown as {"size", "crc32"} rather than hex (they are kilobytes).
_BLOB_FIELDS = {(Thread, "xstate"), (GhostFile, "data"), (SavedFile, "data"), (MemfdState, "contents"),
                (ShmImage, "data")}


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
        else:
            out[f.name] = _json_value(value)
    return out


def _pages_json(reader: ImageReader, pid: int) -> dict[str, Any]:
    runs = reader.page_runs(pid)
    total = sum(r.npages for r in runs)
    return {
        "run_count": len(runs),
        "total_pages": total,
        "total_bytes": total * PAGE_SIZE,
        "data_bytes": reader.pages_length(pid),
        "crc32": reader.pages_crc32(pid),
        "runs": [record_to_json(r) for r in runs],
    }


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
        "unknown_entries": [{"kind": e.kind, "size": len(e.payload)} for e in reader.unknown_entries(pid)],
        "pages": _pages_json(reader, pid),
    }


def image_to_json(directory: str | os.PathLike) -> dict[str, Any]:
    """The whole image as JSON-able data; page bytes are summarised, not included.

    Example: ``json.dumps(image_to_json("/tmp/ckpt"), indent=2)``.
    Strings keep undecodable path bytes as surrogate escapes (json.dumps
    writes them as \\udcXX; os.fsencode of the loaded string gives the bytes back).
    """
    with ImageReader(directory) as reader:
        return {
            "path": reader.path,
            "format_version": reader.version,
            "inventory": record_to_json(reader.inventory),
            "pids": _pid_rows(reader),
            "processes": [_process_json(reader, pid) for pid in reader.pids],
            "zombies": [record_to_json(z) for z in reader.zombies],
            "pipes": [record_to_json(p) for p in reader.pipes],
            "unix_sockets": [record_to_json(u) for u in reader.unix_sockets],
            "sysv": [dict(record_to_json(o), record=type(o).__name__) for o in reader.sysv],
            "ghost_files": [record_to_json(g) for g in reader.ghost_files],
            "saved_files": [record_to_json(f) for f in reader.saved_files],
            "fd_states": [dict(record_to_json(st), record=type(st).__name__) for st in reader.fd_states],
            "terminals": [record_to_json(t) for t in reader.terminals],
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
    """One row per image-wide record: zombies, pipes, unix sockets, SysV objects."""
    rows = []
    for z in reader.zombies:
        rows.append(["zombie", z.pid, f"child of {z.ppid}, wait status {z.wait_status:#x}"])
    for p in reader.pipes:
        rows.append(["fifo" if p.path else "pipe", p.ino,
                     f"{len(p.data)} bytes buffered of {p.capacity}" + (f", {_printable(p.path)}" if p.path else "")])
    for u in reader.unix_sockets:
        kind = {1: "stream", 2: "dgram", 5: "seqpacket"}.get(u.type, str(u.type))
        name = _printable(os.fsdecode(u.name.replace(b"\0", b"@", 1))) if u.name else "unnamed"
        what = "listening" if u.state == 10 else f"peer {u.peer}" if u.peer else "unconnected"
        rows.append([f"unix {kind}", u.ino, f"{name}, {what}, {sum(map(len, u.queue))} bytes "
                     f"in {len(u.queue)} queued"])
    for g in reader.ghost_files:
        rows.append(["ghost file", g.ino, f"{_printable(g.path)} (deleted), {len(g.data)} bytes"])
    for f in reader.saved_files:
        rows.append(["saved file", "-", f"{_printable(f.path)}, {len(f.data)} bytes"])
    for st in reader.fd_states:
        rows.append([type(st).__name__.removesuffix("State").lower(), st.desc, "open file description"])
    for t in reader.terminals:
        rows.append(["terminal", t.desc, f"{t.cols}x{t.rows}, foreground group {t.fg_pgrp}"
                     + (", controlling" if t.controlling else "")])
    for o in reader.sysv:
        kind = type(o).__name__.removesuffix("Image").lower()
        ident = getattr(o, "shmid", getattr(o, "semid", getattr(o, "msqid", 0)))
        rows.append([f"sysv {kind}", ident, f"key {o.key:#x}"])
    return _table(["KIND", "ID", "WHAT"], rows, right=(1,)) if rows else ""


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
    """Human-readable tables of an image: tasks, then threads, VMAs and fds per process.

    Example: ``print(image_summary("/tmp/ckpt"))``.
    """
    with ImageReader(directory) as reader:
        inv = reader.inventory
        procs = [reader.process(pid) for pid in reader.pids]
        runs = {pid: reader.page_runs(pid) for pid in reader.pids}
        shared = _shared_table(reader)
    when = datetime.fromtimestamp(inv.realtime_ns / 1e9, tz=timezone.utc).isoformat(timespec="seconds")
    head = (f"image {_printable(str(directory))}: format {reader.version}, ptckpt {inv.ptckpt_version}, "
            f"dumped {when} on {_printable(inv.hostname)} ({_printable(inv.kernel_release)} {inv.arch}), "
            f"{len(procs)} process(es), root pid {inv.root_pid}")
    tasks = _table(
        ["PID", "PPID", "COMM", "THREADS", "EXE"],
        [[p.task.pid, p.task.ppid, _printable(p.task.comm), len(p.threads), _printable(p.task.exe)]
         for p in procs],
        right=(0, 1, 3))
    parts = [head, _section("tasks:", tasks), _section(_pid_heading(inv), _pid_table(inv, procs))]
    if shared:
        parts.append(_section("shared by the tree:", shared))
    if inv.fd_kinds_unsupported:
        parts.append(_section("not restorable:", "\n".join("  " + _printable(s) for s in inv.fd_kinds_unsupported)))
    for proc in procs:
        parts.extend(_process_tables(proc, runs[proc.task.pid]))
    return "\n\n".join(parts) + "\n"

"""Image fuzzing: real images mutated every way a disk, a copy or a person could, then given
to `ptckpt show` and `ptckpt restore`.  Used by tests/test_image_fuzz.py (a few hundred
mutants) and bench/image_fuzz (ten thousand).

Each mutant is a copy of a real image with one mutation:

  flip        a bit flipped in any file (checksums left as they are: the reader must see it)
  overwrite   1-8 random bytes anywhere in a record file, its checksum made right again
  field       one field of one record set to a boundary or foreign value, re-encoded with
              a right checksum (the mutations checksums cannot see: the validation layer's)
  header      a header field: newer version, reserved bytes, another file kind, lengths
  entry       an entry header: reserved bytes, a huge length, an unknown kind
  truncate    a file cut at an entry boundary or at a random offset
  files       a file deleted, emptied, swapped with another, duplicated over another,
              or taken from another image
  page        page data changed (crc left: the checksum pass must see it)

A run of a mutant is judged by what the command did, never by what we hoped:
  refused     exit code of a ptckpt error (not 1), one line on stderr, no traceback
  restored    exit 0 (the restored tree is killed at once); `show` printing is "shown"
  BAD         anything else: exit 1 (internal error), a traceback, more than one line,
              a hang (timeout), a crash of ptckpt
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import random
import shutil
import signal
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ptckpt.formats.records import (ENTRY_HEADER_SIZE, FORMAT_VERSION, HEADER_SIZE, PAGES_DATA_OFFSET,
                                    FileKind, RawEntry, build_file, decode_entries, parse_header)

RECORD_FILES = {"inventory.img": FileKind.INVENTORY, "core-": FileKind.CORE, "pagemap-": FileKind.PAGEMAP}
KINDS = ("flip", "overwrite", "field", "field", "field", "header", "entry", "truncate", "files", "page")


@dataclass
class Mutant:
    kind: str
    what: str


def _kind_of(name: str) -> FileKind | None:
    for prefix, kind in RECORD_FILES.items():
        if name.startswith(prefix):
            return kind
    return FileKind.PAGES if name.startswith("pages-") else None


def _fix_crc(data: bytearray) -> None:
    """The checksum made right again for a record file's payload."""
    struct.pack_into("<Q", data, 8, len(data) - HEADER_SIZE)
    struct.pack_into("<I", data, 16, zlib.crc32(bytes(data[HEADER_SIZE:])))


def _boundary_values(value, rng: random.Random, donor_values: list) -> list:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, enum.Enum):
        return [m for m in type(value) if m is not value][:3] + [value.value + 97, -1]
    if isinstance(value, int):
        out = [0, -1, 1, 2**31 - 1, 2**63 - 1, -2**63, value + 4096, value - 1, value ^ (1 << rng.randrange(48)),
               0x7FFFFFFFF000, 0xFFFFFFFFFFFF0000]
        return out + donor_values
    if isinstance(value, str):
        return ["", "x" * 5000, "../../../../etc/passwd", value + "\udcff", "\0"]
    if isinstance(value, bytes):
        return [b"", value[: len(value) // 2], value + b"\xff" * 64, bytes(len(value))]
    if isinstance(value, tuple):
        out: list = [()]
        if value:
            out += [value + value[-1:], value[:-1], value[::-1]]
        return out
    return []


def _mutate_field(data: bytearray, kind: FileKind, rng: random.Random) -> str | None:
    header = parse_header(bytes(data[:HEADER_SIZE]))
    records = decode_entries(bytes(data[HEADER_SIZE:]), version=header.version)
    candidates = [i for i, r in enumerate(records) if dataclasses.is_dataclass(r) and not isinstance(r, RawEntry)]
    if not candidates:
        return None
    i = rng.choice(candidates)
    rec = records[i]
    fields = [f.name for f in dataclasses.fields(rec)]
    name = rng.choice(fields)
    value = getattr(rec, name)
    same_type = [getattr(r, name) for r in records if type(r) is type(rec) and r is not rec]
    choices = _boundary_values(value, rng, same_type[:3])
    if not choices:
        return None
    new = rng.choice(choices)
    try:
        records[i] = dataclasses.replace(rec, **{name: new})
        out = bytearray(build_file(kind, records))
    except (ValueError, TypeError, OverflowError):
        return None                            # not encodable: not a mutant a file can hold
    struct.pack_into("<H", out, 6, header.version)
    _fix_crc(out)
    data[:] = out
    return f"{type(rec).__name__}[{i}].{name} = {new!r:.60}"


def _entry_offsets(data: bytes) -> list[int]:
    out, pos = [], HEADER_SIZE
    while pos + ENTRY_HEADER_SIZE <= len(data):
        out.append(pos)
        (length,) = struct.unpack_from("<I", data, pos + 4)
        pos += ENTRY_HEADER_SIZE + length
    return out


def mutate(image: Path, out: Path, rng: random.Random, donor: Path | None = None) -> Mutant:
    """Copy `image` to `out` (which must not exist) and apply one random mutation."""
    shutil.copytree(image, out)
    os.chmod(out, 0o700)
    names = sorted(os.listdir(out))
    records = [n for n in names if _kind_of(n) not in (None, FileKind.PAGES)]
    pages = [n for n in names if n.startswith("pages-")]
    for _ in range(20):
        kind = rng.choice(KINDS)
        what = _apply(kind, out, names, records, pages, rng, donor)
        if what is not None:
            return Mutant(kind, what)
    return Mutant("none", "no mutation applied")


def _apply(kind: str, out: Path, names: list[str], records: list[str], pages: list[str],
           rng: random.Random, donor: Path | None) -> str | None:
    if kind == "flip":
        name = rng.choice(names)
        path = out / name
        data = bytearray(path.read_bytes())
        if not data:
            return None
        at = rng.randrange(len(data))
        bit = rng.randrange(8)
        data[at] ^= 1 << bit
        path.write_bytes(data)
        return f"{name}: bit {bit} of byte {at}"
    if kind == "overwrite":
        name = rng.choice(records)
        path = out / name
        data = bytearray(path.read_bytes())
        if len(data) <= HEADER_SIZE:
            return None
        n = rng.randint(1, 8)
        at = rng.randrange(HEADER_SIZE, len(data))
        data[at:at + n] = bytes(rng.randrange(256) for _ in range(n))
        _fix_crc(data)
        path.write_bytes(data)
        return f"{name}: {n} bytes at {at}"
    if kind == "field":
        name = rng.choice(records)
        path = out / name
        data = bytearray(path.read_bytes())
        what = _mutate_field(data, _kind_of(name), rng)
        if what is None:
            return None
        path.write_bytes(data)
        return f"{name}: {what}"
    if kind == "header":
        name = rng.choice(names)
        path = out / name
        data = bytearray(path.read_bytes())
        if len(data) < HEADER_SIZE:
            return None
        choice = rng.randrange(5)
        if choice == 0:
            struct.pack_into("<H", data, 6, FORMAT_VERSION + rng.randint(1, 100))
            what = "a newer format version"
        elif choice == 1:
            struct.pack_into("<I", data, 20, rng.randint(1, 2**32 - 1))
            what = "reserved header bytes set"
        elif choice == 2:
            (current,) = struct.unpack_from("<H", data, 4)
            struct.pack_into("<H", data, 4, rng.choice([k for k in (1, 2, 3, 4, 9, 0xFFFF) if k != current]))
            what = "another file kind"
        elif choice == 3:
            struct.pack_into("<Q", data, 8, rng.choice([0, 2**63, len(data) * 2, 1]))
            what = "payload length"
        else:
            struct.pack_into("<H", data, 6, 0)
            what = "version 0"
        path.write_bytes(data)
        return f"{name}: {what}"
    if kind == "entry":
        name = rng.choice(records)
        path = out / name
        data = bytearray(path.read_bytes())
        offsets = _entry_offsets(bytes(data))
        if not offsets:
            return None
        at = rng.choice(offsets)
        choice = rng.randrange(3)
        if choice == 0:
            struct.pack_into("<H", data, at + 2, rng.randint(1, 0xFFFF))
            what = "reserved entry bytes set"
        elif choice == 1:
            struct.pack_into("<I", data, at + 4, rng.choice([2**32 - 1, 2**31, 0]))
            what = "entry length"
        else:
            struct.pack_into("<H", data, at, rng.choice([0, 999, 0xFFFF]))
            what = "unknown entry kind"
        _fix_crc(data)
        path.write_bytes(data)
        return f"{name}: {what} at {at}"
    if kind == "truncate":
        name = rng.choice(names)
        path = out / name
        data = path.read_bytes()
        offsets = _entry_offsets(data) if name in records else []
        cut = rng.choice(offsets) if offsets and rng.random() < 0.5 else rng.randrange(max(1, len(data)))
        path.write_bytes(data[:cut])
        return f"{name}: cut at {cut} of {len(data)}"
    if kind == "files":
        choice = rng.randrange(5)
        name = rng.choice(names)
        if choice == 0:
            (out / name).unlink()
            return f"{name} deleted"
        if choice == 1:
            (out / name).write_bytes(b"")
            return f"{name} emptied"
        other = rng.choice(names)
        if other == name:
            return None
        if choice == 2:
            a, b = (out / name).read_bytes(), (out / other).read_bytes()
            (out / name).write_bytes(b)
            (out / other).write_bytes(a)
            return f"{name} and {other} swapped"
        if choice == 3:
            shutil.copyfile(out / other, out / name)
            return f"{other} copied over {name}"
        if donor is None:
            return None
        theirs = sorted(os.listdir(donor))
        same = [n for n in theirs if _kind_of(n) == _kind_of(name)]
        if not same:
            return None
        src = rng.choice(same)
        shutil.copyfile(donor / src, out / name)
        return f"{name} replaced by another image's {src}"
    if kind == "page":
        if not pages:
            return None
        name = rng.choice(pages)
        path = out / name
        data = bytearray(path.read_bytes())
        if len(data) <= PAGES_DATA_OFFSET:
            return None
        at = rng.randrange(PAGES_DATA_OFFSET, len(data))
        data[at] ^= 0xFF
        path.write_bytes(data)
        return f"{name}: page byte {at - PAGES_DATA_OFFSET} changed"
    raise ValueError(kind)


# --- running the CLI on a mutant, in a forked child ---------------------------------------

@dataclass
class Outcome:
    verdict: str          # refused | shown | restored | BAD
    code: int
    stderr: str
    seconds: float
    why: str = ""


def run_cli(argv: list[str], timeout: float, work: Path) -> tuple[int | None, str, float]:
    """Run `ptckpt ARGV` in a forked child of this (warm) interpreter: (exit code or None
    on a timeout, stderr, seconds).  The child is a subreaper: whatever it restored is
    killed and reaped before it ends."""
    err_path = work / "stderr"
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:                                     # pragma: no cover - the child
        code = 99
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)      # PR_SET_CHILD_SUBREAPER
            fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 2)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 1)
            os.dup2(null, 0)
            # under pytest's capture sys.stdout/sys.stderr are not fds 1 and 2: make them so
            # (with the error handler Python gives its own stderr: undecodable path bytes print)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")
            sys.argv = ["ptckpt", *argv]
            from ptckpt import entry
            try:
                entry.main()
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 98
        finally:
            _kill_descendants(os.getpid())
            os._exit(code)
    deadline = started + timeout
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.005)
    else:
        _kill_descendants(pid)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None, err_path.read_text(errors="replace") if err_path.exists() else "", time.monotonic() - started
    code = os.waitstatus_to_exitcode(status)
    return code, err_path.read_text(errors="replace") if err_path.exists() else "", time.monotonic() - started


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _kill_descendants(root: int) -> None:
    for _ in range(50):
        found, stack = [], _children(root)
        while stack:
            p = stack.pop()
            found.append(p)
            stack += _children(p)
        if not found:
            return
        for p in found:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        for p in found:
            try:
                os.waitpid(p, 0)
            except ChildProcessError:
                pass
        time.sleep(0.01)


# Mutations a checksum or a header check sees: such a mutant must never be taken.
SEEN_BY_CHECKS = ("flip", "page", "truncate", "header", "entry")


def judge(command: str, code: int | None, stderr: str, seconds: float, kind: str = "") -> Outcome:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("ptckpt: warning:")]
    if code is None:
        return Outcome("BAD", -1, stderr, seconds, "hang (timeout)")
    if "Traceback" in stderr:
        return Outcome("BAD", code, stderr, seconds, "traceback")
    if code == 0 and kind in SEEN_BY_CHECKS:
        return Outcome("BAD", code, stderr, seconds, "taken although its checks could see the damage")
    if code == 0:
        return Outcome("restored" if command == "restore" else "shown", code, stderr, seconds)
    if code in (1, 98, 99) or code < 0:
        return Outcome("BAD", code, stderr, seconds, f"exit {code}")
    if len(lines) != 1:
        return Outcome("BAD", code, stderr, seconds, f"{len(lines)} lines on stderr")
    return Outcome("refused", code, stderr, seconds)


def try_mutant(path: Path, work: Path, kind: str, timeout: float = 30.0) -> dict[str, Outcome]:
    """`show` and `restore --pidns --detach` of the mutant at `path`."""
    out = {}
    code, err, secs = run_cli(["show", str(path)], timeout, work)
    out["show"] = judge("show", code, err, secs, kind)
    code, err, secs = run_cli(["restore", "-D", str(path), "--pidns", "--detach", "--file-policy", "warn"],
                              timeout, work)
    out["restore"] = judge("restore", code, err, secs, kind)
    return out


def remake(images: list[Path], seed: int, i: int, out: Path) -> Mutant:
    """Mutant #i of a campaign with `seed` over `images`, made (again) at `out`."""
    rng = random.Random(seed * 1_000_003 + i)
    donor = images[(i + 1) % len(images)] if len(images) > 1 else None
    return mutate(images[i % len(images)], out, rng, donor)


def warm_up() -> None:
    """Import what the commands use, once, before the children are forked: each child of a
    cold interpreter would import it all again (0.4 s a command)."""
    import importlib
    for name in ("elftools.elf.elffile", "ptckpt.cli", "ptckpt.restore", "ptckpt.show"):
        importlib.import_module(name)            # (pyelftools: every restore reads build-ids)


def campaign(images: list[Path], count: int, seed: int, work: Path,
             on_result: Callable[[int, Mutant, dict[str, Outcome]], None] | None = None,
             jobs: int = 1) -> None:
    """`count` mutants of `images` (round robin), each tried, on_result(i, mutant, outcomes)
    called for each in order of i.  Mutant i is the same whatever `jobs` (its own seed);
    `jobs` forked workers share the mutants."""
    def one(i: int) -> tuple[Mutant, dict[str, Outcome]]:
        path = work / f"m{i}"
        mutant = remake(images, seed, i, path)
        try:
            return mutant, try_mutant(path, work / f"w{i % jobs}", mutant.kind)
        finally:
            shutil.rmtree(path, ignore_errors=True)

    warm_up()
    for w in range(jobs):
        (work / f"w{w}").mkdir(exist_ok=True)
    if jobs == 1:
        for i in range(count):
            mutant, outcomes = one(i)
            if on_result:
                on_result(i, mutant, outcomes)
        return
    workers = []
    for w in range(jobs):
        out = work / f"w{w}" / "results.pickle"
        pid = os.fork()
        if pid == 0:                                   # pragma: no cover - a worker
            code = 0
            try:
                results = [(i, *one(i)) for i in range(w, count, jobs)]
                with open(out, "wb") as f:
                    pickle.dump(results, f)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        workers.append((pid, out))
    merged = []
    for pid, out in workers:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 or not out.exists():
            raise RuntimeError(f"fuzz worker {pid} failed ({status})")
        with open(out, "rb") as f:
            merged += pickle.load(f)
    for i, mutant, outcomes in sorted(merged, key=lambda r: r[0]):
        if on_result:
            on_result(i, mutant, outcomes)

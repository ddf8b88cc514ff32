"""ELF symbols of a frozen process: read and write its memory by name (for plugins).

:meth:`SymbolTable.for_process` lists every ELF object mapped in a process
(the executable and its shared libraries) from /proc/PID/maps; an object's
file is opened through /proc/PID/map_files/START-END, so a library replaced or
deleted on disk still gives the symbols of what is mapped.  Symbols (.symtab
when the file has one, else .dynsym) are read with pyelftools only when a
lookup reaches that object, and kept per file (st_dev, st_ino, size, mtime)
for the whole ptckpt process.

Addresses are absolute: the object's load bias is added.  The bias is the
start of the mapping at file offset 0 minus the p_vaddr of the PT_LOAD at
p_offset 0; without such a mapping, any mapping inside a PT_LOAD gives it as
``start - pgoff - (p_vaddr - p_offset)``; a non-PIE executable (ET_EXEC) has
bias 0.

:meth:`SymbolTable.lookup` searches like the dynamic linker's global scope:
the main program first (found through AT_PHDR), then the other objects in
address order.  Names match without their symbol version ("environ" finds
``environ@@GLIBC_2.2.5``); among several definitions of a name in one object
the default version (``@@``) and the strongest binding win.
:meth:`SymbolTable.resolve` reads the address expressions plugins are given:
``0x7f0012345678``, ``design_state``, ``design_state+16``,
``libc.so.6:environ``.

The environment: glibc's getenv() reads ``__environ``, of which ``environ``
and ``_environ`` are aliases in libc.so.6 (one variable: Debian's 2.36 has
all three at 0x1db320).  An
executable that uses ``environ`` itself gets a copy relocation instead: the
live variable is then in the executable's .bss, defining ``environ`` and
``__environ`` there, while ``_environ`` still names libc's now unused one.
:func:`environ_slots` therefore takes the global-scope definition of each of
the three names; :func:`read_environ` reads the first, :func:`write_environ`
sets them all.
"""

from __future__ import annotations

import functools
import os
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elftools.elf.elffile import ELFFile

from . import procfs
from .errors import AccessDenied, ExitCode, ProcessError, PtckptError, TargetVanished
from .procfs import PAGE_SIZE, PROT_EXEC, PROT_READ, PROT_WRITE, MapEntry
from .tracee import AddressSpace, RemoteSyscalls, page_align

# <sys/mman.h>
MAP_PRIVATE = 0x02
MAP_ANONYMOUS = 0x20
MAP_32BIT = 0x40                 # below 2 GiB: where a 32-bit process can point
_NO_FD = 2**64 - 1            # fd -1 for an injected mmap

AT_PHDR = 3                   # auxv: where the main program's program headers are
_VERSYM_HIDDEN = 0x8000       # .gnu.version: a non-default version (name@VER, not @@)
_POINTER = struct.Struct("<Q")

# Limits of read_environ, far above any real environment.
MAX_ENV_ENTRIES = 1 << 20
MAX_ENV_STRING = 1 << 24

ENVIRON_NAMES = ("__environ", "environ", "_environ")   # getenv() reads the first


# --- errors -------------------------------------------------------------------

class SymbolError(PtckptError):
    """A symbol name or address expression that does not name memory of the process."""

    exit_code = ExitCode.USAGE


class SymbolNotFound(SymbolError):
    """No object searched defines the symbol (or no mapped object matches `object`)."""

    def __init__(self, name: str, searched: Sequence[str], object: str | None = None):
        if object is not None and not searched:
            msg = f"symbol {name!r}: no mapped ELF object matches {object!r}"
        else:
            where = ", ".join(searched) or "no ELF objects"
            msg = f"symbol {name!r} not found in {where}"
        super().__init__(msg)
        self.name = name
        self.searched = tuple(searched)
        self.object = object


class BadSymbolExpression(SymbolError):
    """An address expression that does not parse, or names a thread-local symbol."""

    def __init__(self, expr: str, reason: str):
        super().__init__(f"address expression {expr!r}: {reason}")
        self.expr = expr
        self.reason = reason


class EnvironUnreadable(ProcessError):
    """The process's environ array does not look like one (unterminated, too big)."""

    def __init__(self, pid: int, reason: str):
        super().__init__(pid, f"process {pid}: cannot read its environment: {reason}")
        self.reason = reason


# --- records ------------------------------------------------------------------

@dataclass(frozen=True)
class Symbol:
    """A defined symbol of one mapped object.

    `address` is absolute (bias applied), except for TLS symbols, where it is
    the offset inside the object's TLS block (no single address exists).
    `type` is the STT_* name without the prefix: OBJECT, FUNC, TLS, IFUNC
    (the address of the resolver, not of the implementation), NOTYPE ...
    """

    name: str
    address: int
    size: int
    type: str
    object: str


@dataclass(frozen=True)
class MappedObject:
    """One ELF file mapped in the process: its mappings, in address order."""

    path: str
    inode: int
    mappings: tuple[MapEntry, ...]

    @property
    def start(self) -> int:
        return self.mappings[0].start

    def contains(self, addr: int) -> bool:
        return any(m.start <= addr < m.end for m in self.mappings)

    def matches(self, name: str) -> bool:
        """Whether the path ends with the component(s) `name` ("libc.so.6", "lib/libc.so.6")."""
        return self.path == name or self.path.endswith("/" + name)


@dataclass(frozen=True)
class _RawSymbol:
    value: int
    size: int
    type: str
    absolute: bool            # SHN_ABS: no bias


@dataclass(frozen=True)
class ElfSymbols:
    """What one ELF file contributes: type, PT_LOADs and symbols by name (no version)."""

    e_type: str                                   # "ET_EXEC", "ET_DYN" ...
    loads: tuple[tuple[int, int, int], ...]       # (p_offset, p_vaddr, p_filesz)
    symbols: dict[str, _RawSymbol] = field(hash=False)
    table: str                                    # ".symtab" or ".dynsym"


@dataclass(frozen=True)
class _Loaded:
    mapped: MappedObject
    elf: ElfSymbols
    bias: int


# --- reading ELF files ----------------------------------------------------------

_ELF_CACHE: dict[tuple[int, int, int, int], ElfSymbols | None] = {}
_ELF_CACHE_MAX = 512


def _type_name(stt: str) -> str:
    """OBJECT, FUNC ... of an STT_* name; STT_LOOS is STT_GNU_IFUNC on Linux."""
    if stt in ("STT_LOOS", "STT_GNU_IFUNC"):
        return "IFUNC"
    return stt.removeprefix("STT_")


_BIND_RANK = {"STB_GLOBAL": 0, "STB_LOOS": 0, "STB_GNU_UNIQUE": 0, "STB_WEAK": 1}


def _rank(bind: str, hidden_version: bool) -> tuple[int, int]:
    """Sort key of one definition: default version first, then global, weak, local."""
    return (1 if hidden_version else 0, _BIND_RANK.get(bind, 2))


def _versym_hidden(versym, index: int) -> bool:
    """Whether .gnu.version marks symbol `index` as a non-default version."""
    if versym is None:
        return False
    ndx = versym.get_symbol(index).entry["ndx"]
    return isinstance(ndx, int) and bool(ndx & _VERSYM_HIDDEN)


def _read_symbols(elf: ELFFile) -> tuple[dict[str, _RawSymbol], str]:
    """Defined symbols of .symtab (else .dynsym) by unversioned name, the best one each."""
    table = elf.get_section_by_name(".symtab")
    name = ".symtab"
    if table is None:
        table, name = elf.get_section_by_name(".dynsym"), ".dynsym"
    if table is None:
        return {}, ""
    versym = elf.get_section_by_name(".gnu.version") if name == ".dynsym" else None
    best: dict[str, tuple[tuple[int, int], _RawSymbol]] = {}
    for index, sym in enumerate(table.iter_symbols()):
        shndx = sym["st_shndx"]
        if not sym.name or shndx == "SHN_UNDEF" or sym["st_info"]["type"] in ("STT_FILE", "STT_SECTION"):
            continue
        base, at, version = sym.name.partition("@")
        hidden = _versym_hidden(versym, index) or (bool(at) and not version.startswith("@"))
        rank = _rank(sym["st_info"]["bind"], hidden)
        if base in best and best[base][0] <= rank:
            continue
        best[base] = (rank, _RawSymbol(sym["st_value"], sym["st_size"],
                                       _type_name(sym["st_info"]["type"]), shndx == "SHN_ABS"))
    return {k: v for k, (_, v) in best.items()}, name


def parse_elf(stream) -> ElfSymbols | None:
    """The ElfSymbols of an open ELF file, None if it is not a (well-formed) ELF file."""
    try:
        stream.seek(0)
        if stream.read(4) != b"\x7fELF":
            return None
        from elftools.elf.elffile import ELFFile   # here: only breakpoints and symbol lookups need it
        elf = ELFFile(stream)
        loads = tuple((seg["p_offset"], seg["p_vaddr"], seg["p_filesz"])
                      for seg in elf.iter_segments("PT_LOAD"))
        symbols, table = _read_symbols(elf)
        return ElfSymbols(elf["e_type"], loads, symbols, table)
    except Exception:          # pyelftools raises anything from ELFError to struct.error
        return None


def _cached_parse(fd: int) -> ElfSymbols | None:
    """parse_elf of the file open at `fd`, once per (st_dev, st_ino, size, mtime)."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _ELF_CACHE:
        if len(_ELF_CACHE) >= _ELF_CACHE_MAX:
            _ELF_CACHE.clear()
        with os.fdopen(os.dup(fd), "rb") as stream:
            _ELF_CACHE[key] = parse_elf(stream)
    return _ELF_CACHE[key]


def load_bias(elf: ElfSymbols, mappings: Sequence[MapEntry]) -> int | None:
    """The load bias of `elf` mapped as `mappings`; None if they are not its PT_LOADs."""
    if elf.e_type == "ET_EXEC":
        return 0
    first = next((vaddr for off, vaddr, _ in elf.loads if off == 0), None)
    for m in mappings:
        if m.offset == 0 and first is not None:
            return m.start - (first & ~(PAGE_SIZE - 1))
    for m in mappings:
        for off, vaddr, filesz in elf.loads:
            if off & ~(PAGE_SIZE - 1) <= m.offset < off + max(filesz, 1):
                return m.start - m.offset - (vaddr - off)
    return None


# --- the mapped objects ---------------------------------------------------------

def group_mappings(maps: Iterable[MapEntry]) -> list[MappedObject]:
    """The mapped files that may be ELF objects, in address order.

    A file's mappings form one object; a mapping at offset 0 or below the
    previous one of that file starts another (the file is mapped twice).  The
    same offset twice in a row is one object: the PT_LOADs sharing a file page
    (.rodata and the RELRO part of .data) map it twice.  Objects with no
    executable mapping are left out: a file a program mmaps to read is no
    loaded object.
    """
    groups: list[list[MapEntry]] = []
    current: dict[tuple[int, int, int, str], list[MapEntry]] = {}
    for m in maps:
        if not m.path.startswith("/") or m.inode == 0:
            continue
        key = (m.dev_major, m.dev_minor, m.inode, m.path)
        group = current.get(key)
        if group is None or m.offset == 0 or m.offset < group[-1].offset:
            group = current[key] = []
            groups.append(group)
        group.append(m)
    return [MappedObject(g[0].path, g[0].inode, tuple(g)) for g in groups
            if any(m.prot & PROT_EXEC for m in g)]


def _main_first(pid: int, objects: list[MappedObject]) -> list[MappedObject]:
    """`objects` with the main program (holding AT_PHDR) moved to the front."""
    try:
        phdr = next((a.value for a in procfs.read_auxv(pid) if a.type == AT_PHDR), None)
    except PtckptError:
        phdr = None
    main = next((o for o in objects if phdr is not None and o.contains(phdr)), None)
    if main is None:
        return objects
    return [main] + [o for o in objects if o is not main]


def _open_mapped(pid: int, obj: MappedObject) -> int:
    """An fd of the file behind `obj` (map_files; the path when map_files is denied)."""
    m = obj.mappings[0]
    try:
        return os.open(f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}", os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        return _open_by_path(pid, obj)
    except FileNotFoundError:
        if not procfs.pid_exists(pid):
            raise TargetVanished(pid, "reading its symbols") from None
        raise procfs.ProcEntryMissing(pid, f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}") from None
    except OSError as err:
        raise procfs.ProcfsError(pid, f"/proc/{pid}/map_files", err.strerror or str(err),
                                 err.errno) from None


def _open_by_path(pid: int, obj: MappedObject) -> int:
    """The file at obj.path seen from the process's root, if it is still the mapped inode."""
    try:
        fd = os.open(f"/proc/{pid}/root{obj.path}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        raise AccessDenied(pid, f"open the mapped file {obj.path} of") from None
    if os.fstat(fd).st_ino != obj.inode:
        os.close(fd)
        raise AccessDenied(pid, f"open the mapped file {obj.path} (replaced on disk) of")
    return fd


# --- the table --------------------------------------------------------------------

_EXPR = re.compile(r"(?:(?P<object>[^:\s]+):)?(?P<name>[^:+\-\s]+)"
                   r"(?:\s*(?P<sign>[+-])\s*(?P<offset>0[xX][0-9a-fA-F]+|\d+))?")


class SymbolTable:
    """The symbols of every ELF object mapped in one (frozen) process, loaded on demand."""

    def __init__(self, pid: int, objects: Sequence[MappedObject]):
        self.pid = pid
        self.objects = tuple(objects)          # search order: main program first
        self._loaded: dict[int, _Loaded | None] = {}

    @classmethod
    def for_process(cls, pid: int) -> SymbolTable:
        """The table of `pid` as mapped now (freeze the process first: maps must not move)."""
        return cls(pid, _main_first(pid, group_mappings(procfs.read_maps(pid))))

    @classmethod
    def for_image(cls, image, pid: int = 0) -> SymbolTable:
        """The table of process `pid` (0: the root) of `image` (an open formats.image.ImageReader)
        as it will be mapped at restore, its files read by path: to check a spec before a restore."""
        pid = pid or image.inventory.root_pid
        proc = image.process(pid)
        maps = [MapEntry(v.start, v.end, "", v.prot, v.shared, v.pgoff, v.dev_major, v.dev_minor, v.inode,
                         v.path, v.file_deleted) for v in proc.vmas]
        objects = group_mappings(maps)
        phdr = dict(proc.mm.auxv).get(AT_PHDR)
        main = next((o for o in objects if phdr is not None and o.contains(phdr)), None)
        if main is not None:
            objects = [main] + [o for o in objects if o is not main]
        return _ImageSymbols(pid, objects)

    @functools.cached_property
    def pointer_size(self) -> int:
        """4 in a 32-bit (ia32) process, whose pointers are 4 bytes, else 8."""
        head = procfs.read_exe_head(self.pid, 5)
        return 4 if head[:4] == b"\x7fELF" and head[4] == 1 else 8

    def _open(self, obj: MappedObject) -> int:
        return _open_mapped(self.pid, obj)

    def _load(self, index: int) -> _Loaded | None:
        """The parsed ELF and bias of objects[index]; None if it is no loaded ELF object."""
        if index not in self._loaded:
            obj = self.objects[index]
            fd = self._open(obj)
            try:
                elf = _cached_parse(fd)
            finally:
                os.close(fd)
            bias = load_bias(elf, obj.mappings) if elf is not None else None
            self._loaded[index] = _Loaded(obj, elf, bias) if bias is not None else None
        return self._loaded[index]

    def loaded(self, object: str | None = None) -> list[tuple[MappedObject, int]]:
        """(object, load bias) of every ELF object in search order, those matching `object` only."""
        out = []
        for i, obj in enumerate(self.objects):
            if object is None or obj.matches(object):
                got = self._load(i)
                if got is not None:
                    out.append((obj, got.bias))
        return out

    def _definitions(self, name: str, object: str | None):
        """Each object's definition of `name`, in search order, each object parsed when reached."""
        base = name.partition("@")[0]
        for i, obj in enumerate(self.objects):
            got = self._load(i) if object is None or obj.matches(object) else None
            raw = got.elf.symbols.get(base) if got is not None else None
            if raw is not None:
                yield _symbol(base, raw, got)

    def lookup_all(self, name: str, *, object: str | None = None) -> list[Symbol]:
        """Every object's definition of `name`, in search order.

        A version in `name` is ignored ("environ@@GLIBC_2.2.5" is "environ");
        .symtab's local symbols count too, after the global ones of the same object.
        """
        return list(self._definitions(name, object))

    def lookup(self, name: str, *, object: str | None = None) -> Symbol:
        """The definition of `name` that the global scope sees (or the first in objects
        whose path ends with `object`); SymbolNotFound naming what was searched.  Objects
        after the one defining it are not parsed."""
        found = next(self._definitions(name, object), None)
        if found is not None:
            return found
        searched = [obj.path for obj, _ in self.loaded(object)]
        raise SymbolNotFound(name.partition("@")[0], searched, object)

    def resolve(self, expr: str) -> int:
        """The address of "0x7f00..", "NAME", "NAME+16", "NAME-0x8" or "OBJECT:NAME[+OFF]"."""
        return self.extent(expr)[0]

    def extent(self, expr: str) -> tuple[int, int]:
        """(address, bytes of the symbol's object from there on; 0 for a plain address or a
        symbol of unknown size) of an expression as :meth:`resolve` takes it."""
        text = expr.strip()
        try:
            return int(text, 0), 0
        except ValueError:
            pass
        m = _EXPR.fullmatch(text)
        if m is None:
            raise BadSymbolExpression(expr, "expected ADDRESS, NAME, NAME+OFFSET or OBJECT:NAME+OFFSET")
        sym = self.lookup(m["name"], object=m["object"])
        if sym.type == "TLS":
            raise BadSymbolExpression(expr, f"{sym.name} is thread-local ({sym.object}): "
                                            "each thread has its own copy")
        offset = int(m["offset"], 0) if m["offset"] else 0
        offset = -offset if m["sign"] == "-" else offset
        return sym.address + offset, sym.size - offset if 0 <= offset < sym.size else 0


def _symbol(name: str, raw: _RawSymbol, loaded: _Loaded) -> Symbol:
    absolute = raw.absolute or raw.type == "TLS"
    address = raw.value if absolute else raw.value + loaded.bias
    return Symbol(name, address, raw.size, raw.type, loaded.mapped.path)


# --- the environment ------------------------------------------------------------

def environ_slots(table: SymbolTable) -> list[int]:
    """Addresses of the variables named __environ, environ, _environ that the
    program binds to (global scope), without repeats; getenv()'s first."""
    slots: list[int] = []
    for name in ENVIRON_NAMES:
        found = table.lookup_all(name)
        if found and found[0].address not in slots:
            slots.append(found[0].address)
    if not slots:
        raise SymbolNotFound("environ", [obj.path for obj, _ in table.loaded()])
    return slots


def read_cstring(mem: AddressSpace, addr: int, limit: int = MAX_ENV_STRING) -> bytes:
    """The NUL-terminated string at `addr` (without the NUL), read a page at most at a time."""
    out = bytearray()
    at = addr
    while len(out) < limit:
        chunk = mem.read(at, PAGE_SIZE - at % PAGE_SIZE)
        end = chunk.find(b"\0")
        if end >= 0:
            return bytes(out + chunk[:end])
        out += chunk
        at += len(chunk)
    raise EnvironUnreadable(mem.pid, f"no NUL in the {limit} bytes of the string at {addr:#x}")


_POINTERS = {8: _POINTER, 4: struct.Struct("<I")}     # by pointer size: x86_64, ia32


def read_pointer_array(mem: AddressSpace, addr: int, limit: int = MAX_ENV_ENTRIES, width: int = 8) -> list[int]:
    """The pointers (`width` bytes each) of the NULL-terminated array at `addr`."""
    out: list[int] = []
    at = addr
    while len(out) < limit:
        # whole pointers up to the page end (one pointer across it when misaligned)
        chunk = mem.read(at, max(width, (PAGE_SIZE - at % PAGE_SIZE) // width * width))
        for (ptr,) in _POINTERS[width].iter_unpack(chunk):
            if ptr == 0:
                return out
            out.append(ptr)
        at += len(chunk)
    raise EnvironUnreadable(mem.pid, f"no NULL among the first {limit} pointers at {addr:#x}")


def read_environ(mem: AddressSpace, table: SymbolTable) -> list[bytes]:
    """The process's environment as getenv() sees it now ("NAME=value" each)."""
    width = table.pointer_size
    (array,) = _POINTERS[width].unpack(mem.read(environ_slots(table)[0], width))
    if array == 0:
        return []
    return [read_cstring(mem, p) for p in read_pointer_array(mem, array, width=width)]


def pack_environ(env: Sequence[bytes], base: int, width: int = 8) -> bytes:
    """The NULL-terminated char *[] (of `width`-byte pointers) followed by its strings, for
    placing at `base`."""
    strings_at = base + width * (len(env) + 1)
    pointers, strings = [], bytearray()
    for entry in env:
        if b"\0" in entry:
            raise SymbolError(f"environment entry {entry[:40]!r} contains a NUL byte")
        pointers.append(strings_at + len(strings))
        strings += entry + b"\0"
    return b"".join(_POINTERS[width].pack(p) for p in pointers + [0]) + bytes(strings)


def write_environ(remote: RemoteSyscalls, mem: AddressSpace, table: SymbolTable,
                  env: Sequence[bytes]) -> None:
    """Give the process the environment `env`: the array and strings go into fresh
    anonymous memory mapped by an injected mmap, then every environ variable points there.

    The old array and strings stay where they were (pointers getenv() returned
    before remain valid); glibc's setenv() copies a foreign array before growing it.
    """
    slots = environ_slots(table)
    width = table.pointer_size
    size = page_align(width * (len(env) + 1) + sum(len(e) + 1 for e in env))
    low = MAP_32BIT if width == 4 else 0            # a 32-bit program's pointers reach 4 GiB
    base = remote.checked("mmap", 0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | low,
                          _NO_FD, 0, step="map a new environment")
    mem.write(base, pack_environ(env, base, width))
    for slot in slots:
        mem.write(slot, _POINTERS[width].pack(base))


def _env_key(name: bytes | str) -> bytes:
    key = os.fsencode(name)
    if not key or b"=" in key or b"\0" in key:
        raise SymbolError(f"bad environment variable name {key!r}")
    return key + b"="


def set_env(env: Sequence[bytes], name: bytes | str, value: bytes | str) -> list[bytes]:
    """`env` with NAME=value in place of the first NAME entry (appended if none), others dropped."""
    key = _env_key(name)
    entry = key + os.fsencode(value)
    out, done = [], False
    for e in env:
        if e.startswith(key):
            if not done:
                out.append(entry)
                done = True
            continue
        out.append(e)
    return out if done else out + [entry]


def unset_env(env: Sequence[bytes], name: bytes | str) -> list[bytes]:
    """`env` without any NAME=... entry."""
    key = _env_key(name)
    return [e for e in env if not e.startswith(key)]


class _ImageSymbols(SymbolTable):
    """A SymbolTable of an image's root: its objects opened by path, here."""

    def _open(self, obj: MappedObject) -> int:
        try:
            return os.open(obj.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise AccessDenied(self.pid, f"open the mapped file {obj.path} ({err.strerror}) of") from None

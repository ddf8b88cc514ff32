"""ELF core files from an image (`ptckpt core`): one per process, as the kernel would have
dumped it at the checkpoint, for gdb, eu-stack and other tools that read cores.

Layout (the kernel's, fs/binfmt_elf.c): an ELF64 header (ELF32 for EM_386 when the
process is a 32-bit one, as compat_binfmt_elf dumps it), one PT_NOTE segment, then one
PT_LOAD per mapping.  The notes: per thread NT_PRSTATUS (registers, pids, signals), the
first thread followed by the process-wide NT_PRPSINFO, NT_AUXV and NT_FILE (the mapped
files, so a debugger finds the shared libraries), and per thread NT_FPREGSET and
NT_X86_XSTATE (owner "LINUX"), then once NT_X86_XSAVE_LAYOUT (where each XSAVE feature is
in NT_X86_XSTATE on this CPU).  A mapping's bytes are the image's pages; what the image
does not hold is read from the mapped file where it has one and is readable (text and
read-only data, which a dump leaves out when unchanged), else left a hole (zeros, and no
disk: the core file is sparse).  A mapping backed by a file with no page in the image
gets no bytes at all (p_filesz 0), as the kernel's default coredump_filter does: a
debugger reads those from the files NT_FILE names.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .resources import memory, vdso
from .resources.threads import compat_process
from .errors import OutputError
from .formats.image import ImageReader
from .formats.model import GP_REG_NAMES, PAGE_SIZE, PageRun, ProcessImage, Vma, VmaKind

EM_X86_64 = 62
ET_CORE = 4
PT_LOAD, PT_NOTE = 1, 4
PF_X, PF_W, PF_R = 1, 2, 4
NT_PRSTATUS, NT_FPREGSET, NT_PRPSINFO, NT_AUXV = 1, 2, 3, 6
NT_FILE = 0x46494C45
NT_X86_XSTATE = 0x202
NT_X86_XSAVE_LAYOUT = 0x205     # where each XSAVE feature lives in NT_X86_XSTATE (Linux 6.11+)
FXSAVE_SIZE = 512

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_NHDR = struct.Struct("<III")
_PRSTATUS_HEAD = struct.Struct("<iiih2xQQiiii")       # siginfo, cursig, sigpend, sighold, pids
_TIMEVALS = 4 * 16                                     # utime, stime, cutime, cstime
_REGS = struct.Struct("<27Q")
_PRPSINFO = struct.Struct("<cccc4xQII4i16s80s")


EM_386 = 3
NT_PRXFPREG = 0x46E62B7F        # an ia32 thread's FXSAVE area (owner "LINUX")
_EHDR32 = struct.Struct("<16sHHIIIIIHHHHHH")
_PHDR32 = struct.Struct("<IIIIIIII")
_PRSTATUS32_HEAD = struct.Struct("<iiih2xIIiiii")     # struct compat_elf_prstatus (its head)
_REGS32 = struct.Struct("<17I")
# i386 struct user_regs_struct, from the x86_64 names ptrace gave them by
I386_REGS = ("rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rax", "ds", "es", "fs", "gs", "orig_rax", "rip",
             "cs", "eflags", "rsp", "ss")
_PRPSINFO32 = struct.Struct("<ccccIHHiiii16s80s")    # 16-bit uid and gid on ia32


@dataclass(frozen=True)
class _Elf:
    """The ELF class of a core: the process's own (a 32-bit process gets an ELF32 core for
    EM_386, as the kernel dumps one through compat_binfmt_elf)."""

    elfclass: int
    machine: int
    ehdr: struct.Struct
    word: str                   # "Q" or "I": the size of an address

    def phdr(self, kind: int, flags: int, offset: int, vaddr: int, filesz: int, memsz: int, align: int) -> bytes:
        if self.elfclass == 2:
            return _PHDR.pack(kind, flags, offset, vaddr, 0, filesz, memsz, align)
        return _PHDR32.pack(kind, offset, vaddr, 0, filesz, memsz, flags, align)

    def header(self, phnum: int) -> bytes:
        ident = b"\x7fELF" + bytes([self.elfclass, 1, 1, 0]) + bytes(8)   # little-endian, SYSV
        phsize = _PHDR.size if self.elfclass == 2 else _PHDR32.size
        return self.ehdr.pack(ident, ET_CORE, self.machine, 1, 0, self.ehdr.size, 0, 0, self.ehdr.size,
                              phsize, phnum, 0, 0, 0)


ELF64 = _Elf(2, EM_X86_64, _EHDR, "Q")
ELF32 = _Elf(1, EM_386, _EHDR32, "I")


@dataclass(frozen=True)
class CoreResult:
    path: str
    pid: int
    threads: int
    segments: int
    bytes: int


def _note(name: bytes, kind: int, desc: bytes) -> bytes:
    name += b"\0"
    pad = lambda b: b + bytes(-len(b) % 4)       # noqa: E731 - 4-byte alignment of each part
    return _NHDR.pack(len(name), len(desc), kind) + pad(name) + pad(desc)


def _prstatus(proc: ProcessImage, thread, pending: int, elf: _Elf = ELF64) -> bytes:
    t = proc.task
    if elf is ELF32:
        head = _PRSTATUS32_HEAD.pack(0, 0, 0, 0, pending & 0xFFFFFFFF, thread.sigmask & 0xFFFFFFFF,
                                     thread.tid, t.ppid, t.pgid, t.sid)
        named = dict(zip(GP_REG_NAMES, thread.regs))
        regs = _REGS32.pack(*(named[n] & 0xFFFFFFFF for n in I386_REGS))
        return head + bytes(4 * 8) + regs + struct.pack("<i", 1)
    head = _PRSTATUS_HEAD.pack(0, 0, 0, 0, pending, thread.sigmask, thread.tid, t.ppid, t.pgid, t.sid)
    return head + bytes(_TIMEVALS) + _REGS.pack(*thread.regs) + struct.pack("<i4x", 1)


def _prpsinfo(proc: ProcessImage, elf: _Elf = ELF64) -> bytes:
    t, creds = proc.task, proc.creds
    args = " ".join(t.cmdline).encode(errors="replace")[:79]
    state = t.state[:1].encode() or b"R"
    number = b"RSDTZW".find(state)
    layout, ids = (_PRPSINFO32, (creds.uids[0] & 0xFFFF, creds.gids[0] & 0xFFFF)) if elf is ELF32 else \
        (_PRPSINFO, (creds.uids[0], creds.gids[0]))
    return layout.pack(bytes([max(number, 0)]), state, b"\0", bytes([t.nice & 0xFF]), 0,
                       *ids, t.pid, t.ppid, t.pgid, t.sid, t.comm.encode(errors="replace")[:15], args)


def _auxv(proc: ProcessImage) -> bytes:
    # (a 32-bit process's vector of 4-byte pairs was read two pairs to an entry: the same bytes)
    return b"".join(struct.pack("<QQ", k, v) for k, v in (*proc.mm.auxv, (0, 0)))


def fsave_area(fxsave: bytes) -> bytes:
    """The 108-byte FSAVE area (struct user_i387_struct of ia32, NT_FPREGSET) of an FXSAVE
    one, as the kernel converts it (convert_from_fxsr): the full tag word from the
    abridged one and the registers' contents."""
    fcw, fsw, ftw, fop, fip, fcs, foo, fos = struct.unpack_from("<HHBxHIH2xIH", fxsave)
    top = (fsw >> 11) & 7
    tags = 0
    for phys in range(8):
        st = (phys - top) & 7
        mantissa, exponent = struct.unpack_from("<QH", fxsave, 32 + 16 * st)
        if not ftw & (1 << phys):
            tag = 3                                          # empty
        elif exponent & 0x7FFF == 0x7FFF:
            tag = 2                                          # NaN, infinity
        elif exponent & 0x7FFF == 0:
            tag = 1 if mantissa == 0 else 2                  # zero, denormal
        else:
            tag = 0 if mantissa >> 63 else 2                 # valid, unnormal
        tags |= tag << (2 * phys)
    env = struct.pack("<7I", 0xFFFF0000 | fcw, 0xFFFF0000 | fsw, 0xFFFF0000 | tags, fip,
                      fcs | (fop << 16), foo, 0xFFFF0000 | fos)
    return env + b"".join(fxsave[32 + 16 * i:32 + 16 * i + 10] for i in range(8))


def _file_backed(v: Vma) -> bool:
    return v.kind in (VmaKind.FILE_PRIVATE, VmaKind.FILE_SHARED) and v.path.startswith("/")


def _nt_file(vmas: Sequence[Vma], elf: _Elf = ELF64) -> bytes:
    files = [v for v in vmas if _file_backed(v)]
    w = elf.word
    out = struct.pack(f"<{w}{w}", len(files), PAGE_SIZE)
    out += b"".join(struct.pack(f"<{w}{w}{w}", v.start, v.end, v.pgoff // PAGE_SIZE) for v in files)
    return out + b"".join(v.path.removesuffix(" (deleted)").encode() + b"\0" for v in files)


def _flags(prot: int) -> int:
    return (PF_R if prot & 1 else 0) | (PF_W if prot & 2 else 0) | (PF_X if prot & 4 else 0)


class _Pages:
    """Where each saved page of a process is: its own image, else (pages it shares
    copy-on-write with its parent, which the image keeps once) its parent's."""

    def __init__(self, image: ImageReader, pid: int):
        self.image = image
        self.chain = []
        members = set(image.pids)
        while pid in members and pid not in self.chain:
            self.chain.append(pid)
            pid = image.process(pid).task.ppid

    def runs(self, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
        """(pid, vaddr, npages, file offset) of saved pages in [start, end), the process's
        own first (a page found there is not looked for further up)."""
        seen: list[tuple[int, int]] = []
        for pid in self.chain:
            for run in self.image.page_runs(pid):
                lo, hi = max(run.vaddr, start), min(run.vaddr + run.npages * PAGE_SIZE, end)
                for a, b in _minus((lo, hi), seen) if lo < hi else ():
                    yield pid, a, (b - a) // PAGE_SIZE, run.offset + (a - run.vaddr)
                    seen.append((a, b))


def _minus(span: tuple[int, int], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    parts = [span]
    for a, b in taken:
        parts = [p for lo, hi in parts for p in ((lo, min(hi, a)), (max(lo, b), hi)) if p[0] < p[1]]
    return parts


_XFEAT_COMPONENT = struct.Struct("<IIII")      # struct x86_xfeat_component: type, size, offset, flags


def xsave_layout(xcr0: int, xstate_size: int) -> bytes:
    """The NT_X86_XSAVE_LAYOUT note's bytes, as the kernel writes it after the threads'
    notes (arch/x86/kernel/fpu/xstate.c): for each extended feature (bit 2 and up) that
    XCR0 enables, its number, size and offset in the standard XSAVE layout of NT_X86_XSTATE.
    The layout is the CPU's (CPUID leaf 0xD): AMD's AVX-512 areas lie 0x100 bytes lower than
    Intel's, and a debugger that assumes Intel's (gdb 13) finds the note too small.
    CPUID tells this CPU's layout only: b"" (no note) when the image was dumped on a CPU
    with other features or another XSAVE size, whose layout this one cannot tell."""
    from .cpuid import cpuid
    try:
        here = cpuid(0xD, 0)
    except OSError:
        return b""
    if xcr0 & ~(here[0] | here[3] << 32) or here[1] != xstate_size:
        return b""                         # here[1]: the size for the XCR0 in force, the image's if the same
    out = b""
    for bit in range(2, 64):
        if xcr0 >> bit & 1:
            size, offset = cpuid(0xD, bit)[:2]
            if size:
                out += _XFEAT_COMPONENT.pack(bit, size, offset, 0)
    return out


def write_core(image: ImageReader, pid: int, path: str) -> CoreResult:
    """The core file of process `pid` of an open image, at `path` (0600)."""
    proc = image.process(pid)
    pages = _Pages(image, pid)
    vmas = [v for v in proc.vmas if v.kind not in (VmaKind.VSYSCALL, VmaKind.VVAR, VmaKind.VVAR_VCLOCK)]
    pending = 0
    for s in proc.pending:
        signo = struct.unpack_from("<i", s.siginfo)[0]
        if 0 < signo <= 64:
            pending |= 1 << (signo - 1)
    elf = ELF32 if compat_process(proc.threads, pid) else ELF64
    notes = _notes(proc, vmas, pending, elf)
    layout = xsave_layout(image.inventory.xfeatures, image.inventory.xstate_size)
    if layout:
        notes += _note(b"LINUX", NT_X86_XSAVE_LAYOUT, layout)

    loads = []
    for v in vmas:
        saved = list(pages.runs(v.start, v.end))
        whole = bool(saved) or not (_file_backed(v) or v.kind is VmaKind.DEVICE)
        loads.append((v, saved, whole and bool(v.prot & 1)))
    phnum = 1 + len(loads)
    notes_at = elf.ehdr.size + phnum * len(elf.phdr(0, 0, 0, 0, 0, 0, 0))
    data_at = -(-(notes_at + len(notes)) // PAGE_SIZE) * PAGE_SIZE
    phdrs = [elf.phdr(PT_NOTE, 0, notes_at, 0, len(notes), 0, 4)]
    offset = data_at
    for v, _saved, dumped in loads:
        size = v.end - v.start if dumped else 0
        phdrs.append(elf.phdr(PT_LOAD, _flags(v.prot), offset, v.start, size, v.end - v.start, PAGE_SIZE))
        offset += size
    header = elf.header(phnum)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.pwrite(fd, header + b"".join(phdrs), 0)
        os.pwrite(fd, notes, notes_at)
        offset = data_at
        for v, saved, dumped in loads:
            if not dumped:
                continue
            _write_mapping(fd, image, v, saved, offset, elf)
            offset += v.end - v.start
        os.ftruncate(fd, offset)                            # trailing holes count too
    finally:
        os.close(fd)
    return CoreResult(path, pid, len(proc.threads), phnum, offset)


def _notes(proc: ProcessImage, vmas: Sequence[Vma], pending: int, elf: _Elf) -> bytes:
    """Per thread its registers and FPU state, after the first the process's notes; an
    ia32 thread's FPU state as the kernel dumps it too (FSAVE, then FXSAVE in NT_PRXFPREG)."""
    notes = b""
    for n, thread in enumerate(proc.threads):
        notes += _note(b"CORE", NT_PRSTATUS, _prstatus(proc, thread, pending, elf))
        if n == 0:
            notes += _note(b"CORE", NT_PRPSINFO, _prpsinfo(proc, elf))
            notes += _note(b"CORE", NT_AUXV, _auxv(proc))
            notes += _note(b"CORE", NT_FILE, _nt_file(vmas, elf))
        if elf is ELF32:
            notes += _note(b"CORE", NT_FPREGSET, fsave_area(thread.xstate[:FXSAVE_SIZE]))
            notes += _note(b"LINUX", NT_PRXFPREG, thread.xstate[:FXSAVE_SIZE])
        else:
            notes += _note(b"CORE", NT_FPREGSET, thread.xstate[:FXSAVE_SIZE])
        notes += _note(b"LINUX", NT_X86_XSTATE, thread.xstate)
    return notes


def _write_mapping(fd: int, image: ImageReader, v: Vma, saved, at: int, elf: _Elf = ELF64) -> None:
    """A mapping's bytes at file offset `at`: the mapped file's first (where it has one),
    then the image's pages over them."""
    if v.kind is VmaKind.VDSO:
        _write_vdso(fd, v, at, elf)
    elif _file_backed(v) and not v.file_deleted:
        try:
            src = os.open(v.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            src = -1
        if src >= 0:
            try:
                _copy(src, v.pgoff, fd, at, v.end - v.start)    # past the file's end: a hole
            finally:
                os.close(src)
    for pid, vaddr, npages, offset in saved:
        src, base = image.pages_location(pid, PageRun(vaddr, npages, offset))
        if _copy(src, base, fd, at + (vaddr - v.start), npages * PAGE_SIZE) < npages * PAGE_SIZE:
            raise OSError(f"page data of process {pid} ends early")


def _copy(src: int, src_at: int, dst: int, dst_at: int, size: int) -> int:
    """pread/pwrite `size` bytes (less at the source's end); the bytes copied."""
    done = 0
    while done < size:
        chunk = os.pread(src, min(size - done, 8 << 20), src_at + done)
        if not chunk:
            break
        os.pwrite(dst, chunk, dst_at + done)
        done += len(chunk)
    return done


def _write_vdso(fd: int, v: Vma, at: int, elf: _Elf = ELF64) -> None:
    """The vdso is the kernel's: this kernel's own (ptckpt's; its 32-bit one for an ELF32
    core), when it has the same size, else a hole; the image's saved vdso pages, where it
    has them (resources.vdso), are written over it."""
    if elf is ELF32:
        text = memory.probe_vdso32()[1]
        if len(text) == v.end - v.start:
            os.pwrite(fd, text, at)
        return
    text = vdso.own_text()
    if len(text) == v.end - v.start:
        os.pwrite(fd, text, at)


def write_cores(directory: str, out: str) -> list[CoreResult]:
    """`ptckpt core -D DIRECTORY -o OUT`: OUT/core.PID for every process of the image
    (OUT made 0700 if missing)."""
    with ImageReader(directory) as image:
        try:
            os.makedirs(out, mode=0o700, exist_ok=True)
        except OSError as err:
            raise OutputError(out, err) from None
        done = []
        for pid in image.pids:
            path = os.path.join(out, f"core.{pid}")
            try:
                done.append(write_core(image, pid, path))
            except OSError as err:
                raise OutputError(path, err) from None
        return done

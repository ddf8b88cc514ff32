"""The vdso across kernel builds: a restore on a kernel whose vdso is not the image's.

A program keeps pointers into its vdso: glibc resolves ``__vdso_clock_gettime`` and the
others once at start-up (and ``gettimeofday``/``time`` through IFUNCs into GOTs), its link
map points at the vdso's ELF headers, a thread may be stopped inside one of its functions.
So the vdso a restored process finds at the image's address must have the image's
functions at the image's offsets.

dump half
    the vdso's bytes are saved with the process's memory, whole (memory.ranges_to_save),
    like any private page: they are what the program saw.

restore half
    :func:`judge` compares the image's vdso (its saved bytes: size, functions and their
    offsets from the ELF dynamic symbol table) with this kernel's (ptckpt's own):

    * the same layout ([vdso] and [vvar] sizes and distance) and every exported function
      at the same offset: this kernel's vdso is moved to the image's address, as before;
    * otherwise the **proxy** (CRIU's way, criu/pie/parasite-vdso.c): this kernel's vdso
      and its data pages are parked at a free address, the image's vdso bytes are put back
      at the image's address as a private mapping, and the entry of each function it
      exports gets a jump (``movabs $f, %rax; jmp *%rax``: %rax is a scratch register at
      a call) to the function of the same name in this kernel's vdso.  The image's [vvar]
      areas stay empty: only the image's vdso code read them, and its entries now lead away.
    * refused, by name, before anything runs: a function the image's vdso exports that
      this kernel's does not, an entry too short for the jump, saved bytes that are not a
      whole vdso; and, for an image saved without its vdso's bytes (an older ptckpt), a
      layout other than this kernel's.

The auxv keeps AT_SYSINFO_EHDR at the image's address (the proxy there is a whole ELF, as
the program saw), and signal frames return through the program's own restorer
(SA_RESTORER, in libc on x86-64), never through the vdso.  A 32-bit process keeps its own
check (memory._map_vdso32_frozen): this kernel's 32-bit vdso is mapped where the image had
one, refused when laid out otherwise.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import procfs
from ..errors import Incompatible
from ..formats.model import GP_REG_NAMES, PAGE_SIZE, Thread, Vma, VmaKind
from .memory import vdso_mismatch

_RIP = GP_REG_NAMES.index("rip")

JUMP_SIZE = 12                 # 48 b8 imm64 (movabs $imm64, %rax); ff e0 (jmp *%rax)

# Functions that read no kernel data: where this kernel's vdso lacks one, the image's code
# stays as it is.  __vdso_sgx_enter_enclave wraps ENCLU (arch/x86/entry/vdso/vsgx.S): on a
# kernel built without SGX it raises #UD here as it would in a program started here.
SELF_CONTAINED = frozenset({"__vdso_sgx_enter_enclave"})


def jump(to: int) -> bytes:
    """The bytes of a jump to absolute address `to` through %rax."""
    return b"\x48\xb8" + struct.pack("<Q", to) + b"\xff\xe0"


@dataclass(frozen=True)
class Build:
    """One vdso, as its ELF says: size in bytes (the mapping), GNU build-id, and each
    exported function by name (version stripped) -> (offset in the mapping, size)."""

    size: int
    build_id: str
    functions: dict[str, tuple[int, int]] = field(default_factory=dict)


class NotAVdso(ValueError):
    """Bytes that are no whole vdso (not an ELF, or its symbols lie outside them)."""


def parse(text: bytes) -> Build:
    """The Build of the vdso whose mapping holds `text`: symbols from the dynamic symbol
    table found through PT_DYNAMIC (as the kernel's and CRIU's vdso parsers find it), offsets
    relative to the mapping (st_value minus the PT_LOAD's p_vaddr - p_offset)."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    try:
        elf = ELFFile(io.BytesIO(text))
        loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        if not loads or elf["e_machine"] != "EM_X86_64":
            raise NotAVdso("no x86-64 ELF with a PT_LOAD")
        bias = loads[0]["p_vaddr"] - loads[0]["p_offset"]
        dynamic = next((s for s in elf.iter_segments() if s["p_type"] == "PT_DYNAMIC"), None)
        if dynamic is None:
            raise NotAVdso("no PT_DYNAMIC")
        functions = {}
        for sym in dynamic.iter_symbols():
            if (sym["st_info"]["type"] == "STT_FUNC" and sym["st_shndx"] != "SHN_UNDEF"
                    and sym["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK")):
                offset = sym["st_value"] - bias
                if not 0 <= offset < offset + sym["st_size"] <= len(text):
                    raise NotAVdso(f"{sym.name} lies beyond its {len(text)} bytes")
                functions[sym.name.split("@")[0]] = (offset, sym["st_size"])
        build_id = ""
        for seg in elf.iter_segments():
            if seg["p_type"] == "PT_NOTE":
                build_id = next((n["n_desc"] for n in seg.iter_notes() if n["n_type"] == "NT_GNU_BUILD_ID"),
                                build_id)
    except (ELFError, struct.error, KeyError, IndexError) as err:
        raise NotAVdso(str(err) or type(err).__name__) from None
    if not functions:
        raise NotAVdso("it exports no function")
    return Build(len(text), build_id, functions)


def own_text() -> bytes:
    """This kernel's 64-bit vdso: ptckpt's own, read through /proc/self/mem."""
    for m in procfs.read_maps(os.getpid()):
        if m.path == "[vdso]":
            with open("/proc/self/mem", "rb", buffering=0) as mem:
                mem.seek(m.start)
                return mem.read(m.end - m.start)
    return b""


def image_text(start: int, end: int, sources) -> bytes | None:
    """The saved bytes of memory [start, end) from a process's page sources ((fd, base, runs)
    as ImageReader.page_sources gives them; the fd may be O_DIRECT: read into page-aligned
    memory), or None where a page of it was not saved."""
    size = end - start
    buf = mmap.mmap(-1, size)
    view = memoryview(buf)
    try:
        have = 0
        for fd, base, runs in sources:
            for r in runs:
                s, e = max(r.vaddr, start), min(r.vaddr + r.npages * PAGE_SIZE, end)
                if s < e:
                    if os.preadv(fd, [view[s - start:e - start]], base + r.offset + (s - r.vaddr)) != e - s:
                        return None
                    have += e - s
        text = bytes(view)
    finally:
        view.release()
        buf.close()
    return text if have == size else None


@dataclass(frozen=True)
class Verdict:
    """How a restore here makes the image's vdso: `proxy` (else this kernel's is moved to the
    image's address), with the two builds; `detail` for `check --image`."""

    proxy: bool
    detail: str
    image: Build | None = None
    host: Build | None = None

    def patches(self, image_base: int, host_base: int) -> list[tuple[int, bytes]]:
        """(address, bytes) of the jumps to write over the image's vdso at `image_base`,
        each into the function of the same name in this kernel's vdso at `host_base`."""
        assert self.image is not None and self.host is not None
        out = {}
        for name, (offset, _size) in self.image.functions.items():
            if name not in self.host.functions:
                continue                              # SELF_CONTAINED: the image's own code
            out[image_base + offset] = jump(host_base + self.host.functions[name][0])
        return sorted(out.items())


def _image_vdso(image_vmas: Sequence[Vma]) -> Vma | None:
    return next((v for v in image_vmas if v.kind is VmaKind.VDSO), None)


def judge(image_vmas: Sequence[Vma], saved, host_maps: Sequence, host_text: bytes,
          threads: Sequence[Thread] = ()) -> Verdict:
    """Whether this kernel's vdso (`host_maps` its layout, `host_text` its bytes) stands in
    for the image's as it is, or through the proxy; Incompatible (naming what) when neither
    works.  `saved(start, end)`: the process's saved memory there, or None where it was not
    saved (ImageReader.read_memory, or image_text over its page sources);
    `threads`: its threads, none of which may have been stopped inside a vdso that needs
    the proxy (the rest of that function would read the other kernel's data pages)."""
    vma = _image_vdso(image_vmas)
    if vma is None:
        return Verdict(False, "the image has no vdso")
    text = saved(vma.start, vma.end)
    why = vdso_mismatch(image_vmas, host_maps)
    if text is None:
        if why:
            raise Incompatible(f"cannot restore on this kernel: {why}, and the image holds no copy of its "
                               "vdso to make a proxy of (made by an older ptckpt)")
        return Verdict(False, "laid out as this kernel's (the image holds no copy of its vdso to compare)")
    if text == host_text and not why:           # the common case, decided without parsing an ELF
        return Verdict(False, "the same build as this kernel's")
    try:
        image = parse(text)
    except NotAVdso as err:
        raise Incompatible(f"cannot restore on this kernel: the image's [vdso] ({len(text)} bytes) "
                           f"is not a whole vdso: {err}") from None
    if not host_text:
        raise Incompatible("cannot restore on this kernel: it maps no vdso, and the image's program has one")
    host = parse(host_text)
    same = all(host.functions.get(n, (None,))[0] == off for n, (off, _s) in image.functions.items())
    if same and not why:
        return Verdict(False, "the same build as this kernel's" if image.build_id == host.build_id else
                       f"build {image.build_id[:12]}, its functions where this kernel's are: this kernel's "
                       "vdso takes its place", image, host)
    kept = sorted((set(image.functions) - set(host.functions)) & SELF_CONTAINED)
    missing = sorted(set(image.functions) - set(host.functions) - SELF_CONTAINED)
    if missing:
        raise Incompatible(f"cannot restore on this kernel: the image's vdso exports {', '.join(missing)}, "
                           "this kernel's does not: no vdso proxy can lead there")
    short = sorted(n for n, (_off, size) in image.functions.items() if size < JUMP_SIZE and n not in kept)
    if short:
        raise Incompatible(f"cannot restore on this kernel: in the image's vdso {', '.join(short)} "
                           f"has fewer than the {JUMP_SIZE} bytes a proxy's jump takes")
    entries = {vma.start + off for n, (off, _size) in image.functions.items() if n not in kept}
    for t in threads:
        rip = t.regs[_RIP]
        if vma.start <= rip < vma.end and rip not in entries:
            raise Incompatible(f"cannot restore on this kernel: thread {t.tid} was stopped inside the image's "
                               f"vdso (rip {rip:#x}), in code that reads the other kernel's data: restore it "
                               "where it was made, or dump it again (a thread leaves the vdso in microseconds)")
    names = sorted(n for n in image.functions if n.startswith("__vdso_") and n not in kept)
    return Verdict(True, f"another kernel build (image's vdso {image.build_id[:12] or '?'}, {image.size} bytes; "
                         f"this kernel's {host.build_id[:12] or '?'}, {host.size} bytes): a vdso proxy leads "
                         f"{', '.join(names)} into this kernel's vdso"
                         + (f" ({', '.join(kept)}: the image's own code, it reads no kernel data)" if kept else ""),
                   image, host)

"""The way home of a thread we inject syscalls into, should ptckpt vanish meanwhile.

While a thread runs injected syscalls its registers are not its own: they point at a
``syscall`` instruction of the vdso, with our numbers in them.  If the tracer dies there
(SIGKILL, OOM, a crash), the kernel lets the thread go on from exactly that state.  So
before the first injected syscall, a signal frame holding the thread's own context is
written below its stack's red zone, and the injected registers are set so that what the
thread would run next, on its own, leads into rt_sigreturn with that frame:

    syscall                 the injected one (run to its end, if it had begun)
    leave | pop %rbp        the vdso's epilogue after that syscall: %rsp = %rbp = A
    xor ...; ret            pops the address at A+8: a ``mov $15,%eax; syscall``
    rt_sigreturn            (glibc's or musl's __restore_rt) reads the frame at A+8

rt_sigreturn puts back every register, the FPU/AVX state (the frame's xsave area), the
signal mask, and leaves the alternate signal stack alone (the frame's stack flags are
invalid on purpose, which the kernel ignores).  A syscall the thread was frozen in is
re-issued, as the kernel's own restart would (a restart_syscall block is re-issued as the
original call: a sleep sleeps its whole time again).

The frame is only a way home: while ptckpt is alive it stops the thread at every syscall
exit and puts its registers back itself; the bytes under the frame are written back too.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Protocol

from . import cpuid, procfs
from .errors import PtckptError

SIGRETURN_CODES = (b"\x48\xc7\xc0\x0f\x00\x00\x00\x0f\x05",     # mov $15,%rax; syscall (glibc, musl)
                   b"\xb8\x0f\x00\x00\x00\x0f\x05")             # mov $15,%eax; syscall (Go)
_SEARCH_LIMIT = 256 << 20            # bytes of executable mappings searched for one

FP_XSTATE_MAGIC1 = 0x46505853
FP_XSTATE_MAGIC2 = 0x46505845
_SW_BYTES = 464                      # fx_sw_reserved in the fxsave area
UC_FP_XSTATE, UC_SIGCONTEXT_SS, UC_STRICT_RESTORE_SS = 1, 2, 4
SS_INVALID = 3                       # neither 0, SS_ONSTACK nor SS_DISABLE: sigaltstack left as it is
FRAME_SIZE = 8 + 304 + 128           # struct rt_sigframe: pretcode, ucontext, siginfo
_SIGCONTEXT_REGS = ("r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rdi", "rsi", "rbp", "rbx",
                    "rdx", "rax", "rcx", "rsp", "rip", "eflags")
RED_ZONE = 128


class _Memory(Protocol):
    pid: int

    def read(self, addr: int, size: int) -> bytes: ...


@dataclass(frozen=True)
class ReturnPath:
    """Where a thread goes home from: `syscall` (a vdso syscall instruction followed by an
    epilogue that returns), `pops` (words the epilogue pops before its ret: 1 after
    leave or pop %rbp, else 0) and `sigreturn` (a rt_sigreturn instruction sequence)."""

    syscall: int
    pops: int
    sigreturn: int


def epilogue_pops(code: bytes) -> int | None:
    """Words popped before the `ret` that ends `code` (the bytes after a syscall
    instruction), if they are an epilogue that touches nothing else we rely on: an optional
    leave or pop %rbp, register clearing xors, ret.  None for anything else."""
    i, pops = 0, 0
    if code[:1] in (b"\xc9", b"\x5d"):                     # leave | pop %rbp
        i, pops = 1, 1
    while i < len(code):
        b = code[i]
        if b == 0xC3:
            return pops
        if b in (0x31, 0x33) and i + 1 < len(code) and code[i + 1] >> 6 == 3:
            i += 2                                         # xor r32, r32
        elif b in (0x45, 0x48, 0x4D) and i + 2 < len(code) and code[i + 1] in (0x31, 0x33) \
                and code[i + 2] >> 6 == 3:
            i += 3                                         # xor r64/r8d.., same
        else:
            return None
    return None


def _exec_maps(pid: int) -> list[tuple[int, int, str]]:
    return [(m.start, m.end, m.path) for m in procfs.read_maps(pid) if m.prot & procfs.PROT_EXEC]


def find_return_path(mem: _Memory) -> ReturnPath | None:
    """The return path of this thread group, or None where it has no usable vdso syscall or
    no rt_sigreturn code mapped (then a vanished tracer leaves injected registers behind)."""
    try:
        maps = _exec_maps(mem.pid)
    except (OSError, PtckptError):
        return None
    syscall = pops = None
    for start, end, path in maps:
        if path != "[vdso]":
            continue
        code = mem.read(start, end - start)
        at = code.find(b"\x0f\x05")
        while at >= 0:
            found = epilogue_pops(code[at + 2:at + 64])
            if found is not None:
                syscall, pops = start + at, found
                break
            at = code.find(b"\x0f\x05", at + 1)
    if syscall is None or pops is None:
        return None
    # libc first (where __restore_rt is), then the rest
    ordered = sorted((m for m in maps if m[2] not in ("[vdso]", "[vsyscall]")),
                     key=lambda m: not os.path.basename(m[2]).startswith(("libc.", "libc-", "ld-musl")))
    budget = _SEARCH_LIMIT
    for start, end, _path in ordered:
        size = min(end - start, budget)
        if size <= 0:
            break
        budget -= size
        try:
            code = mem.read(start, size)
        except Exception:                                  # an unreadable mapping: skip it
            continue
        for pattern in SIGRETURN_CODES:
            at = code.find(pattern)
            if at >= 0:
                return ReturnPath(syscall, pops, start + at)
    return None


def home_regs(regs) -> dict[str, int]:
    """The registers the thread resumes with, as the kernel's restart logic would leave them:
    a syscall it was frozen in is made again (rip back over the instruction, rax its number)."""
    values = {name: getattr(regs, name) for name in _SIGCONTEXT_REGS}
    nr = regs.signed("orig_rax")
    if nr >= 0 and -516 <= regs.signed("rax") <= -512 and regs.signed("rax") != -515:
        values["rip"] = (values["rip"] - 2) & (2**64 - 1)
        values["rax"] = nr
    return values


def xsave_area(xstate: bytes) -> bytes | None:
    """The NT_X86_XSTATE regset as a signal frame's fpstate, or None when it is not in the
    XSAVE layout.  ptrace puts XCR0 in the first software-reserved bytes (464); a frame
    holds the fx_sw_bytes there that tell rt_sigreturn an XSAVE area follows (its magic,
    features and size), and a second magic after the area.

    ptrace's area has room for AMX tile data where the CPU has it, but a thread that never
    asked for tiles (ARCH_REQ_XCOMP_PERM) has a smaller signal frame, and rt_sigreturn
    takes only the legacy FX part (no AVX upper halves) of an area bigger than that: so
    the tile data is cut off where the thread holds none."""
    size = len(xstate)
    if size < _SW_BYTES + 48 + 64:     # the legacy area and the XSAVE header at least (the size
        return None                    # need not be a multiple of 64: 2440 bytes with AVX+PKRU)
    (xcr0,) = struct.unpack_from("<Q", xstate, _SW_BYTES)
    (in_use,) = struct.unpack_from("<Q", xstate, 512)           # XSTATE_BV
    tiles = 1 << cpuid.XFEATURE_XTILEDATA
    if xcr0 & tiles and not in_use & tiles:
        cut = cpuid.xfeature_offset(cpuid.XFEATURE_XTILEDATA)
        if 576 < cut < size and not cut % 64:
            xstate, size, xcr0 = xstate[:cut], cut, xcr0 & ~tiles
    sw = struct.pack("<IIQI", FP_XSTATE_MAGIC1, size + 4, xcr0, size)
    return xstate[:_SW_BYTES] + sw + xstate[_SW_BYTES + len(sw):] + struct.pack("<I", FP_XSTATE_MAGIC2)


@dataclass(frozen=True)
class Frame:
    """The bytes to write at `low` (the frame and its fpstate) and the registers the
    injection then uses: rsp and rbp at `entry`, scratch memory below `scratch_top`."""

    low: int
    data: bytes
    entry: int
    scratch_top: int


def build(path: ReturnPath, regs, sigmask: int, fpstate: bytes) -> Frame:
    """The frame under the red zone of the stack `regs` has: [fpstate, 64-aligned] above
    [rt_sigframe at F] above [A = F - 8: a word for %rbp, then F's pretcode = sigreturn]."""
    top = (regs.rsp - RED_ZONE) & ~63
    fp = (top - len(fpstate)) & ~63
    frame = (fp - FRAME_SIZE) & ~15
    a = frame - 8
    home = home_regs(regs)
    sigcontext = struct.pack("<18Q", *(home[n] for n in _SIGCONTEXT_REGS))
    sigcontext += struct.pack("<4H", regs.cs, 0, 0, regs.ss)
    sigcontext += struct.pack("<4QQ8Q", 0, 0, 0, 0, fp, *([0] * 8))
    assert len(sigcontext) == 256
    uc = struct.pack("<QQQiiQ", UC_FP_XSTATE | UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS, 0,
                     0, SS_INVALID, 0, 0) + sigcontext + struct.pack("<Q", sigmask)
    body = struct.pack("<QQ", regs.rbp, path.sigreturn) + uc + bytes(128)
    body += bytes(fp - (a + len(body))) + fpstate
    entry = a if path.pops else a + 8
    return Frame(a, body, entry, a & ~15)

"""The way home of a 32-bit (ia32, compat) thread we inject syscalls into, should ptckpt
vanish meanwhile: ptckpt.returnframe's idea in compat form.

A compat thread runs two kinds of injected syscalls: x86_64 ones in 64-bit mode (cs
__USER_CS) at a `syscall` instruction, and i386 ones through `int $0x80`.  Before the first,
an ia32 rt_sigframe (struct rt_sigframe_ia32: ucontext_ia32, then the fpstate: an i387
environment and the XSAVE area) holding the thread's own context is written below its
stack, and either kind leads into the vdso's __kernel_rt_sigreturn (`mov $173,%eax;
int $0x80`: the i386 rt_sigreturn, which restores cs from the frame, so it brings the
thread back to 32-bit mode from either mode) with esp just above the frame's pretcode:

    i386 call at the vdso's int $0x80 (__kernel_vsyscall's), in 32-bit mode:
        int $0x80; pop %ebp; pop %edx; pop %ecx; ret    esp = F - 12: ret pops the pretcode
    x86_64 call, in 64-bit mode, at a gadget ptckpt writes into the vdso's padding:
        syscall; jmp __kernel_rt_sigreturn              rsp = F + 4

The 32-bit vdso has no `syscall` followed by a way home in 64-bit mode (its only one,
__kernel_vsyscall's, is followed by int $0x80, which would make our result an i386 syscall
number), nor has any 32-bit library a 64-bit rt_sigreturn; hence the gadget: four bytes
(`0f 05 eb rel8`) over the nop padding that follows __kernel_rt_sigreturn, code nothing
runs but an injection.  ptckpt puts the nops back when its injections end; a vanished
ptckpt leaves the four bytes there (harmless padding, found and used again by the next
dump).  Both paths keep esp below what rt_sigreturn reads of the frame (the x86_64 one at
F + 4, over the pretcode it has no use for), so a signal delivered on the way runs its
handler below it, and the handler's rt_sigreturn comes back to the path.

The i386 rt_sigreturn puts back the eight 32-bit registers, eip, eflags, the segment
registers (cs, ss, and ds, es, fs, gs where they differ), the FPU/SSE/AVX state (the i387
environment folded into the XSAVE area) and the signal mask, and leaves the alternate
signal stack alone (invalid stack flags).  A syscall the thread was frozen in is made
again (returnframe.home_regs: int $0x80 and the vdso's sysenter/syscall landing are two
bytes before the restart point too).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

from . import procfs
from .errors import PtckptError
from .returnframe import SS_INVALID, UC_FP_XSTATE, home_regs, xsave_area

RT_SIGRETURN = b"\xb8\xad\x00\x00\x00\xcd\x80"   # mov $173,%eax; int $0x80 (__kernel_rt_sigreturn)
NOP = 0x90
GADGET_SIZE = 4                                  # syscall; jmp rel8
FREGS_SIZE = 112                                 # struct fregs_state: the i387 environment, status, magic
FRAME_SIZE = 16 + 128 + 116 + 8                  # struct rt_sigframe_ia32 (arch/x86/include/asm/sigframe.h)
RED_ZONE = 128                                   # none in the i386 ABI: room for safety


class _Memory(Protocol):
    pid: int

    def read(self, addr: int, size: int) -> bytes: ...


@dataclass(frozen=True)
class ReturnPath:
    """Where a compat thread goes home from, all in its [vdso]: `int80` (an int $0x80
    followed by `pops` pops and a ret), `sigreturn` (__kernel_rt_sigreturn), `gadget`
    (where the x86_64 syscall gadget `code` goes, over nop padding)."""

    int80: int
    pops: int
    sigreturn: int
    gadget: int
    code: bytes

    @property
    def padding(self) -> bytes:
        """What the gadget covers."""
        return bytes([NOP]) * GADGET_SIZE


def int80_pops(code: bytes) -> int | None:
    """Words popped before the ret that ends `code` (the bytes after an int $0x80), if they
    are single-register pops then ret (__kernel_vsyscall's epilogue); None for anything else."""
    for i, b in enumerate(code[:8]):
        if b == 0xC3:
            return i
        if not 0x58 <= b <= 0x5F or b == 0x5C:      # pop r32, but never pop %esp
            return None
    return None


def gadget_code(at: int, sigreturn: int) -> bytes:
    """syscall; jmp sigreturn (rel8), placed at `at`."""
    rel = sigreturn - (at + GADGET_SIZE)
    assert -128 <= rel < 128
    return b"\x0f\x05\xeb" + struct.pack("<b", rel)


def find_return_path(mem: _Memory) -> ReturnPath | None:
    """The compat return path of this thread group, or None where its [vdso] has no
    __kernel_rt_sigreturn with nop padding after it or no int $0x80 epilogue."""
    try:
        vdso = [m for m in procfs.read_maps(mem.pid) if m.path == "[vdso]"]
    except (OSError, PtckptError):
        return None
    if len(vdso) != 1:
        return None
    start, code = vdso[0].start, mem.read(vdso[0].start, vdso[0].end - vdso[0].start)
    sig = code.find(RT_SIGRETURN)
    if sig < 0:
        return None
    at = sig + len(RT_SIGRETURN) + 1           # the nop right after int $0x80 is the symbol's own
    gadget = gadget_code(start + at, start + sig)
    if code[at - 1] != NOP or code[at:at + GADGET_SIZE] not in (bytes([NOP]) * GADGET_SIZE, gadget):
        return None
    at80 = code.find(b"\xcd\x80")
    while at80 >= 0:
        pops = int80_pops(code[at80 + 2:])
        if pops is not None:
            return ReturnPath(start + at80, pops, start + sig, start + at, gadget)
        at80 = code.find(b"\xcd\x80", at80 + 1)
    return None


def fpstate(xstate: bytes) -> bytes | None:
    """The NT_X86_XSTATE regset as an ia32 frame's fpstate: struct fregs_state (the i387
    environment, which rt_sigreturn folds into the x87 part of the area: control, status
    and tag words, last instruction and operand, the eight registers; then status and the
    FXSR magic 0) before the XSAVE area with its fx_sw_bytes (returnframe.xsave_area).
    None when the regset is not in the XSAVE layout."""
    area = xsave_area(xstate)
    if area is None:
        return None
    cwd, swd, ftw, fop, fip, fdp = struct.unpack_from("<HHBxHQQ", area)
    twd = 0                                     # abridged tag bit i set: valid (00), else empty (11)
    for i in range(8):
        twd |= (0 if ftw >> i & 1 else 3) << 2 * i
    st = b"".join(area[32 + 16 * i:32 + 16 * i + 10] for i in range(8))
    env = struct.pack("<7I", cwd | 0xFFFF0000, swd | 0xFFFF0000, twd | 0xFFFF0000,
                      fip & 0xFFFFFFFF, fop << 16, fdp & 0xFFFFFFFF, 0xFFFF0000) + st
    return env + struct.pack("<HH", swd, 0) + area


@dataclass(frozen=True)
class Frame:
    """The bytes to write at `low` (the i386 path's pop slots, the frame, its fpstate) and
    the stack pointers of the two paths: `entry32` (i386 calls), `entry64` (x86_64 calls);
    scratch memory below `scratch_top`."""

    low: int
    data: bytes
    entry32: int
    entry64: int
    scratch_top: int


def _low32(value: int) -> int:
    return value & 0xFFFFFFFF


def build(path: ReturnPath, regs, sigmask: int, fp: bytes) -> Frame:
    """Under the stack `regs` has: [fpstate: i387 environment, then the XSAVE area at a
    64-byte boundary] above [the frame at F, F + 4 16-byte aligned] above [pop slots]."""
    top = (_low32(regs.rsp) - RED_ZONE) & ~63
    area = (top - (len(fp) - FREGS_SIZE)) & ~63
    buf = area - FREGS_SIZE
    frame = ((buf - FRAME_SIZE + 4) & ~15) - 4
    low = frame - 4 * path.pops
    home = {name: _low32(value) for name, value in home_regs(regs).items()}
    sc = struct.pack("<8H", regs.gs, 0, regs.fs, 0, regs.es, 0, regs.ds, 0)
    sc += struct.pack("<8I", *(home[n] for n in ("rdi", "rsi", "rbp", "rsp", "rbx", "rdx", "rcx", "rax")))
    sc += struct.pack("<3I2HI I2H3I", 0, 0, home["rip"], regs.cs, 0, home["eflags"], home["rsp"],
                      regs.ss, 0, buf, _low32(sigmask), 0)
    assert len(sc) == 88
    uc = struct.pack("<IIIiI", UC_FP_XSTATE, 0, 0, SS_INVALID, 0) + sc + struct.pack("<Q", sigmask)
    body = struct.pack("<IiII", path.sigreturn, 0, frame + 16, frame + 144) + bytes(128) + uc + bytes(8)
    assert len(body) == FRAME_SIZE
    data = bytes(4 * path.pops) + body
    data += bytes(buf - (low + len(data))) + fp
    return Frame(low, data, low, frame + 4, low & ~15)

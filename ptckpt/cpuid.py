"""The CPUID instruction, for what the kernel does not tell through /proc: where each XSAVE
feature lives in the standard (non-compacted) layout that ptrace and signal frames use
(leaf 0xD, one subleaf per feature: EAX its size, EBX its offset).

Python has no CPUID, so a few bytes of x86-64 code are placed in an executable mapping of
ptckpt's own and called through ctypes (System V ABI: leaf, subleaf, a 16-byte out buffer).
"""

from __future__ import annotations

import ctypes
import functools
import mmap

# push %rbx; mov %rdx,%r8; mov %edi,%eax; mov %esi,%ecx; cpuid;
# mov %eax,(%r8); mov %ebx,4(%r8); mov %ecx,8(%r8); mov %edx,12(%r8); pop %rbx; ret
_CODE = bytes.fromhex("53" "4989d0" "89f8" "89f1" "0fa2"
                      "418900" "41895804" "41894808" "4189500c" "5b" "c3")

XFEATURE_XTILEDATA = 18         # AMX tile data: the one feature a process must ask for first
                                # (arch_prctl ARCH_REQ_XCOMP_PERM): "dynamic" in the kernel's words

# The XSAVE feature bits by name (the kernel's xfeature_names[], arch/x86/kernel/fpu/xstate.c).
XFEATURE_NAMES = {
    0: "x87 floating point", 1: "SSE", 2: "AVX", 3: "MPX bounds registers", 4: "MPX CSR",
    5: "AVX-512 opmask", 6: "AVX-512 Hi256", 7: "AVX-512 ZMM_Hi256", 8: "Processor Trace",
    9: "Protection Keys (PKRU)", 10: "PASID", 11: "CET user", 12: "CET supervisor",
    13: "HDC", 14: "UINTR", 15: "LBR", 16: "HWP", 17: "AMX tile config", 18: "AMX tile data",
    19: "APX",
}


def xfeature_names(mask: int) -> list[str]:
    """The names of the XSAVE features in `mask` ("bit N" for one without a name)."""
    return [XFEATURE_NAMES.get(b, f"bit {b}") for b in range(64) if mask >> b & 1]


@functools.cache
def _function():
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(_CODE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    fn = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)(address)
    return page, fn                 # the mapping lives as long as the function


@functools.cache
def cpuid(leaf: int, subleaf: int = 0) -> tuple[int, int, int, int]:
    """(eax, ebx, ecx, edx) of CPUID leaf/subleaf on this CPU."""
    _page, fn = _function()
    out = (ctypes.c_uint32 * 4)()
    fn(leaf, subleaf, ctypes.addressof(out))
    return tuple(out)


def xfeature_offset(bit: int) -> int:
    """Offset of XSAVE feature `bit` (2 and up) in the standard layout."""
    return cpuid(0xD, bit)[1]

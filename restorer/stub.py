"""The restorer stub: a minimal static ELF emitted from Python.

Why emitted and not built: a fresh ``pip install`` must just work, with no
compiler or assembler on the machine, and the stub is a dozen bytes of code.
The machine code below is what ``as`` makes of ``stub.S`` beside this file
(tests/test_restorer.py re-assembles it and compares, when binutils exist).

Layout: one read+exec PT_LOAD segment at STUB_BASE holding the ELF header,
the program headers and the code, plus PT_GNU_STACK (non-executable stack).
"""

from __future__ import annotations

import os
import struct

STUB_BASE = 0x10000          # vm.mmap_min_addr's usual value: far from where programs live

# stub.S, assembled (x86_64):
CODE = bytes.fromhex(
    "bf7f000000"    # mov $127, %edi
    "b8e7000000"    # mov $231, %eax        (exit_group)
    "0f05"          # syscall
    "f4"            # hlt
    "0f05"          # gadget: syscall
    "cc"            # int3
)
GADGET_OFFSET = 13           # offset of `gadget` in CODE

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
PT_LOAD = 1
PT_GNU_STACK = 0x6474E551
PF_X, PF_W, PF_R = 1, 2, 4
CODE_OFFSET = _EHDR.size + 2 * _PHDR.size


def build_stub() -> bytes:
    """The whole ELF executable."""
    size = CODE_OFFSET + len(CODE)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)   # ELFCLASS64, LSB, EV_CURRENT, SYSV
    ehdr = _EHDR.pack(ident, 2, 62, 1,                    # ET_EXEC, EM_X86_64, EV_CURRENT
                      STUB_BASE + CODE_OFFSET,            # e_entry
                      _EHDR.size, 0,                      # e_phoff, e_shoff
                      0, _EHDR.size, _PHDR.size, 2,       # flags, ehsize, phentsize, phnum
                      0, 0, 0)                            # shentsize, shnum, shstrndx
    load = _PHDR.pack(PT_LOAD, PF_R | PF_X, 0, STUB_BASE, STUB_BASE, size, size, 0x1000)
    stack = _PHDR.pack(PT_GNU_STACK, PF_R | PF_W, 0, 0, 0, 0, 0, 16)
    return ehdr + load + stack + CODE


def gadget_address() -> int:
    """Where the stub's `syscall; int3` sits once it is exec'd."""
    return STUB_BASE + CODE_OFFSET + GADGET_OFFSET


def stub_memfd() -> int:
    """A sealed memfd holding the stub, ready for execve(fd) (fexecve); the caller closes it."""
    fd = os.memfd_create("ptckpt-restorer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, build_stub())
    import fcntl
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    return fd

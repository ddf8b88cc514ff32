# The ptckpt restorer stub (x86_64, GNU as syntax).
#
# This is the source of the machine code embedded in restorer/stub.py; the
# test suite assembles this file (when `as` is present) and checks that the
# bytes are the same.  The stub is freestanding: no libc, no data, no stack use.
#
# ptckpt starts it already traced and stopped at the exec event, so it never
# runs _start under normal use: the tracer only ever executes the `syscall`
# at `gadget` (injected syscalls stop at syscall exit; the int3 behind it traps
# any accidental fall-through).  If someone runs the stub by hand, _start just
# exits with status 127.

    .text
    .globl _start
_start:
    mov $127, %edi          # status
    mov $231, %eax          # exit_group
    syscall
    hlt                     # not reached
gadget:
    syscall                 # the injection point
    int3

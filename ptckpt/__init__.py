"""ptckpt: transparent checkpoint/restore of running Linux processes.

Everything is driven from outside the target: ptrace, /proc and syscall
injection.  The library API lives in :mod:`ptckpt.dump` (and later
``ptckpt.restore``); the CLI in :mod:`ptckpt.cli` is a thin layer over it.
"""

__version__ = "0.1.0"

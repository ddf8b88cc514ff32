"""ptckpt: transparent checkpoint/restore of running Linux processes.

Everything is driven from outside the target: ptrace, /proc and syscall
injection.  The Python API (:mod:`ptckpt.api`)::

    import ptckpt
    image = ptckpt.dump(pid, "/tmp/ckpt", leave_running=False)
    proc = ptckpt.restore("/tmp/ckpt", pidns=True)
    status = proc.wait(timeout=30)

The CLI in :mod:`ptckpt.cli` is a thin layer over the same library functions.
"""

import importlib

__version__ = "0.1.0"


def __getattr__(name: str):
    """ptckpt.dump / ptckpt.restore (callable modules), ptckpt.api and its Restored, loaded
    when first asked for: the CLI imports only what its command needs."""
    if name in ("dump", "restore", "api"):
        return importlib.import_module(f".{name}", __name__)
    if name in ("Restored", "DumpResult"):
        return getattr(importlib.import_module(".api", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

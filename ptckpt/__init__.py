"""ptckpt: transparent checkpoint/restore of running Linux processes.

Everything is driven from outside the target: ptrace, /proc and syscall
injection.  The Python API (:mod:`ptckpt.api`)::

    import ptckpt
    image = ptckpt.dump(pid, "/tmp/ckpt", leave_running=False)
    proc = ptckpt.restore("/tmp/ckpt", pidns=True)
    status = proc.wait(timeout=30)

``ptckpt.dump``, ``ptckpt.pre_dump``, ``ptckpt.restore`` and ``ptckpt.stop`` are the
functions of :mod:`ptckpt.api` themselves (``help(ptckpt.restore)`` shows every
keyword).  The modules of the same names, the library beneath them, are reached by
importing from them (``from ptckpt.restore import preflight``) or with
``importlib.import_module("ptckpt.restore")``, not as attributes of the package.

The CLI in :mod:`ptckpt.cli` is a thin layer over the same API.
"""

import importlib
import sys
import types

__version__ = "0.1.0"

# package attributes that are the API's functions, though submodules of the same names exist
_API_FUNCTIONS = frozenset({"dump", "pre_dump", "restore", "stop"})
_API_NAMES = frozenset({"Restored", "DumpResult", "group_dump", "group_restore"})


class _Package(types.ModuleType):
    """The package, whose attributes `dump`, `restore` and `stop` stay the API's functions:
    importing the submodule ptckpt.dump would otherwise bind the module there (the import
    system sets the attribute on the parent), and ``ptckpt.dump(...)`` would call a module."""

    def __setattr__(self, name: str, value) -> None:
        if name in _API_FUNCTIONS and isinstance(value, types.ModuleType):
            return                  # the submodule stays in sys.modules only
        super().__setattr__(name, value)


def __getattr__(name: str):
    """ptckpt.api's functions and types (and ptckpt.api itself), loaded when first asked
    for: the CLI imports only what its command needs."""
    if name == "api":
        return importlib.import_module(".api", __name__)
    if name in _API_FUNCTIONS or name in _API_NAMES:
        return getattr(importlib.import_module(".api", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API_FUNCTIONS, *_API_NAMES, "api"})


sys.modules[__name__].__class__ = _Package

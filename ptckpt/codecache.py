"""The methods Python's dataclasses write for each class, compiled once and kept.

The ``dataclasses`` module makes every ``__init__``, ``__repr__``, ``__eq__`` ... of a
dataclass from source text, compiled by exec() when the class is defined: ~600 methods
for what a dump or a restore imports, ~40 ms of every command on Python 3.11 (more than a
small dump's own work).  The ``ptckpt`` command (ptckpt.entry) lets them come from a file
of code objects compiled by an earlier command, keyed by their source text, as the
interpreter keeps a module's bytecode in ``__pycache__``: the same text always compiles
to the same code, so a method is the one exec() would have made.

The file sits beside ptckpt's own bytecode (``ptckpt/__pycache__``), one per interpreter
(its cache tag; the code in it is used only under the bytecode magic number it was made
with), and follows the same rules: not written under PYTHONDONTWRITEBYTECODE
(``sys.dont_write_bytecode``), nor where the directory cannot be written; read only when
it belongs to this user (or root) and nobody else may write it, as it is code this
process runs.  Anything wrong with it (unreadable, another format) and the methods are
compiled as without it.  Only the command does this, not a program that imports ptckpt.
"""

from __future__ import annotations

import builtins
import marshal
import os
import sys

MAX_ENTRIES = 5000              # sources kept: beyond, the file starts again

_cache: dict[str, object] = {}
_added = 0
_loaded = False


def path() -> str:
    """The file: $PTCKPT_DATACLASS_CACHE, or beside ptckpt's bytecode."""
    tag = sys.implementation.cache_tag or "python"
    return (os.environ.get("PTCKPT_DATACLASS_CACHE")
            or os.path.join(os.path.dirname(__file__), "__pycache__", f"dataclass-methods.{tag}.marshal"))


def _trusted(fd: int) -> bool:
    st = os.fstat(fd)
    return st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022


def _load(where: str) -> dict:
    try:
        fd = os.open(where, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        if not _trusted(fd):
            return {}
        with os.fdopen(os.dup(fd), "rb") as f:
            data = marshal.load(f)
    except (OSError, EOFError, ValueError, TypeError):
        return {}
    finally:
        os.close(fd)
    # code of this interpreter's bytecode only (its magic number, as a .pyc says)
    if not isinstance(data, dict) or data.get("magic") != _magic() or not isinstance(data.get("methods"), dict):
        return {}
    return data["methods"]


def _magic() -> bytes:
    import importlib.util
    return importlib.util.MAGIC_NUMBER


def _exec(source, globals=None, locals=None):
    """exec() as dataclasses calls it, with the code of `source` compiled once."""
    global _added, _loaded
    if isinstance(source, str):
        if not _loaded:                       # at the first class: a command without any pays nothing
            _loaded = True
            _cache.update(_load(path()))
        code = _cache.get(source)
        if code is None:
            code = _cache[source] = compile(source, "<string>", "exec")
            _added += 1
        source = code
    return builtins.exec(source, globals, locals)


def install() -> None:
    """From now on the methods of new dataclasses come from the file, or are compiled and
    added to it (written by save())."""
    import dataclasses
    dataclasses.exec = _exec


def save(*, force: bool = False) -> None:
    """Write the file if this command compiled methods it did not have (and may write
    bytecode, or `force`)."""
    if not _added or (sys.dont_write_bytecode and not force):
        return
    where = path()
    entries = _cache if len(_cache) <= MAX_ENTRIES else {}
    if not entries:
        return
    tmp = f"{where}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            marshal.dump({"magic": _magic(), "methods": entries}, f)
        os.replace(tmp, where)
    except (OSError, ValueError):
        try:
            os.unlink(tmp)
        except OSError:
            pass


COMMAND_MODULES = ("ptckpt.cli", "ptckpt.pipeline.dump", "ptckpt.pipeline.restore", "ptckpt.campaign",
                   "ptckpt.show", "ptckpt.check", "ptckpt.diff")


def build() -> None:
    """Write the file for the modules the commands import, as compileall writes bytecode
    (whatever PYTHONDONTWRITEBYTECODE says): ``python -m ptckpt.codecache``."""
    import importlib
    install()
    for name in COMMAND_MODULES:
        importlib.import_module(name)
    save(force=True)


if __name__ == "__main__":
    build()

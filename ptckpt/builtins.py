"""Built-in virtualisation, each a plugin on the public API (ptckpt.plugins).

* :class:`SetEnv` -- ``restore --set-env NAME=VALUE`` / ``--unset-env NAME``: after
  the restore getenv() in every process of the tree returns the new values (the
  environment is rewritten through libc's `environ`, by :meth:`ProcessHandle.set_environ`).
* :class:`RemapPath` -- ``restore --remap-path OLD=NEW``: every fd, file mapping, cwd,
  root and exe under OLD is reopened under NEW (pre_restore rewrites the image's
  paths); and the tree runs in a private mount namespace where NEW is bind-mounted
  on OLD, so paths under OLD that it opens later land under NEW too.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from .errors import UsageError
from .plugins import Plugin


def _pairs(values: Sequence[str], option: str) -> list[tuple[str, str]]:
    out = []
    for v in values:
        name, sep, value = v.partition("=")
        if not sep or not name:
            raise UsageError(f"{option} {v!r}: expected NAME=VALUE")
        out.append((name, value))
    return out


class SetEnv(Plugin):
    name = "set-env"
    version = "1"

    def __init__(self, set_values: Sequence[str] = (), unset: Sequence[str] = ()):
        self.set_values = _pairs(set_values, "--set-env")
        self.unset = list(unset)

    def restored(self, proc, ctx) -> None:
        from . import symbols
        env = proc.environ()
        for name, value in self.set_values:
            env = symbols.set_env(env, name, value)
        for name in self.unset:
            env = symbols.unset_env(env, name)
        proc.set_environ(env)


def remap(path: str, pairs: Sequence[tuple[str, str]]) -> str:
    """`path` with the first OLD prefix (a whole path component) replaced by NEW."""
    suffix = " (deleted)" if path.endswith(" (deleted)") else ""
    core = path[:-len(suffix)] if suffix else path
    for old, new in pairs:
        if core == old or core.startswith(old.rstrip("/") + "/"):
            return new.rstrip("/") + core[len(old.rstrip("/")):] + suffix
    return path


class RemapPath(Plugin):
    name = "remap-path"
    version = "1"

    def __init__(self, values: Sequence[str]):
        self.pairs = [(os.path.normpath(o), os.path.normpath(n)) for o, n in _pairs(values, "--remap-path")]
        for old, new in self.pairs:
            if not old.startswith("/") or not new.startswith("/"):
                raise UsageError(f"--remap-path {old}={new}: both paths must be absolute")
            if not os.path.isdir(new):
                raise UsageError(f"--remap-path {old}={new}: {new} is not a directory")

    def rewrite(self, proc_image):
        """The ProcessImage with every path under an OLD moved under its NEW."""
        r = lambda p: remap(p, self.pairs)
        task = dataclasses.replace(proc_image.task, cwd=r(proc_image.task.cwd), exe=r(proc_image.task.exe),
                                   root=r(proc_image.task.root))
        mm = dataclasses.replace(proc_image.mm, exe_file=r(proc_image.mm.exe_file))
        fds = tuple(dataclasses.replace(f, path=r(f.path)) if f.path.startswith("/") else f
                    for f in proc_image.fds)
        vmas = tuple(dataclasses.replace(v, path=r(v.path)) if v.path.startswith("/") else v
                     for v in proc_image.vmas)
        return dataclasses.replace(proc_image, task=task, mm=mm, fds=fds, vmas=vmas)

    def remapped_to(self, path: str) -> bool:
        """Whether `path` (after rewrite) lies under one of the NEW directories."""
        return any(path == new or path.startswith(new.rstrip("/") + "/") for _old, new in self.pairs)

    def mounts(self) -> list[tuple[str, str]]:
        """(NEW, OLD) bind mounts for the tree's mount namespace: only where OLD is a directory."""
        return [(new, old) for old, new in self.pairs if os.path.isdir(old) and old != new]

"""pytest plugin (entry point ``pytest11: ptckpt``): run an expensive setup once, checkpoint
it, and give each test a fresh restore of it.

    # conftest.py
    import subprocess, pytest

    @pytest.fixture(scope="session")
    def booted(ptckpt_image):
        def start():                                   # the expensive part: once
            return subprocess.Popen(["./testbench", "--boot"], stdout=subprocess.DEVNULL).pid
        return ptckpt_image("testbench-booted-v1", start, ready=lambda pid: wait_booted(pid))

    @pytest.fixture
    def bench(booted, ptckpt_restored):
        return ptckpt_restored(booted)                 # a fresh copy for this test

    def test_something(bench):
        bench.signal(...); ...; assert bench.wait(timeout=10) == 0

``ptckpt_image(key, start, ready=None, **dump_options)`` (session scope) returns the image
directory.  The image is kept in pytest's cache (``.pytest_cache/d/ptckpt/KEY``) across
runs: change the key when what `start` sets up changes, or run ``pytest --ptckpt-refresh``.
`start()` starts the program and returns its pid (or a Popen); `ready(pid)`, if given,
returns once the setup is done; then the process tree is dumped and killed
(``leave_running=False``; other options are ptckpt.api.dump's).  Several xdist workers may
ask at once: one builds the image, under a lock, the others wait for it.

``ptckpt_restored(image, **restore_options)`` (function scope) restores it and returns a
:class:`ptckpt.api.Restored`; the tree is killed when the test ends, passed or failed.
By default each copy gets its own pid namespace (``pidns=True``: copies run side by side
with the pids they were dumped with) and files changed since the dump only warn
(``file_policy=["warn"]``: the copies before this one ran on the same files).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ptckpt", "ptckpt checkpoint/restore fixtures")
    group.addoption("--ptckpt-refresh", action="store_true", default=False,
                    help="Rebuild the images of ptckpt_image instead of taking them from the cache.")


_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _pid_of(started) -> int:
    return started.pid if isinstance(started, subprocess.Popen) else int(started)


@pytest.fixture(scope="session")
def ptckpt_image(pytestconfig: pytest.Config) -> Callable[..., Path]:
    """Factory: ``ptckpt_image(key, start, ready=None, **dump_options) -> image directory``."""
    root = Path(pytestconfig.cache.mkdir("ptckpt")) if pytestconfig.cache else Path(".ptckpt-images")
    refresh = pytestconfig.getoption("ptckpt_refresh")
    made: set[str] = set()

    def image(key: str, start: Callable[[], object], ready: Callable[[int], object] | None = None,
              **dump_options) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"ptckpt_image key {key!r}: letters, digits, '.', '_' and '-' only")
        path = root / key
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f".{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)               # one builder; the others wait
            if path.exists() and (key in made or not refresh) and _usable(path):
                return path
            shutil.rmtree(path, ignore_errors=True)
            _build(path, start, ready, dump_options)
            made.add(key)
        return path

    return image


def _usable(path: Path) -> bool:
    """An image a reader opens (it is checked once more when restored)."""
    from .errors import PtckptError
    from .formats.image import ImageReader
    try:
        with ImageReader(path, verify_pages=False):
            return True
    except PtckptError:
        return False


def _build(path: Path, start, ready, dump_options: dict) -> None:
    from . import api
    started = start()
    pid = _pid_of(started)
    try:
        if ready is not None:
            ready(pid)
        api.dump(pid, path, leave_running=False, **dump_options)
    finally:
        try:
            os.kill(pid, 9)                                # a failed setup or dump: it goes too
        except ProcessLookupError:
            pass
        if isinstance(started, subprocess.Popen):
            started.wait()
        else:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


@pytest.fixture
def ptckpt_restored() -> Callable[..., object]:
    """Factory: ``ptckpt_restored(image, **restore_options) -> ptckpt.api.Restored``; every
    tree it restored is killed at the end of the test."""
    from . import api
    trees: list[api.Restored] = []

    def restored(image: str | os.PathLike, **options) -> api.Restored:
        options.setdefault("pidns", True)
        options.setdefault("file_policy", ["warn"])
        tree = api.restore(image, **options)
        trees.append(tree)
        return tree

    yield restored
    for tree in trees:
        tree.kill()

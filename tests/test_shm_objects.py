"""Memory objects that outlive their names and fds (MPI's pattern: shm_open, mmap
MAP_SHARED, shm_unlink, close; memfds mapped shared and private, their fds closed; one
memfd opened again by another process through /proc): restored as the same objects,
shared by the same processes, with their contents."""

from __future__ import annotations

import os
import signal

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader

from conftest import idle_script, kill_pids, reap_orphans, wait_until
from test_restore import _dump_kill, _one_line, _restore


def test_unlinked_shm_and_memfd_objects_round_trip(spawn, ptckpt, tmp_path):
    target = spawn("shmobjects")
    kid = int(next(line for line in target.preamble if line.startswith("KID")).split()[1])
    try:
        _dump_kill(ptckpt, target, tmp_path / "img", members=[kid])
        with ImageReader(tmp_path / "img") as image:
            ghosts = [g.path for g in image.ghost_files]
        assert f"/dev/shm/ptckpt-shmobjects-{target.pid}" in ghosts, "the unlinked shm object is in the image"
        assert _restore(ptckpt, tmp_path / "img") == target.pid
        maps = {line.split(maxsplit=5)[-1].strip() for line in open(f"/proc/{target.pid}/maps")
                if len(line.split()) > 5}
        assert f"/dev/shm/ptckpt-shmobjects-{target.pid} (deleted)" in maps
        assert not os.path.exists(f"/dev/shm/ptckpt-shmobjects-{target.pid}"), "unlinked again"
        assert "/memfd:shmobjects (deleted)" in maps
        target.signal(signal.SIGUSR1)
        target.wait_for_line("VERIFY OK")
        wait_until(lambda: not target.alive(), 5, message="the fixture ends")
        target.assert_ok()
    finally:
        kill_pids([kid])
        reap_orphans()


def test_dump_refuses_what_restore_would_refuse(spawn, ptckpt, tmp_path):
    """A memfd mapped MAP_PRIVATE only, its fd closed: its object is in no fd and no
    shared mapping, so a restore has nothing to map. The dump runs restore's plan on its
    image before it commits it: refused there, by name, the target running on, no image."""
    script = idle_script(tmp_path, "lonely.py", (
        "import ctypes, os, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.mmap.restype = ctypes.c_void_p\n"
        "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
        "fd = os.memfd_create('lonely')\n"
        "os.write(fd, b'x' * 4096)\n"
        "assert libc.mmap(None, 4096, 1, 2, fd, 0) not in (None, 2**64 - 1)\n"   # PROT_READ, MAP_PRIVATE
        "os.close(fd)\n"))
    target = spawn(str(script), out=False)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill")
    _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, "/memfd:lonely", "a restore of this image would refuse it")
    assert target.alive(), "a dump that fails leaves the target running"
    assert not (tmp_path / "img").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".img.tmp")], "no half-written image"

"""Files in every state round-trip: offsets, O_APPEND, O_PATH, directory streams, symlinks,
relative opens, deleted-but-open and deleted mapped files."""

from __future__ import annotations

import os
import signal

from ptckpt.formats.image import ImageReader

from test_restore import _dump_kill, _restore


def test_every_file_state_at_once(spawn, ptckpt, tmp_path):
    where = tmp_path / "files"
    where.mkdir()
    target = spawn("files", where)
    _dump_kill(ptckpt, target, tmp_path / "img")
    # the ghost and the deleted mapping are gone from the disk; the image has their bytes
    assert not (where / "ghost").exists() and not (where / "gmap").exists()
    with ImageReader(tmp_path / "img") as image:
        ghosts = {g.path: g for g in image.ghost_files}
    assert ghosts[str(where / "ghost")].data == b"ghost contents, still readable"
    assert len(ghosts[str(where / "gmap")].data) == 8192
    _restore(ptckpt, tmp_path / "img")
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK")
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 2 OK")
    target.assert_ok()
    assert not (where / "ghost").exists(), "the ghost is unlinked again"
    assert os.readlink(f"/proc/{target.pid}/cwd") == str(where / "sub")

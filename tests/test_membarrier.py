"""membarrier(2) registrations: per mm, invisible from /proc; a restore that loses them makes
the program's expedited barriers fail with EPERM (CRIU's zdtm static/membarrier)."""

from __future__ import annotations

from ptckpt.formats.image import ImageReader

from test_restore import _dump_kill, _restore


def test_registrations_come_back(spawn, ptckpt, tmp_path):
    target = spawn("membarrier")
    registered = int(next(line for line in target.preamble if line.startswith("REGISTERED")).split()[1], 16)
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        assert image.process(target.pid).mm.membarrier == registered, "what GET_REGISTRATIONS said"
    assert _restore(ptckpt, tmp_path / "img") == target.pid
    target.signal()
    target.wait_for_line(r"^VERIFY 1 OK$")       # its barriers run, the mask is the same
    target.assert_ok()


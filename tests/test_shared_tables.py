"""Processes that share one fd table or one fs state (CLONE_FILES, CLONE_FS) still share
them after a restore; a copy stays a copy (ptckpt.resources.process; fixtures/sharedfd.c)."""

from __future__ import annotations

from ptckpt.formats.image import ImageReader
from ptckpt.tracee import KCMP_FILES, KCMP_FS, same_kernel_object

from test_restore import _dump_kill, _restore
from conftest import kill_pids, reap_orphans


def test_a_shared_fd_table_and_cwd_stay_shared(spawn, ptckpt, tmp_path):
    target = spawn("sharedfd")
    a, b = (int(x) for x in next(l for l in target.preamble if l.startswith("KIDS")).split()[1:])
    members = [target.pid, a, b]
    try:
        assert same_kernel_object(target.pid, a, KCMP_FILES) and same_kernel_object(target.pid, a, KCMP_FS)
        _dump_kill(ptckpt, target, tmp_path / "img", members)
        with ImageReader(tmp_path / "img") as image:
            marks = {p: (image.process(p).task.shares_files, image.process(p).task.shares_fs)
                     for p in members}
        assert marks == {target.pid: (False, False), a: (True, True), b: (False, False)}
        target.adopt(_restore(ptckpt, tmp_path / "img"))
        for kind in (KCMP_FILES, KCMP_FS):
            assert same_kernel_object(target.pid, a, kind), kind
            assert not same_kernel_object(target.pid, b, kind), kind
        target.signal()
        target.wait_for_line(r"^SHARED ok", timeout=15)
        assert target.wait_exit(10) == 0, target.describe()
    finally:
        kill_pids(members)
        reap_orphans()

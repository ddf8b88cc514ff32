"""membarrier(2) registrations: per mm, invisible from /proc; a restore that loses them makes
the program's expedited barriers fail with EPERM (CRIU's zdtm static/membarrier)."""

from __future__ import annotations

from ptckpt.formats.image import ImageReader
from ptckpt.resources import membarrier

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


class _Kernel:
    """A remote whose membarrier(2) answers like a kernel before 6.3 (no GET_REGISTRATIONS)."""

    def __init__(self, supported: int, registered: int):
        self.supported, self.registered, self.calls = supported, registered, []

    def syscall(self, name, cmd, flags=0, cpu=0):
        assert name == "membarrier"
        self.calls.append(cmd)
        if cmd == membarrier.CMD_QUERY:
            return self.supported
        if cmd == membarrier.CMD_GET_REGISTRATIONS or not self.supported & cmd:
            return -membarrier.EINVAL
        if cmd & membarrier.KNOWN:                       # a REGISTER command
            self.registered |= cmd
            return 0
        return 0 if self.registered & (cmd << 1) or cmd == 1 << 1 else -membarrier.EPERM

    def checked(self, name, cmd, *args, step=None):
        res = self.syscall(name, cmd, *args)
        assert res >= 0, (cmd, res, step)
        return res


def test_an_older_kernel_is_probed_kind_by_kind():
    """Without GET_REGISTRATIONS (EINVAL), each private kind is probed by issuing its barrier;
    the global kind, which no call reveals, is registered again whenever the kernel has it."""
    older = _Kernel(supported=0x1ff & ~membarrier.CMD_GET_REGISTRATIONS, registered=1 << 4)
    mask = membarrier.dump_registrations_frozen(1, older)
    assert mask == (1 << 2) | (1 << 4), membarrier.names(mask)
    assert 1 << 2 not in older.calls, "registering is not a way to probe"
    assert membarrier.names(mask) == "GLOBAL_EXPEDITED|PRIVATE_EXPEDITED"
    fresh = _Kernel(supported=0x1ff, registered=0)
    membarrier.restore_registrations_frozen(fresh, mask)
    assert fresh.registered == mask
    assert membarrier.dump_registrations_frozen(1, _Kernel(supported=-membarrier.ENOSYS, registered=0)) == 0

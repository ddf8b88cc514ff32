"""POSIX timers and interval timers come back: same ids, clocks, signals and values, the
thread a timer signals, the time left; and the zdtm-style check that they keep firing.
(ptckpt.resources.timers; fixtures/timers.c)"""

from __future__ import annotations

import pytest

from conftest import wait_pid_free
from ptckpt.formats.image import ImageReader
from ptckpt.resources import timers

SIGRTMIN = 34


def _timer_lines(pid: int) -> list:
    return sorted(timers.read_proc_timers(pid))


@pytest.mark.parametrize("pidns", [False, True], ids=["same-pids", "pidns"])
def test_timers_keep_their_ids_and_go_on_firing(spawn, ptckpt, tmp_path, pidns):
    target = spawn("timers")
    ids = [int(x) for x in target.wait_for_line(r"^TIMERS ").string.split()[1:]]
    before = _timer_lines(target.pid)
    assert sorted(t[0] for t in before) == sorted(ids)
    image = tmp_path / "img"
    res = ptckpt("dump", target.pid, "-D", image, "--kill")
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    with ImageReader(image) as reader:
        proc = reader.process(reader.inventory.root_pid)
        recorded = {t.id: t for t in proc.timers}
        assert sorted(recorded) == sorted(ids)
        a, b, c = (recorded[i] for i in ids)
        assert (a.signo, a.value, a.interval_ns, a.notify) == (SIGRTMIN, 0xA11CE, 10_000_000, timers.SIGEV_SIGNAL)
        assert (b.signo, b.value, b.notify) == (SIGRTMIN + 1, 0xB0B, timers.SIGEV_THREAD_ID | timers.SIGEV_SIGNAL)
        assert b.tid in {t.tid for t in proc.threads} and b.tid != proc.task.pid
        assert c.notify == timers.SIGEV_NONE and 500 * 10**9 < c.left_ns <= 600 * 10**9
        assert [(i.which, i.interval_us) for i in proc.itimers] == [(0, 20_000)]
    if not pidns:
        wait_pid_free(target.pid)
    res = ptckpt("restore", "-D", image, "--detach", *(["--pidns"] if pidns else []))
    assert res.returncode == 0, res.stderr
    pid = int(res.stdout.split()[-1])
    target.adopt(pid)
    if not pidns:
        after = _timer_lines(pid)
        assert [t[:4] + t[5:] for t in after] == [t[:4] + t[5:] for t in before]   # ids, signals, values, clocks
    target.signal()
    line = target.wait_for_line(r"^COUNTS ", timeout=15).string
    status = target.wait_exit(10)
    # in its own pid namespace the restored process is reaped by that namespace's init
    assert status == 0 or (pidns and status is None and target.failure() is None), target.describe()
    counts = [int(x) for x in line.split()[1:4]]
    assert all(n > 0 for n in counts), line


def test_a_timer_signalling_a_thread_outside_the_process_is_refused():
    from ptckpt.errors import UnsupportedResource
    from ptckpt.formats.model import PosixTimer
    t = PosixTimer(id=3, clockid=1, signo=10, notify=timers.SIGEV_THREAD_ID, tid=999999, value=0,
                   interval_ns=0, left_ns=1)
    with pytest.raises(UnsupportedResource, match="POSIX timer 3 signalling thread 999999"):
        timers.check_dumpable(100, [t], [100, 101])

"""Credentials and prctl state come back: uids, gids, groups, the five capability sets,
securebits, no_new_privs, THP disable, KSM merging, MDWE, speculation control, timer slack,
name -- in every thread; seccomp filters; threads with credentials and seccomp filters of their
own (ptckpt.resources.creds, ptckpt.resources.process; fixtures/privs.c)."""

from __future__ import annotations

import os

import pytest

from ptckpt.formats.image import ImageReader

from test_restore import _dump_kill, _restore
from conftest import wait_pid_free, wait_until


def _status(pid: int) -> dict[str, str]:
    return _status_of(pid, str(pid))


def _sched(pid: int, tid: str) -> tuple[int, int]:
    """(policy, nice) of a thread, from /proc/PID/task/TID/stat fields 41 and 19."""
    fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[38]), int(fields[16])


def _status_of(pid: int, tid: str) -> dict[str, str]:
    out = {}
    for line in open(f"/proc/{pid}/task/{tid}/status"):
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


KEPT = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs",
        "Speculation_Store_Bypass", "THP_enabled")


@pytest.mark.parametrize("pidns", [False, True], ids=["same-pids", "pidns"])
def test_credentials_and_prctl_state_survive_in_every_thread(spawn, ptckpt, tmp_path, pidns):
    target = spawn("privs")
    before = target.wait_for_line(r"^STATE ").string
    assert "uid=1000,1000,1000" in before and "nnp=1" in before and "thp=1" in before
    assert "coredump=0000001f loginuid=4242" in before
    threads = sorted(os.listdir(f"/proc/{target.pid}/task"))
    seen = {t: {k: _status(target.pid)[k] for k in KEPT} for t in threads}
    cpus = {t: _status_of(target.pid, t)["Cpus_allowed_list"] for t in threads}
    wait_until(lambda: sorted(_sched(target.pid, t) for t in threads) == [(0, 3), (3, 7)], 5)
    last = str(os.cpu_count() - 1)
    assert cpus[str(target.pid)] == last
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as reader:
        proc = reader.process(reader.inventory.root_pid)
        assert proc.creds.securebits == 1 << 4 and proc.creds.no_new_privs
        assert proc.task.thp_disable and proc.task.mdwe == 1
    pid = _restore(ptckpt, tmp_path / "img", *(["--pidns"] if pidns else []))
    target.adopt(pid)
    now = sorted(os.listdir(f"/proc/{pid}/task"))
    assert len(now) == 2
    for tid in now:   # from outside, each thread
        st = _status_of(pid, tid)
        assert {k: st[k] for k in KEPT} == next(iter(seen.values())), tid
    assert sorted(_status_of(pid, t)["Cpus_allowed_list"] for t in now) == sorted(cpus.values()), \
        "each thread keeps its own CPU affinity"
    assert _status_of(pid, str(pid))["Cpus_allowed_list"] == last
    assert _sched(pid, str(pid)) == (0, 3) and sorted(_sched(pid, t) for t in now) == [(0, 3), (3, 7)], \
        "each thread keeps its scheduling policy and nice"
    target.signal()
    after = target.wait_for_line(r"^STATE ", count=2, timeout=15).string
    status = target.wait_exit(10)
    assert status == 0 or (pidns and status is None and target.failure() is None), target.describe()
    assert after == before


def test_seccomp_filters_are_installed_again(spawn, ptckpt, tmp_path):
    target = spawn("privs", "seccomp")
    before = target.wait_for_line(r"^STATE ").string
    assert "uname_errno=1 " in before, "the filter makes uname fail with EPERM"
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill")
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    with ImageReader(tmp_path / "img") as reader:
        assert len(reader.process(reader.inventory.root_pid).creds.seccomp_filters) == 1
    wait_pid_free(target.pid)
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    for tid in os.listdir(f"/proc/{target.pid}/task"):
        st = _status_of(target.pid, tid)
        assert (st["Seccomp"], st["Seccomp_filters"]) == ("2", "1"), tid
    target.signal()
    assert target.wait_for_line(r"^STATE ", count=2, timeout=15).string == before
    assert target.wait_exit(10) == 0, target.describe()


def test_seccomp_strict_mode_is_entered_again(spawn, ptckpt, tmp_path):
    """Strict mode kills on any syscall but read, write, exit and sigreturn: ptckpt traces
    with seccomp suspended (root), so it can dump the process and put it back in the mode."""
    target = spawn("privs", "strict")
    assert _status(target.pid)["Seccomp"] == "1"
    _dump_kill(ptckpt, target, tmp_path / "img")
    target.adopt(_restore(ptckpt, tmp_path / "img"))
    assert _status(target.pid)["Seccomp"] == "1"
    assert target.alive() and _status(target.pid)["State"].startswith("S"), "back in its read"


OWN = KEPT + ("Seccomp", "Seccomp_filters")


@pytest.mark.parametrize("pidns", [False, True], ids=["same-pids", "pidns"])
@pytest.mark.parametrize("mode, differ", [
    ("thread-creds", {"CapEff": ("0000000000002020", "0000000000002000")}),     # CAP_KILL dropped
    ("thread-seccomp", {"Seccomp_filters": ("1", "2")}),        # the process's filter, then its own
    ("thread-ids", {"Uid": ("1000\t1000\t1000\t1000", "1001\t1001\t1001\t1001"),
                    "Gid": ("1000\t1000\t1000\t1000", "1001\t1001\t1001\t1001")}),
])
def test_threads_keep_credentials_of_their_own(spawn, ptckpt, tmp_path, mode, differ, pidns):
    """Credentials are per thread: a thread that changed its own (capabilities, a seccomp
    filter over the process's, its uids and gids) gets them back, and the main thread keeps the process's;
    each thread reads its own state again (privs checks it every 10 ms)."""
    target = spawn("privs", mode)
    before = target.wait_for_line(r"^STATE ").string
    mine = target.wait_for_line(r"^THREAD ").string
    target.wait_for_line(r"^READY ")
    assert ("ppid_errno=1 " in mine) == (mode == "thread-seccomp") and "ppid_errno=0 " in before

    def own(pid):
        """(the leader's, the other thread's) credentials from /proc, as the kernel keeps them"""
        tids = os.listdir(f"/proc/{pid}/task")
        assert len(tids) == 2
        other = next(t for t in tids if t != str(pid))
        return tuple({k: _status_of(pid, t)[k] for k in OWN} for t in (str(pid), other))

    seen = own(target.pid)
    for key, (leader, other) in differ.items():
        assert (seen[0][key], seen[1][key]) == (leader, other), key
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as reader:
        proc = reader.process(reader.inventory.root_pid)
        assert [len(t.creds) for t in proc.threads] == [0, 1], "the other thread's own, in its THREAD record"
    pid = _restore(ptckpt, tmp_path / "img", *(["--pidns"] if pidns else []))
    target.adopt(pid)
    assert own(pid) == seen, "each thread has its own credentials again"
    target.signal()
    after = target.wait_for_line(r"^STATE ", count=2, timeout=15).string
    status = target.wait_exit(10)
    assert status == 0 or (pidns and status is None and target.failure() is None), target.describe()
    assert after == before

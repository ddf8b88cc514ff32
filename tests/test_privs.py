"""Credentials and prctl state come back: uids, gids, groups, the five capability sets,
securebits, no_new_privs, THP disable, KSM merging, MDWE, speculation control, timer slack,
name -- in every thread; seccomp filters and threads with credentials of their own are
refused by name (ptckpt.resources.creds, ptckpt.resources.process; fixtures/privs.c)."""

from __future__ import annotations

import os

import pytest

from ptckpt.errors import ExitCode
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


@pytest.mark.parametrize("mode, words", [
    ("thread-creds", "with credentials of its own (cap_eff differ"),
])
def test_what_the_image_cannot_hold_is_refused_by_name(spawn, ptckpt, tmp_path, mode, words):
    target = spawn("privs", mode)
    target.wait_for_line(r"^READY ")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill")
    assert res.returncode == ExitCode.UNSUPPORTED_RESOURCE, res.stderr
    assert words in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "img").exists()
    assert target.alive(), "a refused dump leaves the target running"

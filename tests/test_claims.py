"""Nothing silently lost: every field /proc shows of a task is claimed by a resource module,
follows from what is restored, or refuses the dump by name (ptckpt.claims)."""

from __future__ import annotations

import os

import pytest

from ptckpt import claims
from ptckpt.errors import ExitCode, UnsupportedResource

from conftest import require, tool, wait_until


def test_every_status_field_of_this_kernel_is_claimed():
    """Each field this kernel shows, for a process and for a thread, is in the table."""
    for path in (f"/proc/{os.getpid()}/status", f"/proc/{os.getpid()}/task/{os.getpid()}/status",
                 "/proc/1/status"):
        keys = [line.split(":", 1)[0] for line in open(path)]
        assert [k for k in keys if k not in claims.STATUS] == [], path


def test_each_claim_is_restored_derived_or_checked_and_names_its_module():
    for key, claim in claims.STATUS.items():
        assert claim.how in ("restored", "derived", "checked"), key
        assert (claim.refuse is not None) == (claim.how == "checked"), key
        assert claim.by, key


@pytest.mark.parametrize("key, value, words", [
    ("CoreDumping", "1", "writing a core dump"),
    ("untag_mask", "0x7ffffffffffff", "linear address masking"),
    ("x86_Thread_features", "shstk", "shadow stack"),
    ("Kthread", "1", "a kernel thread"),
    ("Frobnicated", "yes", "'Frobnicated: yes' (state this ptckpt does not know"),
])
def test_state_no_restore_makes_is_refused_by_name(key, value, words):
    raw = {"Name": "x", "CoreDumping": "0", "untag_mask": "0xffffffffffffffff", key: value}
    with pytest.raises(UnsupportedResource) as info:
        claims.check_status(7, 8, raw)
    assert words in str(info.value) and "thread 8" in str(info.value)
    claims.check_status(7, 7, {k: v for k, v in raw.items() if k != key})    # the defaults pass


POLICY = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
nodes = ctypes.c_ulong(1)
if libc.syscall(238, 2, ctypes.byref(nodes), 64) != 0:      # set_mempolicy(MPOL_BIND, {0})
    sys.exit(5)
import os
print("READY", os.getpid(), flush=True)
while True: time.sleep(0.05)
"""


def test_a_numa_memory_policy_is_refused_and_the_target_runs_on(spawn, ptckpt, tmp_path):
    script = tmp_path / "policy.py"
    script.write_text(POLICY)
    target = spawn(str(script))
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == ExitCode.UNSUPPORTED_RESOURCE, res.stderr
    assert "a NUMA memory policy (bind:0" in res.stderr and len(res.stderr.splitlines()) == 1
    assert target.alive() and not (tmp_path / "img").exists()


MBIND = r"""
import ctypes, mmap, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
area = libc.mmap(None, 1 << 20, 3, 0x22, -1, 0)          # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
nodes = ctypes.c_ulong(1)
if libc.syscall(237, ctypes.c_void_p(area), 1 << 20, 2, ctypes.byref(nodes), 64, 0) != 0:   # mbind
    sys.exit(5)
import os
print("AREA", hex(area), flush=True)
print("READY", os.getpid(), flush=True)
while True: time.sleep(0.05)
"""


@pytest.mark.parametrize("script, words", [(POLICY, "bind for the whole task"), (MBIND, "bind at ")],
                         ids=["task", "mapping"])
def test_a_numa_policy_is_refused_when_the_process_is_asked(spawn, tmp_path, monkeypatch, script, words):
    """A process whose numa_maps would cost the kernel more than asking it (big memory, few
    mappings): the frozen process is asked with get_mempolicy (claims.check_numa) instead,
    and refuses as the file would, for the task's policy and for one mbind gave a mapping."""
    from ptckpt.pipeline.dump import dump
    path = tmp_path / "policy.py"
    path.write_text(script)
    target = spawn(str(path))
    monkeypatch.setattr(claims, "numa_by_file", lambda pid: False)
    with pytest.raises(UnsupportedResource) as info:
        dump(target.pid, str(tmp_path / "img"))
    assert "a NUMA memory policy (" + words in str(info.value), str(info.value)
    assert target.alive() and not (tmp_path / "img").exists()
    if script is MBIND:
        assert f"bind at {target.wait_for_line(r'AREA 0x([0-9a-f]+)').group(1)}" in str(info.value)
    monkeypatch.setattr(claims, "numa_by_file", lambda pid: True)       # the file says the same
    with pytest.raises(UnsupportedResource) as info:
        dump(target.pid, str(tmp_path / "img"))
    assert "a NUMA memory policy (bind" in str(info.value)


def test_every_fdinfo_line_of_the_kinds_a_restore_makes_is_claimed(spawn, tmp_path):
    """The fdinfo of each fd of the fdkinds fixture (eventfd, timerfd, signalfd, inotify,
    epoll, memfd, pipes, files ...), as this kernel prints it, passes the table."""
    from ptckpt.resources import files
    (tmp_path / "watched").mkdir()
    target = spawn("fdkinds", str(tmp_path / "watched"))
    fds = files.dump_fds(target.pid)
    kinds = {f.kind.name for f in fds}
    assert {"EVENTFD", "TIMERFD", "SIGNALFD", "INOTIFY", "EPOLL"} <= kinds, kinds
    for f in fds:
        text = open(f"/proc/{target.pid}/fdinfo/{f.fd}").read()
        claims.check_fdinfo(target.pid, f.fd, f.kind.name, text)


@pytest.mark.parametrize("kind, text, words", [
    ("SOCKET", "pos:\t0\nflags:\t02\nmnt_id:\t8\nino:\t9\nscm_fds: 2\nscm_frob: 1\n", "'scm_frob: 1'"),
    ("EVENTFD", "pos:\t0\nflags:\t02\nmnt_id:\t8\nino:\t9\neventfd-count: 1\nfrob: 1\n", "'frob: 1'"),
    ("REGULAR", "pos:\t0\nflags:\t02\nmnt_id:\t8\nino:\t9\ntfd: 5 events: 1\n", "'tfd: 5 events: 1'"),
])
def test_fdinfo_state_no_restore_makes_is_refused_by_name(kind, text, words):
    with pytest.raises(UnsupportedResource) as info:
        claims.check_fdinfo(7, 4, kind, text)
    assert words in str(info.value) and "fd 4" in str(info.value)


@pytest.mark.parametrize("flag, ns", [("--uts", "uts"), ("--ipc", "ipc"), ("--mount", "mnt")])
def test_a_process_in_namespaces_of_its_own_is_refused_by_name(spawn, ptckpt, tmp_path, flag, ns):
    require("unshare")
    target = spawn(tool("unshare"), flag, "sleep", "600", out=False, ready=False)
    wait_until(lambda: os.path.exists(f"/proc/{target.pid}/exe")
               and os.readlink(f"/proc/{target.pid}/exe").endswith("sleep"), 10)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == ExitCode.UNSUPPORTED_RESOURCE, res.stderr
    assert (f"process {target.pid}: a {ns} namespace other than ptckpt's (a container?) is not supported: "
            f"a restore would make it in ptckpt's; run ptckpt in it: nsenter -t {target.pid} ") in res.stderr
    assert res.stderr.rstrip().endswith(" ptckpt ...") and res.stderr.count("is not supported") == 1
    assert target.alive() and not (tmp_path / "img").exists()


def test_a_security_label_of_its_own_is_refused():
    """No LSM labels processes on these machines (attr/current says EINVAL): the rule."""
    assert claims.label_refusal(None, None) is None
    assert claims.label_refusal("unconfined", "unconfined") is None
    text = str(UnsupportedResource(7, *claims.label_refusal("firefox (enforce)", "unconfined")))
    assert text == ("process 7: a security label of its own (firefox (enforce); ptckpt runs as unconfined) "
                    "is not supported: a restore would run it under ptckpt's; restore under its label "
                    "(aa-exec -p, runcon)")
    claims.check_label(os.getpid())

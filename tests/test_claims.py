"""Nothing silently lost: every field /proc shows of a task is claimed by a resource module,
follows from what is restored, or refuses the dump by name (ptckpt.claims)."""

from __future__ import annotations

import ctypes
import os

import pytest

from ptckpt import claims
from ptckpt.errors import ExitCode, UnsupportedResource


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
    ("Seccomp", "2", "seccomp mode 2"),
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

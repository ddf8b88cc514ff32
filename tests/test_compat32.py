"""A 32-bit (ia32) program, and a 64-bit parent with a 32-bit child: the dump refuses them by
name, before it injects anything, and they run on as they were (it was an internal error,
exit 10, out of an injected sigaltstack).  Their round trip is issue 35's."""

from __future__ import annotations

import subprocess

import pytest

from ptckpt.errors import ExitCode

from conftest import idle_script, kill_pids, reap_orphans, require
from test_restore import _one_line

COUNTER32 = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) {
    volatile unsigned long n = 0;
    printf("READY %d\n", (int)getpid());
    fflush(stdout);
    for (;;) { n++; usleep(1000); }
}
"""


@pytest.fixture
def counter32(tmp_path) -> str:
    require("gcc")
    src, out = tmp_path / "counter32.c", tmp_path / "counter32"
    src.write_text(COUNTER32)
    made = subprocess.run(["gcc", "-m32", "-O1", "-o", str(out), str(src)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip("needs gcc -m32 (Debian's gcc-multilib): tests/install-debian-packages.sh installs it")
    return str(out)


def test_a_32_bit_program_is_refused_by_name_and_runs_on(spawn, ptckpt, tmp_path, counter32):
    target = spawn(counter32, out=False)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill")
    _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, "32-bit (ia32)", "compat ABI", "x86_64 build")
    assert target.alive() and not (tmp_path / "img").exists()


def test_a_64_bit_parent_with_a_32_bit_child_is_refused_and_both_run_on(spawn, ptckpt, tmp_path, counter32):
    script = idle_script(tmp_path, "parent64.py", "import os, subprocess, time\n"
                         f"child = subprocess.Popen([{counter32!r}], stdout=subprocess.DEVNULL)\n"
                         "print('KID', child.pid, flush=True)\n"
                         "time.sleep(0.3)\n")
    target = spawn(str(script), out=False)
    kid = int(next(line for line in target.preamble if line.startswith("KID")).split()[1])
    try:
        res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill")
        _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, f"process {kid}", "32-bit (ia32)")
        assert target.alive() and not (tmp_path / "img").exists()
        with open(f"/proc/{kid}/stat") as f:
            assert f.read().split(") ")[1][0] in "RS", "the 32-bit child runs on, not left frozen"
    finally:
        kill_pids([kid])
        reap_orphans()

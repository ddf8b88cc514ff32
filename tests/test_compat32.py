"""32-bit (ia32) programs (issue 35): the C fixtures built with ``gcc -m32`` are dumped and
restored for real, in compat mode, and go on from where they were: the counter counts on
(nanosleep not failing with EINTR), a sleep frozen twice wakes, a file's offset, an
O_APPEND log, a directory stream, a ghost file and a SIGUSR1 handler (an ia32 signal
frame) are all there again, threads count on with their tids, POSIX timers fire again,
mixed trees (a 64-bit parent with a 32-bit child, and the other way round) go on.  (The
dump was an internal error, exit 10, out of an injected sigaltstack; then a refusal.)
Sockets: tests/test_inet.py with the -m32 builds; critical sections: tests/test_app.py;
core files: tests/test_core.py; a dumper killed mid-injection: tests/test_dumper_killed32.py."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import struct
import subprocess
from pathlib import Path

import pytest

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import GP_REG_NAMES

from conftest import fixture_build, idle_script, kill_pids, pid_alive, read_counter, reap_orphans, wait_until
from test_restore import _dump_kill, _older_image_with_a_smaller_vdso, _one_line, _restore, sleep_dumped_twice

CS = GP_REG_NAMES.index("cs")


PARENT32 = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
static void count(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    char line[32];
    for (unsigned long n = 1;; n++) {
        snprintf(line, sizeof line, "%020lu\n", n);
        if (pwrite(fd, line, 21, 0) != 21)
            _exit(3);
        usleep(2000);
    }
}
int main(int argc, char **argv) {             /* parent32 OUT PROGRAM64 OUT64 */
    char path[4096];
    snprintf(path, sizeof path, "%s.fork", argv[1]);
    pid_t forked = fork();
    if (forked == 0)
        count(path);                          /* a 32-bit child, sharing pages copy-on-write */
    pid_t execd = fork();
    if (execd == 0) {
        dup2(open("/dev/null", O_WRONLY), 1);    /* its own READY line is not ours */
        execl(argv[2], argv[2], argv[3], (char *)0);
        _exit(127);
    }
    printf("KIDS %d %d\n", (int)forked, (int)execd);
    printf("READY %d\n", (int)getpid());
    fflush(stdout);
    count(argv[1]);
}
"""

EXECER = r"""
#include <signal.h>
#include <stdio.h>
#include <unistd.h>
static volatile sig_atomic_t go;
static void on_usr1(int sig) { (void)sig; go = 1; }
int main(int argc, char **argv) {             /* execer PROGRAM ARG: exec PROGRAM ARG at SIGUSR1 */
    signal(SIGUSR1, on_usr1);
    printf("READY %d\n", (int)getpid());
    fflush(stdout);
    while (!go)
        usleep(1000);
    execl(argv[1], argv[1], argv[2], (char *)0);
    return 127;
}
"""


ENVSHOW = r"""
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static volatile sig_atomic_t asked;
static void on_usr1(int sig) { (void)sig; asked++; }
int main(int argc, char **argv) {             /* envshow NAME...: getenv(NAME) of each at SIGUSR1 */
    signal(SIGUSR1, on_usr1);
    printf("READY %d\n", (int)getpid());
    fflush(stdout);
    for (int seen = 0;; usleep(1000))
        for (; seen < asked; seen++) {
            for (int i = 1; i < argc; i++)
                printf("ENV %s=%s\n", argv[i], getenv(argv[i]) ? getenv(argv[i]) : "(unset)");
            fflush(stdout);
        }
}
"""

PLUGIN32 = r"""
import json, os
from ptckpt.plugins import Plugin

class Probe(Plugin):
    name = "probe32"

    def _log(self, event, proc, **more):
        with open(os.environ["PTCKPT_TEST_LOG"], "a") as f:
            f.write(json.dumps(dict(event=event, pid=proc.vpid, **more)) + "\n")

    def frozen(self, proc, ctx):
        self._log("frozen", proc, counter=int.from_bytes(proc.read_symbol("counter", 4), "little"),
                  getpid=proc.syscall("getpid"), cs=proc.registers()["cs"])

    def restored(self, proc, ctx):
        proc.write_symbol("poke", (5_000_000).to_bytes(4, "little"))
        self._log("restored", proc, getpid=proc.syscall("getpid"), env=[e.decode() for e in proc.environ()
                                                                        if e.startswith(b"PTCKPT_")])
"""


@pytest.fixture(scope="module")
def bins32(tmp_path_factory, fixture_bins32) -> dict[str, str]:
    """The fixtures built with -m32 (conftest.fixture_bins32), parent32 of these tests (a
    32-bit parent with a forked 32-bit child and an exec'd 64-bit one), and execer, which
    execs a program when told, as "execer" (-m32) and "execer64"."""
    out = tmp_path_factory.mktemp("bins32")
    made = {name: str(path) for name, path in fixture_bins32.items()}
    for name, text, flags in (("parent32", PARENT32, ("-m32",)), ("execer", EXECER, ("-m32",)),
                              ("execer64", EXECER, ()), ("envshow", ENVSHOW, ("-m32",))):
        (out / f"{name}.c").write_text(text)
        argv = fixture_build.compile_command("gcc", out / f"{name}.c", out / name, flags)
        res = subprocess.run(argv, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        made[name] = str(out / name)
    return made


def _elf_class(pid: int) -> int:
    with open(f"/proc/{pid}/exe", "rb") as f:
        return f.read(5)[4]


def _fd_states(pid: int) -> dict[str, tuple[str, str]]:
    """{path: (pos, flags)} of the process's fds onto files."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = os.readlink(f"/proc/{pid}/fd/{fd}")
        if path.startswith("/"):
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                info = dict(line.split(":", 1) for line in f if ":" in line)
            out[path] = (info["pos"].strip(), info["flags"].strip())
    return out


# A restored 32-bit process shows the [vsyscall] page a 32-bit one has not: its mm was the
# 64-bit stub's, whose MM_CONTEXT_HAS_VSYSCALL nothing clears (CRIU's compat restore too);
# a 32-bit program cannot reach it.  The tests compare the rest of the maps themselves.
VSYSCALL = pytest.mark.proc_differs("maps", reason="[vsyscall] shows in a restored 32-bit process")


def _maps(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line.split(maxsplit=5)[0] + " " + line.split()[-1] for line in f if "[vsyscall]" not in line]


@VSYSCALL
def test_a_32_bit_counter_goes_on_from_its_value_twice(spawn, ptckpt, tmp_path, bins32):
    target = spawn(bins32["counter"], 10, 1000)
    target.wait_progress()
    fds, maps = _fd_states(target.pid), _maps(target.pid)
    with open(f"/proc/{target.pid}/auxv", "rb") as f:
        auxv = f.read()
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        thread = image.process(target.pid).threads[0]
    assert thread.regs[CS] == 0x23 and thread.tls, "frozen in 32-bit code, its %gs TLS entry saved"
    at_dump = target.read_counter()
    assert at_dump > 0
    assert _restore(ptckpt, tmp_path / "img") == target.pid
    wait_until(lambda: target.read_counter() > at_dump + 20, 10, message="the 32-bit counter goes on")
    assert _elf_class(target.pid) == 1, "still the 32-bit program"
    assert _fd_states(target.pid) == fds, "its files at the same offsets, with the same flags"
    assert _maps(target.pid) == maps, "the same mappings, the 32-bit vdso and its data pages among them"
    with open(f"/proc/{target.pid}/auxv", "rb") as f:
        assert f.read() == auxv, "the auxiliary vector of 4-byte pairs, byte for byte"
    # the restored process is a 32-bit one in every respect a second round trip needs
    _dump_kill(ptckpt, target, tmp_path / "img2")
    second = target.read_counter()
    assert _restore(ptckpt, tmp_path / "img2") == target.pid
    wait_until(lambda: target.read_counter() > second + 20, 10, message="it goes on after a second restore")
    target.assert_ok()                      # no EINTR from nanosleep, no BAD counter


@VSYSCALL
def test_a_32_bit_sleep_dumped_twice_wakes_after_restore(spawn, ptckpt, tmp_path, bins32):
    """The leave-running dump leaves the sleep in the i386 restart_syscall (0); the second
    dump finds it there and the restore sleeps on in the call restart_syscall restarted (the
    i386 clock_nanosleep here, told from clock_nanosleep_time64 by its timespec), no EINTR."""
    sleep_dumped_twice(spawn, ptckpt, tmp_path, bins32["sleeper"], "0")


@VSYSCALL
def test_a_32_bit_program_gets_its_files_and_its_signal_handler_back(spawn, ptckpt, tmp_path, bins32):
    """Offsets, O_APPEND, a directory stream, an O_PATH fd, the cwd, a ghost file and a
    deleted mapping; SIGUSR1 reaches its handler in an ia32 frame (SA_IA32_ABI, set by the
    compat rt_sigaction) and the handler returns through its restorer.  Files the program
    opened without O_LARGEFILE are opened again without it (the compat openat: in the
    process, or in ptckpt for the ghost file's description)."""
    where = tmp_path / "files"
    where.mkdir()
    target = spawn(bins32["files"], where)
    fds, maps = _fd_states(target.pid), _maps(target.pid)
    _dump_kill(ptckpt, target, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    assert _maps(target.pid) == maps
    assert _fd_states(target.pid) == fds
    for n in (1, 2):
        target.signal(signal.SIGUSR1)
        target.wait_for_line(f"VERIFY {n} OK")
    target.assert_ok()
    assert os.readlink(f"/proc/{target.pid}/cwd") == str(where / "sub")


@VSYSCALL
def test_32_bit_threads_all_go_on_with_their_tids(spawn, ptckpt, tmp_path, bins32):
    """Four counting threads and a reporting one, cloned again in the stub and each sent
    back to 32-bit mode with its own TLS entry and compat robust list."""
    target = spawn(bins32["threads"])
    tids = list(target.tids)
    _dump_kill(ptckpt, target, tmp_path / "img")
    at_dump = target.read_counters()
    assert _restore(ptckpt, tmp_path / "img") == target.pid
    wait_until(lambda: all(a > b for a, b in zip(target.read_counters(), at_dump)), 10,
               message="every 32-bit thread counts on")
    assert sorted(int(t) for t in os.listdir(f"/proc/{target.pid}/task")) == sorted([target.pid] + tids)
    target.assert_ok()                     # the fixture checks gettid() against glibc's cached tid


@VSYSCALL
def test_32_bit_posix_timers_fire_again_with_their_ids_values_and_thread(spawn, ptckpt, tmp_path, bins32):
    """A timer to the process, one to a thread (SIGEV_THREAD_ID), one never firing, an
    ITIMER_REAL: the same ids, sigev_values read in ia32 siginfo by ia32 handlers."""
    target = spawn(bins32["timers"])
    ids = [int(x) for x in target.wait_for_line(r"^TIMERS ").string.split()[1:]]
    with open(f"/proc/{target.pid}/timers") as f:
        before = f.read()
    _dump_kill(ptckpt, target, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    with open(f"/proc/{target.pid}/timers") as f:
        assert f.read() == before, ids
    target.signal()
    line = target.wait_for_line(r"^COUNTS ", timeout=15).string
    assert target.wait_exit(10) == 0, target.describe()
    assert all(int(n) > 0 for n in line.split()[1:4]), line


def test_a_32_bit_vdso_of_another_size_is_refused_before_anything_runs(spawn, ptckpt, tmp_path, bins32):
    """The plan compares the image's 32-bit vdso with this kernel's (a throwaway child of
    ptckpt maps one to look), not with ptckpt's own 64-bit one."""
    target = spawn(bins32["counter"])
    _dump_kill(ptckpt, target, tmp_path / "img")
    res = ptckpt("check", "--image", tmp_path / "img")
    assert res.returncode == 0 and "vdso layout" in res.stdout, res.stdout + res.stderr

    _older_image_with_a_smaller_vdso(tmp_path / "img", tmp_path / "vdso")
    _one_line(ptckpt("restore", "-D", tmp_path / "vdso"), ExitCode.INCOMPATIBLE, "[vdso]", "bytes")
    assert not pid_alive(target.pid)
    assert ptckpt("check", "--image", tmp_path / "vdso").returncode == ExitCode.INCOMPATIBLE


@VSYSCALL
def test_a_64_bit_parent_with_a_32_bit_child_both_go_on(spawn, ptckpt, tmp_path, bins32):
    kid_out = tmp_path / "kid.out"
    script = idle_script(tmp_path, "parent64.py", "import os, subprocess, time\n"
                         f"child = subprocess.Popen([{bins32['counter']!r}, {str(kid_out)!r}], "
                         "stdout=subprocess.DEVNULL)\n"
                         "print('KID', child.pid, flush=True)\n"
                         "time.sleep(0.3)\n")
    target = spawn(str(script), out=False)
    kid = int(next(line for line in target.preamble if line.startswith("KID")).split()[1])
    try:
        _dump_kill(ptckpt, target, tmp_path / "img", members=[kid])
        at_dump = read_counter(kid_out)
        assert _restore(ptckpt, tmp_path / "img") == target.pid
        with open(f"/proc/{target.pid}/task/{target.pid}/children") as f:
            assert [int(x) for x in f.read().split()] == [kid]
        assert _elf_class(kid) == 1 and _elf_class(target.pid) == 2
        wait_until(lambda: read_counter(kid_out) > at_dump + 20, 10, message="the 32-bit child counts on")
        assert target.alive()
    finally:
        kill_pids([kid])
        reap_orphans()


@VSYSCALL
def test_a_32_bit_parent_with_a_32_bit_and_a_64_bit_child_all_go_on(spawn, ptckpt, tmp_path, bins32,
                                                                     fixture_bins):
    out64 = tmp_path / "kid64.out"
    target = spawn(bins32["parent32"], fixture_bins["counter"], out64)
    kids = [int(x) for x in next(line for line in target.preamble if line.startswith("KIDS")).split()[1:]]
    outs = [target.out_path, Path(f"{target.out_path}.fork"), out64]
    try:
        wait_until(lambda: all(o.exists() and o.stat().st_size for o in outs), 5)
        _dump_kill(ptckpt, target, tmp_path / "img", members=kids)
        at_dump = [read_counter(o) for o in outs]
        assert _restore(ptckpt, tmp_path / "img") == target.pid
        with open(f"/proc/{target.pid}/task/{target.pid}/children") as f:
            assert sorted(int(x) for x in f.read().split()) == sorted(kids)
        assert [_elf_class(p) for p in [target.pid] + kids] == [1, 1, 2]
        wait_until(lambda: all(read_counter(o) > n + 20 for o, n in zip(outs, at_dump)), 10,
                   message="the 32-bit parent, its 32-bit and its 64-bit child all count on")
    finally:
        kill_pids(kids)
        reap_orphans()


class _Memory:
    """Bytes at an address, read as AddressSpace.read reads them."""

    def __init__(self, addr: int, data: bytes):
        self.addr, self.data = addr, data

    def read(self, addr: int, size: int) -> bytes:
        return self.data[addr - self.addr:addr - self.addr + size]


def _i386_regs(**values):
    from ptckpt.tracee import Regs
    regs = Regs.from_values([0] * len(GP_REG_NAMES))
    regs.cs = 0x23
    for name, value in values.items():
        setattr(regs, name, value)
    return regs


@pytest.mark.parametrize("timespec, expected", [
    (struct.pack("<ii", 1, 500_000_000) + b"\xef\xbe\xad\xde" * 2, "clock_nanosleep"),
    (struct.pack("<qq", 1, 500_000_000), "clock_nanosleep_time64"),
    (struct.pack("<qq", 2, 0), "clock_nanosleep_time64"),       # both fit: the 16-byte reading
    (struct.pack("<ii", 2, 0) + struct.pack("<q", -1), "clock_nanosleep"),
    (struct.pack("<ii", -1, -1) * 2, "restart_syscall"),         # no timespec at all: EINTR as before
])
def test_a_32_bit_sleep_frozen_in_restart_syscall_is_told_by_its_timespec(timespec, expected):
    """restart_syscall (i386 0) of clock_nanosleep(CLOCK_REALTIME, 0, req, rem): the
    remaining time the kernel wrote at `rem` says which of the two calls it restarts."""
    from ptckpt.resources.threads import restarted_syscall_compat
    from ptckpt.tracee import I386_SYSCALLS
    regs = _i386_regs(rbx=0, rcx=0, rdx=0xFFE0_0000, rsi=0xFFE0_1000)
    assert restarted_syscall_compat(regs, _Memory(0xFFE0_1000, timespec)) == I386_SYSCALLS[expected]


def test_a_32_bit_sleep_restarts_with_what_was_left():
    """A 32-bit thread frozen in clock_nanosleep with a restart block resumes inside the
    call (resume_regs: rip after int $0x80, orig_rax its number, rax -ERESTARTNOHAND, which
    the kernel turns into the call again or EINTR after a handler) with req = rem (edx =
    esi), in 32-bit mode; executed again (reexecuted_regs, what diff compares): rip - 2,
    eax its number."""
    from ptckpt.formats.model import Restart
    from ptckpt.resources.threads import reexecuted_regs, resume_regs
    from test_formats import make_thread
    regs = _i386_regs(rip=0xF7EE85E9, rax=2**64 - 516, orig_rax=267, rbx=0, rcx=0, rdx=0xFFE0_0000,
                      rsi=0xFFE0_1000)
    thread = dataclasses.replace(make_thread(), regs=regs.values(), restart=Restart.RESTART_BLOCK, syscall_nr=267)
    resumed = resume_regs(thread)
    assert (resumed.rip, resumed.rax, resumed.orig_rax, resumed.rdx, resumed.rsi, resumed.cs) == \
        (0xF7EE85E9, 2**64 - 514, 267, 0xFFE0_1000, 0xFFE0_1000, 0x23)
    again = reexecuted_regs(thread)
    assert (again.rip, again.rax, again.rdx, again.rsi, again.cs) == (0xF7EE85E7, 267, 0xFFE0_1000, 0xFFE0_1000, 0x23)
    assert again.orig_rax == 2**64 - 1


def test_a_32_bit_campaign_gives_the_table_of_the_64_bit_build(spawn, ptckpt, tmp_path, fixture_bins, bins32):
    """fixtures/campaigner, built for x86_64 and with -m32 (its `table` of 8-byte words in
    both; `stop` is an unsigned long, 4 bytes in one, 8 in the other), dumped at the same point and run as campaigns with the same seeds and faults
    by symbol: the same bits flip, with the same outcomes (a flip in a word's upper half
    masked, in its lower half detected), in runs that are copies of a template (a 32-bit
    template forks its copies) and in runs restored one by one."""
    tables = {}
    try:
        for build, program in (("x86_64", str(fixture_bins["campaigner"])), ("-m32", bins32["campaigner"])):
            source = tmp_path / f"input{build}"
            source.write_text("HEADHEAD the rest\n")
            target = spawn(program, source, 1500, out=False)
            image = tmp_path / f"img{build}"
            _dump_kill(ptckpt, target, image)
            for clones in ("--clones", "--no-clones"):
                res = ptckpt("campaign", "-D", image, "--runs", "8", "--jobs", "2", "--seed", "40",
                             "--timeout", "30s", "--inject", "set:symbol=stop,value=1",
                             "--inject", "flip:symbol=table,bits=1", clones,
                             "-o", tmp_path / f"out{build}{clones}", "--json")
                assert res.returncode == 0, res.stderr
                result = json.loads(res.stdout)
                assert result["runs_as"] == ("copies of a template" if clones == "--clones" else "restores")
                tables[build, clones] = [
                    (r["seed"], r["outcome"], r["status"],
                     [(f["bits"], f["before"], f["after"]) for f in r["faults"] if f["target"] == "table"])
                    for r in result["runs"]]
                for r in result["runs"]:           # each read its input on from the dumped offset
                    out = (tmp_path / f"out{build}{clones}" / r["output"]["stdout"]).read_text()
                    assert out.startswith("rest  the rest\n"), (build, clones, out)
    finally:
        kill_pids(_running(str(fixture_bins["campaigner"])) + _running(bins32["campaigner"]))
        reap_orphans()
    first = tables["x86_64", "--clones"]
    assert {o for _s, o, _st, _f in first} == {"masked", "detected"}, first
    assert tables["-m32", "--clones"] == first
    assert tables["-m32", "--no-clones"] == tables["x86_64", "--no-clones"] == first


def _running(program: str) -> list[int]:
    """The pids running `program` (a campaign's copies left behind by a failed test)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/exe") == program:
                pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("execer, program, elf_class", [("execer", "counter64", 2), ("execer64", "counter32", 1)],
                         ids=["32-execs-64", "64-execs-32"])
@VSYSCALL
def test_a_restored_process_execs_a_program_of_the_other_abi(spawn, ptckpt, tmp_path, bins32, fixture_bins,
                                                             execer, program, elf_class):
    """A restored 32-bit process that execs a 64-bit program, and the reverse: the exec
    after the restore gives the new program its own ABI (mode, vdso, auxv) and it runs."""
    counter = str(fixture_bins["counter"]) if program == "counter64" else bins32["counter"]
    out = tmp_path / "counter.out"
    target = spawn(bins32[execer], counter, out, out=False)
    _dump_kill(ptckpt, target, tmp_path / "img")
    assert _restore(ptckpt, tmp_path / "img") == target.pid
    assert _elf_class(target.pid) == 3 - elf_class, "the restored program before its exec"
    target.signal(signal.SIGUSR1)
    wait_until(lambda: out.exists() and out.stat().st_size and read_counter(out) > 20, 10,
               message="the program it execs counts")
    assert _elf_class(target.pid) == elf_class


@VSYSCALL
def test_plugins_and_the_environment_of_a_32_bit_process(spawn, ptckpt, tmp_path, bins32):
    """A plugin reads and writes a 32-bit program's variables by symbol, makes syscalls in it
    and reads its environment (4-byte pointers); --set-env and --unset-env give getenv() in
    a 32-bit program its new environment (the array mapped below 4 GiB)."""
    plugin = tmp_path / "probe32.py"
    plugin.write_text(PLUGIN32)
    log = tmp_path / "events.log"
    env = dict(os.environ, PTCKPT_TEST_LOG=str(log), PTCKPT_A="old", PTCKPT_B="gone")
    target = spawn(bins32["counter"], 10, 1000, env=env)
    target.wait_progress()
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill", "--plugin", plugin, env=env)
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--plugin", plugin, "--set-env", "PTCKPT_A=new",
                 "--unset-env", "PTCKPT_B", env=env)
    assert res.returncode == 0, res.stderr
    frozen, restored = [json.loads(line) for line in log.read_text().splitlines()]
    assert frozen["cs"] == 0x23 and frozen["getpid"] == frozen["pid"] == target.pid and frozen["counter"] > 0
    assert restored["getpid"] == target.pid
    assert "PTCKPT_A=old" in restored["env"] or "PTCKPT_A=new" in restored["env"], restored
    wait_until(lambda: target.read_counter() > 5_000_000, 10, message="the counter goes on from the poked value")

    shown = spawn(bins32["envshow"], "PTCKPT_A", "PTCKPT_B", out=False, env=env)
    _dump_kill(ptckpt, shown, tmp_path / "img2")
    res = ptckpt("restore", "-D", tmp_path / "img2", "--detach", "--set-env", "PTCKPT_A=new",
                 "--unset-env", "PTCKPT_B")
    assert res.returncode == 0, res.stderr
    shown.signal(signal.SIGUSR1)
    shown.wait_for_line("ENV PTCKPT_B=")
    assert [line for line in shown.stdout_lines() if line.startswith("ENV")] == \
        ["ENV PTCKPT_A=new", "ENV PTCKPT_B=(unset)"]

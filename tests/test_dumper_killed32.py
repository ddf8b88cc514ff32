"""A dumper killed outright mid-injection leaves a 32-bit (ia32) target as it was (issue 35).

The compat way home (ptckpt.returnframe32): an ia32 signal frame holding the thread's own
context, which both kinds of injected syscalls lead into, the i386 ones (through the vdso's
int $0x80, in 32-bit mode) and the x86_64 ones (in 64-bit mode, at a gadget in the vdso's
padding).  Before it, PTRACE_O_EXITKILL had the kernel kill the target with the dumper.
PTCKPT_TEST_DIE_AT (ptckpt.testhooks) kills the dumper at each state of an injection; the
target must run on untraced, its maps, fds, masks and dispositions the same, its counter
and its registers intact: regs32 below checks its general registers, the x87 control word
and stack, MXCSR and ymm0-7 across every spin, counter that nanosleep never fails with EINTR.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import cpu_has, fixture_build
from test_dumper_killed import POINTS, _check_unharmed, _view, dump_killed_at, kill_at_random_moments

REGS32 = r"""/* regs32 OUTFILE: a 32-bit program's registers that must survive a dumper killed mid-injection.
 * cflags: -mavx -no-pie -fno-pie
 * spin() (one asm routine, nothing but a dec/jnz loop between its loads and its stores) loads
 * ebx ecx edx esi edi ebp, the x87 control word and its eight registers, MXCSR and ymm0-7
 * from `want`, spins, and stores them into `got`; main compares, rewrites OUTFILE at offset 0
 * with "REGS32 OK <checks>" (or "FAIL REGS32 BAD <what>", exit 4), prints READY after the
 * first check and sleeps 1 ms every 4th (a syscall to be frozen in: nanosleep never EINTR). */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct state {
	uint32_t gpr[8];              /*  0: eax ebx ecx edx esi edi ebp, by number; [0] unused */
	uint32_t cw, mxcsr;           /* 32 */
	long double st[8];            /* 40: 12 bytes each, 10 of them the register */
	uint8_t pad[24];
	uint8_t ymm[8][32];           /* 160 */
} __attribute__((aligned(32)));
struct state want, got;

void spin(unsigned long iters);
__asm__(".text\n.globl spin\nspin:\n"
	"push %ebp\npush %ebx\npush %esi\npush %edi\n"
	"mov 20(%esp),%eax\n"
	"fninit\nfldcw want+32\n"
	"fldt want+124\nfldt want+112\nfldt want+100\nfldt want+88\n"
	"fldt want+76\nfldt want+64\nfldt want+52\nfldt want+40\n"
	"ldmxcsr want+36\n"
	"vmovdqa want+160,%ymm0\nvmovdqa want+192,%ymm1\nvmovdqa want+224,%ymm2\nvmovdqa want+256,%ymm3\n"
	"vmovdqa want+288,%ymm4\nvmovdqa want+320,%ymm5\nvmovdqa want+352,%ymm6\nvmovdqa want+384,%ymm7\n"
	"mov want+4,%ebx\nmov want+8,%ecx\nmov want+12,%edx\nmov want+16,%esi\nmov want+20,%edi\nmov want+24,%ebp\n"
	"1: dec %eax\njnz 1b\n"
	"mov %ebx,got+4\nmov %ecx,got+8\nmov %edx,got+12\nmov %esi,got+16\nmov %edi,got+20\nmov %ebp,got+24\n"
	"vmovdqa %ymm0,got+160\nvmovdqa %ymm1,got+192\nvmovdqa %ymm2,got+224\nvmovdqa %ymm3,got+256\n"
	"vmovdqa %ymm4,got+288\nvmovdqa %ymm5,got+320\nvmovdqa %ymm6,got+352\nvmovdqa %ymm7,got+384\n"
	"vzeroupper\nstmxcsr got+36\nfnstcw got+32\n"
	"fstpt got+40\nfstpt got+52\nfstpt got+64\nfstpt got+76\n"
	"fstpt got+88\nfstpt got+100\nfstpt got+112\nfstpt got+124\n"
	"pop %edi\npop %esi\npop %ebx\npop %ebp\nret\n");

static int out;

static void fail(const char *what, int i)
{
	char line[80];
	int n = snprintf(line, sizeof line, "FAIL REGS32 BAD %s %d\n", what, i);
	pwrite(out, line, n, 0);
	fprintf(stderr, "%s", line);
	exit(4);
}

int main(int argc, char **argv)
{
	if (argc != 2)
		return 2;
	out = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC, 0644);
	for (int g = 1; g < 7; g++)
		want.gpr[g] = 0x6B6B0000u ^ (uint32_t)(g + 1) << 8 ^ 0x96;
	want.cw = 0x0F7F;                           /* all masked, 64-bit precision, toward zero */
	want.mxcsr = 0x7F80;                        /* all masked, toward zero */
	for (int i = 0; i < 8; i++)
		want.st[i] = (long double)(i + 1) * 1.0000000000000000001L / 3.0L - (long double)i * 1e-3L;
	for (int r = 0; r < 8; r++)
		for (int b = 0; b < 32; b++)
			want.ymm[r][b] = (uint8_t)(0xA5 ^ (r * 32 + b));
	for (unsigned long checks = 1;; checks++) {
		memset(&got, 0, sizeof got);
		spin(1ul << 22);
		for (int g = 1; g < 7; g++)
			if (got.gpr[g] != want.gpr[g])
				fail("gpr", g);
		if ((got.cw & 0xFFFF) != want.cw)
			fail("fpu control word", 0);
		if (got.mxcsr != want.mxcsr)
			fail("mxcsr", 0);
		for (int i = 0; i < 8; i++)
			if (memcmp(&got.st[i], &want.st[i], 10))
				fail("st", i);
		for (int r = 0; r < 8; r++)
			if (memcmp(got.ymm[r], want.ymm[r], 32))
				fail("ymm", r);
		char line[48];
		int n = snprintf(line, sizeof line, "REGS32 OK %020lu\n", checks);
		if (pwrite(out, line, n, 0) != n)
			return 3;
		if (checks == 1) {
			printf("READY %d\n", (int)getpid());
			fflush(stdout);
		}
		if (checks % 4 == 0) {
			struct timespec ts = {0, 1000000};
			if (nanosleep(&ts, NULL) < 0) {
				fprintf(stderr, "EINTR nanosleep: %s\n", strerror(errno));
				exit(3);
			}
		}
	}
}
"""

# Which call the n-th injection of a dump of a 32-bit process is: the first is the i386
# get_robust_list (through int $0x80), the 9th and 45th x86_64 ones (rt_sigaction,
# in 64-bit mode); test_both_kinds_of_injected_calls_find_their_way_home pins each kind.
ARRIVALS = (1, 9, 45)


@pytest.fixture(scope="module")
def bins(tmp_path_factory, fixture_bins32) -> dict[str, str]:
    """counter, threads and timers built with -m32, and regs32 (needs AVX: ymm0-7)."""
    made = {name: str(fixture_bins32[name]) for name in ("counter", "threads", "timers")}
    if cpu_has("avx"):
        out = tmp_path_factory.mktemp("regs32")
        (out / "regs32.c").write_text(REGS32)
        argv = fixture_build.compile_command("gcc", out / "regs32.c", out / "regs32", ("-m32",))
        res = subprocess.run(argv, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        made["regs32"] = str(out / "regs32")
    return made


def _program(bins, fixture: str) -> str:
    if fixture not in bins:
        pytest.skip("regs32 needs a CPU with AVX")
    return bins[fixture]


@pytest.mark.parametrize("fixture", ["counter", "threads", "regs32"])
@pytest.mark.parametrize("point", POINTS)
def test_a_dumper_killed_mid_injection_leaves_a_32_bit_target_as_it_was(fixture, point, spawn, ptckpt,
                                                                        tmp_path, bins):
    target = spawn(_program(bins, fixture))
    before, vdso = _view(target.pid), _vdso(target.pid)
    for n in ARRIVALS:
        dump_killed_at(point, n, target, before, ptckpt, tmp_path / f"img-{n}")
    # the killed dumpers left their gadget in the vdso's padding; a dump after them works and
    # puts the padding back
    assert _vdso(target.pid) != vdso
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--leave-running")
    assert res.returncode == 0, res.stderr
    target.wait_progress()
    target.assert_ok()
    assert _vdso(target.pid) == vdso


@pytest.mark.parametrize("point", POINTS)
def test_a_32_bit_target_taking_timer_signals_survives_killed_dumpers(point, spawn, ptckpt, tmp_path, bins):
    """timers -m32: three timers' signals for ia32 handlers every 10 to 20 ms, the dumpers
    killed at an i386 call and at x86_64 ones; every timer fires on, to the right thread
    with its value (a handler that ran on the way home would run below the frame)."""
    target = spawn(bins["timers"])
    before = _view(target.pid)
    for n in ARRIVALS:
        dump_killed_at(point, n, target, before, ptckpt, tmp_path / f"img-{n}", progress=False)
    target.signal()
    line = target.wait_for_line(r"^COUNTS ", timeout=15).string
    assert target.wait_exit(10) == 0, target.describe()
    assert all(int(n) > 0 for n in line.split()[1:4]), line


def test_32_bit_dumpers_killed_at_random_moments_leave_the_target_running(spawn, ptckpt_cmd, tmp_path, bins):
    """The threads fixture built with -m32: a scope per thread, SIGKILL anywhere in them."""
    kill_at_random_moments(spawn(bins["threads"]), ptckpt_cmd, tmp_path)


INJECT = """
import os
import sys
from ptckpt import procfs, tracee
from ptckpt.tracee import AddressSpace, Session, find_syscall_insn, remote_syscalls
pid, kind, signo = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
session = Session()
task = session.freeze_process(pid)[0]
with AddressSpace(pid) as mem, remote_syscalls(task, mem, find_syscall_insn(mem, procfs.read_maps(pid))) as remote:
    assert remote.compat
    for i in range(3):
        if i == 1 and signo:      # pending for the thread while it runs our second call
            assert tracee._host_syscall(tracee.SYSCALL_NUMBERS["tgkill"], pid, task.tid, signo) == 0
        if kind == "i386":
            with remote.scratch(8) as buf:
                remote.checked_compat("get_robust_list", 0, int(buf), int(buf) + 4)
        else:
            assert remote.checked("getpid") == pid
session.resume_all()
print("DONE")
"""


@pytest.mark.parametrize("kind", ["i386", "x86_64"])
@pytest.mark.parametrize("point", POINTS)
def test_both_kinds_of_injected_calls_find_their_way_home(kind, point, spawn, tmp_path, bins):
    """Three calls of one kind in one scope, the injector killed at the second's `point`."""
    target = spawn(_program(bins, "regs32") if cpu_has("avx") else bins["counter"])
    before = _view(target.pid)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PTCKPT_TEST_DIE_AT=f"{point}:2")
    res = _inject(target.pid, kind, env)
    assert res.returncode == -signal.SIGKILL, (res.returncode, res.stdout, res.stderr)
    _check_unharmed(target, before, tmp_path / "no-image")
    # unharmed, not killed: the same script without the hook runs its three calls through
    env.pop("PTCKPT_TEST_DIE_AT")
    res = _inject(target.pid, kind, env)
    assert res.returncode == 0 and "DONE" in res.stdout, res.stderr
    target.wait_progress()
    target.assert_ok()


@pytest.mark.parametrize("kind", ["i386", "x86_64"])
def test_a_handler_that_runs_on_the_way_home_returns_to_it(kind, spawn, tmp_path, bins):
    """A SIGALRM pending for the thread when the injector dies at its second call's
    inject-set: the kernel runs the (ia32) handler first, from the injected state (64-bit
    mode for an x86_64 call); the handler's frame goes below ours, its sigreturn comes
    back to the call, and the call goes home.  timers quiet: no timer fires, so the count
    of alarms is ours: exactly 1."""
    target = spawn(bins["timers"], "quiet")
    before = _view(target.pid)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PTCKPT_TEST_DIE_AT="inject-set:2")
    res = _inject(target.pid, kind, env, signal.SIGALRM)
    assert res.returncode == -signal.SIGKILL, (res.returncode, res.stdout, res.stderr)
    _check_unharmed(target, before, tmp_path / "no-image", progress=False)
    target.signal()
    line = target.wait_for_line(r"^COUNTS ", timeout=15).string
    assert target.wait_exit(10) == 0, target.describe()
    assert line.split()[3] == "1", line


def _inject(pid: int, kind: str, env: dict, signo: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", INJECT, str(pid), kind, str(int(signo))], env=env,
                          capture_output=True, text=True, timeout=60)


def test_without_a_return_path_the_32_bit_target_dies_with_the_dumper(spawn, ptckpt, tmp_path, bins):
    """Where no way home can be built (here: the vdso's padding after __kernel_rt_sigreturn
    is not nops), PTRACE_O_EXITKILL stays: the kernel kills the target with the dumper rather
    than let it run on with registers not its own, and the dump says so on stderr."""
    target = spawn(bins["counter"])
    start, code = _vdso(target.pid)
    at = code.find(b"\xb8\xad\x00\x00\x00\xcd\x80") + 8          # __kernel_rt_sigreturn's padding
    assert code[at:at + 4] == b"\x90" * 4
    with open(f"/proc/{target.pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(start + at)
        mem.write(b"\xcc" * 4)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--leave-running",
                 env=dict(os.environ, PTCKPT_TEST_DIE_AT="inject-exit:9"))
    assert res.returncode == -signal.SIGKILL, (res.returncode, res.stderr)
    assert "no way home" in res.stderr, res.stderr
    target.wait_exit(10)
    assert target.popen.returncode == -signal.SIGKILL, target.describe()


def _vdso(pid: int) -> tuple[int, bytes]:
    with open(f"/proc/{pid}/maps") as f:
        line = next(line for line in f if line.rstrip().endswith("[vdso]"))
    start, end = (int(x, 16) for x in line.split()[0].split("-"))
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(start)
        return start, mem.read(end - start)

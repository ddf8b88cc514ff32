"""A user without privileges dumps its own processes and restores them with their pids, in
a user and pid namespace of their own (issue 19); what it may not have is refused with the
capability named and the way out.

The user is a uid with no passwd entry; its commands run through setpriv (util-linux) with
no capabilities.  Where this Python lives under a directory other users may not enter (a
pyenv under /root), the user's commands run in a mount namespace of the tests' own, in
which those directories are made passable and nothing else changes (:class:`User`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import CliResult, needs, tool, kill_pids, read_numbers, reap_orphans, wait_pid_free, wait_until

UID = GID = 48_613
SETPRIV, NSENTER, UNSHARE = tool("setpriv"), tool("nsenter"), tool("unshare")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the tests switch to another user: they start as root"),
    needs("setpriv", "nsenter", "unshare"),
]


def _closed_ancestors(path: str) -> list[str]:
    """Directories on the way to `path` that other users may not pass (no o+x)."""
    out, here = [], "/"
    for part in Path(path).parts[1:]:
        here = os.path.join(here, part)
        if os.path.isdir(here) and not os.stat(here).st_mode & 0o001:
            out.append(here)
    return out


class User:
    """An unprivileged user: `run` (a command to its end), `start` (a process left running)."""

    def __init__(self, home: Path):
        self.home = home
        self.holder: subprocess.Popen | None = None
        needed = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.executable,
                                                 Path(__file__).resolve().parents[1])}
        closed = sorted({a for p in needed for a in _closed_ancestors(p)}, key=len)
        if closed:
            self.holder = self._namespace(closed, needed)

    def _namespace(self, closed: list[str], needed: set[str]) -> subprocess.Popen:
        """A process holding a mount namespace where each closed directory is a passable
        tmpfs holding (bind mounts of) just the entries on the way to what is needed."""
        stash = tempfile.mkdtemp(prefix="ptckpt-userns-stash-")
        lines = ["set -e"]
        n = 0
        for directory in closed:
            children = sorted({Path(p).relative_to(directory).parts[0] for p in needed
                               if p.startswith(directory + "/")})
            for child in children:
                n += 1
                lines.append(f"mkdir -p {stash}/{n} && mount --bind '{directory}/{child}' {stash}/{n}")
            lines.append(f"mount -t tmpfs -o mode=0755 ptckpt-test '{directory}'")
            for i, child in enumerate(children, n - len(children) + 1):
                lines.append(f"mkdir -p '{directory}/{child}' && mount --bind {stash}/{i} '{directory}/{child}'")
        lines.append("echo ready; exec sleep infinity")
        holder = subprocess.Popen([UNSHARE, "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        if holder.stdout.readline().strip() != "ready":
            holder.kill()
            pytest.fail(f"mount namespace for the user: {holder.communicate()[1]}")
        return holder

    def argv(self, argv: list[str]) -> list[str]:
        enter = ([NSENTER, f"--target={self.holder.pid}", "--mount", f"--wd={self.home}", "--"]
                 if self.holder else [])
        return enter + [SETPRIV, f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "--inh-caps=-all",
                        "--", *argv]

    def env(self) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(self.home),
                "LANG": "C.UTF-8"}

    def run(self, *args: object, timeout: float = 60) -> CliResult:
        script = Path(sys.executable).parent / "ptckpt"
        # files, not pipes: a restored process gets the restore's stdio and keeps it open
        with tempfile.TemporaryFile() as so, tempfile.TemporaryFile() as se:
            proc = subprocess.run(self.argv([str(script), *map(str, args)]), stdin=subprocess.DEVNULL,
                                  stdout=so, stderr=se, timeout=timeout, cwd=self.home, env=self.env(),
                                  start_new_session=True)
            reap_orphans()
            so.seek(0)
            se.seek(0)
            return CliResult(proc.returncode, so.read().decode(errors="replace"),
                             se.read().decode(errors="replace"))

    def start(self, *argv: object) -> subprocess.Popen:
        return subprocess.Popen(self.argv([str(a) for a in argv]), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=self.home,
                                env=self.env(), start_new_session=True, close_fds=True, text=True)

    def close(self) -> None:
        if self.holder:
            self.holder.kill()
            self.holder.wait()


@pytest.fixture
def user(fixture_bins):
    home = Path(tempfile.mkdtemp(prefix="ptckpt-user-"))
    for name in ("counter", "threads", "forkserver"):
        shutil.copy(fixture_bins[name], home / name)
    for p in (home, *home.iterdir()):
        os.chown(p, UID, GID)
    os.chmod(home, 0o700)
    u = User(home)
    started: list[int] = []
    u.started = started
    yield u
    for pid in started:                # the session of each (a tree's children), then each
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, 9)
    kill_pids(started)
    reap_orphans()
    u.close()
    shutil.rmtree(home, ignore_errors=True)


def _ready(proc: subprocess.Popen) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("READY"):
            return lines
    pytest.fail(f"the user's {proc.args[-2:]} did not start: {lines}")


def _restored(out: str) -> tuple[int, int]:
    """(init, outer pid) from `restore --pidns --detach`'s line."""
    m = re.search(r"\(init (\d+)\) as (\d+)", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


@pytest.mark.parametrize("program", ["counter", "threads", "forkserver"])
def test_a_user_dumps_its_process_and_restores_it_with_its_pids_in_namespaces_of_its_own(user, program):
    """counter: one process; threads: five threads with their tids; forkserver: a tree of four
    sharing MAP_SHARED|MAP_ANONYMOUS memory and a memfd (no /proc/PID/map_files for a user)."""
    proc = user.start(f"./{program}", "out")
    user.started.append(proc.pid)
    tids = {proc.pid} | {int(line.split()[2]) for line in _ready(proc) if line.startswith("TID ")}
    out = user.home / "out"
    first = read_numbers(out)
    wait_until(lambda: read_numbers(out) > first)

    r = user.run("dump", proc.pid, "-D", "live", "--leave-running")
    assert r.returncode == 0, r.stderr
    for p in (user.home / "live", *(user.home / "live").iterdir()):
        st = p.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (UID, 0o700 if p.is_dir() else 0o600), p
    seen = read_numbers(out)
    wait_until(lambda: read_numbers(out) > seen)             # the leave-running target goes on

    r = user.run("dump", proc.pid, "-D", "img", "--kill")
    assert r.returncode == 0, r.stderr
    proc.wait(10)
    at_dump = read_numbers(out)
    wait_pid_free(proc.pid)

    r = user.run("restore", "-D", "img", "--detach")        # its own pid needs a capability
    assert r.returncode == 4, r
    assert r.stderr.count("\n") == 1 and "CAP_CHECKPOINT_RESTORE" in r.stderr and "--pidns" in r.stderr, r.stderr
    assert not os.path.exists(f"/proc/{proc.pid}")

    r = user.run("restore", "-D", "img", "--pidns", "--detach")
    assert r.returncode == 0, r.stderr
    init, outer = _restored(r.stderr)
    user.started += [outer, init]
    wait_until(lambda: read_numbers(out) > at_dump)
    now = read_numbers(out)
    assert all(a <= b for a, b in zip(at_dump, now)), (at_dump, now)   # it went on from its values
    s = _status(outer)
    assert s["Uid"].split() == [str(UID)] * 4 and s["Gid"].split() == [str(GID)] * 4
    assert int(s["CapEff"], 16) == int(s["CapPrm"], 16) == int(s["CapAmb"], 16) == 0
    assert s["NSpid"].split() == [str(outer), str(proc.pid)]
    assert os.readlink(f"/proc/{outer}/ns/user") != os.readlink("/proc/self/ns/user")
    inner = {int(_status(f"{outer}/task/{t}")["NSpid"].split()[-1]) for t in os.listdir(f"/proc/{outer}/task")}
    assert inner == tids                                    # threads: each with its own tid
    if program == "forkserver":
        children = Path(f"/proc/{outer}/task/{outer}/children").read_text().split()
        assert len(children) == 3
    assert "BAD" not in (user.home / "out").read_text()


def test_a_user_is_refused_a_process_of_another_user_and_an_image_it_may_not_read(user, spawn, ptckpt, tmp_path):
    target = spawn("counter")
    r = user.run("dump", target.pid, "-D", "theirs")
    assert r.returncode == 4 and r.stderr.count("\n") == 1, r
    assert f"not permitted to trace process {target.pid}" in r.stderr
    before = target.read_counter()
    wait_until(lambda: target.read_counter() > before)      # unharmed, running
    assert not (user.home / "theirs").exists()

    ptckpt("dump", target.pid, "-D", tmp_path / "root-img", "--leave-running", check=True)
    shutil.copytree(tmp_path / "root-img", user.home / "root-img")   # the user may reach it, not read it
    os.chmod(user.home / "root-img", 0o700)
    for r in (user.run("show", "root-img"), user.run("restore", "-D", "root-img", "--pidns")):
        assert r.returncode == 4 and r.stderr.count("\n") == 1, r
        assert "permission" in r.stderr.lower() or "not permitted" in r.stderr, r.stderr

    # given to the user (or edited to look like the user's): it still ran as root
    for p in (user.home / "root-img", *(user.home / "root-img").iterdir()):
        os.chown(p, UID, GID)
    r = user.run("restore", "-D", "root-img", "--pidns", "--detach")
    assert r.returncode == 4 and r.stderr.count("\n") == 1, r
    assert "uids 0/0/0/0" in r.stderr and "CAP_SETUID" in r.stderr, r.stderr
    assert "restored" not in r.stderr


SECCOMP_C = r"""
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <unistd.h>
int main(void)
{
	struct sock_filter allow[] = {BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)};
	struct sock_fprog prog = {1, allow};
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog))
		return 1;
	printf("READY %d\n", getpid());
	fflush(stdout);
	for (;;)
		pause();
}
"""

TCP_PY = """
import socket, time
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
client = socket.create_connection(listener.getsockname())
server, _ = listener.accept()
print("READY", flush=True)
while True:
    time.sleep(1)
"""


def test_what_a_user_cannot_read_is_refused_by_name_and_the_process_runs_on(user):
    (user.home / "seccomp.c").write_text(SECCOMP_C)
    subprocess.run(["gcc", "-o", user.home / "seccomp", user.home / "seccomp.c"], check=True)
    (user.home / "tcp.py").write_text(TCP_PY)
    for p in user.home.iterdir():
        os.chown(p, UID, GID)
    cases = [(["./seccomp"], [], "seccomp filters", "CAP_SYS_ADMIN", 4),
             ([sys.executable, "tcp.py"], ["--tcp-established"], "network lock", "CAP_NET_ADMIN", 17)]
    for argv, flags, what, capability, code in cases:
        proc = user.start(*argv)
        user.started.append(proc.pid)
        _ready(proc)
        r = user.run("dump", proc.pid, "-D", "img", "--leave-running", *flags)
        assert r.returncode == code and r.stderr.count("\n") == 1, r
        assert what in r.stderr and capability in r.stderr, r.stderr
        assert not (user.home / "img").exists()
        with open(f"/proc/{proc.pid}/status") as f:
            status = f.read()
        assert "\nState:\tS" in status and "\nTracerPid:\t0\n" in status, status


def test_root_s_semaphore_sets_do_not_stand_in_a_user_s_way(user):
    """A SysV semaphore set of root's (mode 0600) in the same IPC namespace: a user's dump
    cannot read it, and its tree cannot use it either; the dump goes on without it."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    semid = libc.semget(0, 1, 0o600 | 0o1000)                 # IPC_PRIVATE, IPC_CREAT
    assert semid >= 0, os.strerror(ctypes.get_errno())
    try:
        proc = user.start("./counter", "out")
        user.started.append(proc.pid)
        _ready(proc)
        r = user.run("dump", proc.pid, "-D", "img", "--leave-running")
        assert r.returncode == 0, r.stderr
    finally:
        libc.semctl(semid, 0, 0)                              # IPC_RMID

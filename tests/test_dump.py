"""`ptckpt dump` on real processes: what the image holds, and that the target never suffers.

Every target is a fixture program (fixtures/), started by `spawn` and killed at
teardown.  To compare the image with the process, the target is first stopped
with SIGSTOP: the dump then leaves it stopped (group stop survives a seize), so
its memory and registers can be read afterwards exactly as they were frozen.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest
from ptrace.binding import func as ptrace_func

from ptckpt.pipeline.dump import dump as library_dump
from ptckpt.errors import ExitCode, TargetVanished
from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import GP_REG_NAMES, PAGE_SIZE, FdKind, Restart, VmaKind
from ptckpt import diff
from ptckpt.resources import memory
from ptckpt.tracee import Session

from conftest import idle_script, pid_alive, wait_until


def _stop(target) -> None:
    os.kill(target.pid, signal.SIGSTOP)
    wait_until(lambda: _state(target.pid) == "T", 5, message="SIGSTOP took effect")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def _frozen_regs(pid: int) -> dict[int, tuple[int, ...]]:
    """PTRACE_GETREGS of every thread of a stopped process, read through python-ptrace."""
    session = Session()
    tasks = session.freeze_process(pid)
    try:
        out = {}
        for t in tasks:
            regs = ptrace_func.ptrace_getregs(t.tid)
            out[t.tid] = tuple(getattr(regs, n) for n in GP_REG_NAMES)
        return out
    finally:
        session.resume_all()


def _assert_pages_equal_memory(image: ImageReader, pid: int) -> int:
    """Every saved page is the memory of the stopped process, but for the fields of each
    thread's rseq area that the kernel writes at every return to user space (a thread
    that ran an injected call after its pages were read, on another CPU, has another
    cpu_id there: ptckpt.diff masks them the same way)."""
    masks = diff._rseq_masks(image.process(pid))
    assert masks or not any(t.rseq_addr for t in image.process(pid).threads)
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        total = 0
        for run in image.page_runs(pid):
            size = run.npages * PAGE_SIZE
            saved = image.read_pages(pid, run)
            live = os.pread(fd, size, run.vaddr)
            saved, live = (b"".join(diff._masked(data[i:i + PAGE_SIZE], run.vaddr + i, masks)
                                    for i in range(0, size, PAGE_SIZE)) for data in (saved, live))
            assert saved == live, f"pages at {run.vaddr:#x} (+{run.npages}) differ from memory"
            total += run.npages
        return total
    finally:
        os.close(fd)


# --- the image matches the frozen process ------------------------------------------

@pytest.mark.parametrize("program,args", [
    ("counter", ()),
    ("threads", ()),
    ("bigheap", (64,)),
    ("avx", ("ymm", 1 << 22, 200)),
])
def test_image_holds_frozen_memory_and_registers(spawn, ptckpt, tmp_path, program, args):
    target = spawn(program, *args)
    _stop(target)
    image_dir = tmp_path / "img"
    res = ptckpt("dump", target.pid, "-D", image_dir)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(image_dir)                 # the result; the summary on stderr
    assert re.search(r"\b\d+ threads?, ", res.stderr) and "pages" in res.stderr and "frozen" in res.stderr
    assert _state(target.pid) == "T", "a stopped target stays stopped"
    regs_now = _frozen_regs(target.pid)
    with ImageReader(image_dir) as image:
        proc = image.process(target.pid)
        assert image.inventory.root_pid == target.pid
        assert {t.tid for t in proc.threads} == set(regs_now)
        for t in proc.threads:
            assert t.regs == regs_now[t.tid], f"registers of {t.tid}"
            assert len(t.xstate) >= 576 and t.xfeatures & 0b11    # x87 + SSE at least
        saved = _assert_pages_equal_memory(image, target.pid)
        assert saved > 0
        kinds = {v.kind for v in proc.vmas}
        assert {VmaKind.STACK, VmaKind.VDSO, VmaKind.FILE_PRIVATE} <= kinds
        assert any(s.handler for s in proc.sigactions) or program != "bigheap"
    os.kill(target.pid, signal.SIGCONT)
    _assert_goes_on(target)
    target.assert_ok()


def _assert_goes_on(target) -> None:
    if target.name == "bigheap":
        target.signal(signal.SIGUSR1)
        target.wait_for_line("VERIFY 1 OK")
    else:
        target.wait_progress()


def test_bigheap_pages_saved_and_zero_pages_skipped(spawn, ptckpt, tmp_path):
    target = spawn("bigheap", 32)
    _stop(target)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == 0, res.stderr
    with ImageReader(tmp_path / "img") as image:
        heap = target.symbols["heap"]
        runs = image.page_runs(target.pid)
        covered = sum(r.npages for r in runs if r.vaddr <= heap < r.vaddr + r.npages * PAGE_SIZE
                      or heap <= r.vaddr < heap + (32 << 20))
        assert covered >= 32 * 256, "every page of the 32 MiB heap is saved"
        # Untouched memory is not: the image is far smaller than the address space.
        proc = image.process(target.pid)
        mapped = sum(v.end - v.start for v in proc.vmas if v.kind in (VmaKind.ANON_PRIVATE, VmaKind.HEAP))
        assert image.pages_length(target.pid) < mapped
    os.kill(target.pid, signal.SIGCONT)


def test_private_file_mapping_saves_only_modified_pages(spawn, ptckpt, tmp_path):
    target = spawn("filemap", tmp_path / "private.dat", tmp_path / "shared.dat", 16)
    _stop(target)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == 0, res.stderr
    with ImageReader(tmp_path / "img") as image:
        proc = image.process(target.pid)
        priv = next(v for v in proc.vmas if v.path == str(tmp_path / "private.dat"))
        shared = next(v for v in proc.vmas if v.path == str(tmp_path / "shared.dat"))
        assert priv.kind is VmaKind.FILE_PRIVATE and not priv.shared
        assert shared.kind is VmaKind.FILE_SHARED and shared.shared
        assert priv.file_size == 16 * PAGE_SIZE and priv.inode == os.stat(tmp_path / "private.dat").st_ino
        pages = set()
        for r in image.page_runs(target.pid):
            pages.update(range(r.vaddr, r.vaddr + r.npages * PAGE_SIZE, PAGE_SIZE))
        in_priv = sorted((p - priv.start) // PAGE_SIZE for p in pages if priv.start <= p < priv.end)
        assert in_priv == list(range(0, 16, 2)), "the even (written) pages, not the clean odd ones"
        assert not any(shared.start <= p < shared.end for p in pages), "the file holds shared pages"
        _assert_pages_equal_memory(image, target.pid)
    os.kill(target.pid, signal.SIGCONT)


def test_thread_state_and_restart_fixup(spawn, ptckpt, tmp_path):
    target = spawn("threads", 100000)          # threads sleep 100 ms per step
    _stop(target)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == 0, res.stderr
    with ImageReader(tmp_path / "img") as image:
        proc = image.process(target.pid)
        assert len(proc.threads) == 5
        assert [t.tid for t in proc.threads][0] == target.pid
        assert sorted(t.tid for t in proc.threads[1:]) == sorted(target.tids)
        for t in proc.threads:
            assert t.rseq_addr and t.rseq_len >= 32, "glibc registers rseq per thread"
            assert t.robust_list and t.clear_child_tid or t.tid == target.pid
            regs = dict(zip(GP_REG_NAMES, t.regs))
            assert regs["fs_base"], "TLS base captured"
        sleepers = [t for t in proc.threads if t.tid != target.pid]
        # glibc's nanosleep is clock_nanosleep (230): frozen inside, it shows -ERESTART_RESTARTBLOCK.
        assert all(t.syscall_nr == 230 and t.restart is Restart.RESTART_BLOCK for t in sleepers), \
            [(t.tid, t.syscall_nr, t.restart) for t in sleepers]
        assert proc.task.comm == "threads" and proc.task.tids[0] == target.pid
        assert proc.mm.brk >= proc.mm.start_brk > 0 and proc.mm.arg_end > proc.mm.arg_start
        assert proc.creds.uids[0] == os.getuid()
        assert any(r.resource == 7 for r in proc.rlimits)          # RLIMIT_NOFILE
    os.kill(target.pid, signal.SIGCONT)
    target.wait_progress()
    target.assert_ok()


def test_fds_are_recorded_with_kind_flags_and_position(spawn, ptckpt, tmp_path):
    target = spawn("blocked_read", stdin="pipe")
    target.send_line("hello")
    target.wait_for_line("GOT hello")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == 0, res.stderr
    with ImageReader(tmp_path / "img") as image:
        fds = {f.fd: f for f in image.process(target.pid).fds}
    assert fds[0].kind is FdKind.PIPE
    assert fds[1].kind is FdKind.REGULAR and fds[1].path == str(target.stdout_path)
    assert fds[1].flags & os.O_APPEND and fds[1].pos == os.path.getsize(target.stdout_path)
    target.send_line("after")
    target.wait_for_line("GOT after")
    target.assert_ok()


def test_unrestorable_fd_kind_is_refused_by_name(spawn, ptckpt, tmp_path):
    """A userfaultfd (a kind the table of kinds refuses): one line naming the fd, its kind and
    why, no image, the target running on."""
    script = idle_script(tmp_path, "uffd.py", "import ctypes, os, time\n"
                                               "uffd = ctypes.CDLL(None).syscall(323, os.O_CLOEXEC)\n"
                                               "assert uffd >= 0\n")
    target = spawn(str(script), out=False)
    links = {int(n): os.readlink(f"/proc/{target.pid}/fd/{n}") for n in os.listdir(f"/proc/{target.pid}/fd")}
    fd = next(n for n, link in links.items() if link == "anon_inode:[userfaultfd]")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == ExitCode.UNSUPPORTED_RESOURCE, res.stderr
    assert f"fd {fd} -> anon_inode:[userfaultfd] (userfaultfd: a userfaultfd: " in res.stderr
    assert not (tmp_path / "img").exists() and pid_alive(target.pid)


# --- the target goes on, or is gone --------------------------------------------------

def test_leave_running_keeps_counting_without_eintr(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    before = target.read_counter()
    for i in range(3):
        res = ptckpt("dump", target.pid, "-D", tmp_path / f"img{i}")
        assert res.returncode == 0, res.stderr
    target.wait_progress()
    assert target.read_counter() > before
    sleeper = spawn("sleeper", 3)        # long enough to be dumped on a loaded machine
    res = ptckpt("dump", sleeper.pid, "-D", tmp_path / "sleep-img")
    assert res.returncode == 0, res.stderr
    assert sleeper.wait_exit(10) == 0
    sleeper.assert_ok()
    target.assert_ok()


def test_blocked_read_continues_after_dump(spawn, ptckpt, tmp_path):
    target = spawn("blocked_read", stdin="pipe")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == 0, res.stderr
    with ImageReader(tmp_path / "img") as image:
        t = image.process(target.pid).threads[0]
        assert t.syscall_nr == 0 and t.restart is Restart.REEXECUTE     # read(), -ERESTARTSYS
    target.send_line("line-after-dump")
    target.wait_for_line("GOT line-after-dump")
    target.assert_ok()


def test_kill_removes_the_target_after_the_image_is_complete(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill")
    assert res.returncode == 0, res.stderr
    assert target.wait_exit(10) == -signal.SIGKILL
    with ImageReader(tmp_path / "img") as image:
        assert image.process(target.pid).task.pid == target.pid


def test_image_permissions_and_show(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == 0, res.stderr
    img = tmp_path / "img"
    assert stat.S_IMODE(img.stat().st_mode) == 0o700
    for f in img.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".img")], "no temp dir left"
    shown = ptckpt("show", img)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert str(target.pid) in json.dumps(data)
    summary = ptckpt("show", img, "--summary")
    assert summary.returncode == 0 and "counter" in summary.stdout


def test_default_directory_is_ckpt_pid(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    res = ptckpt("dump", target.pid, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / f"ckpt-{target.pid}" / "inventory.img").exists()


# --- bad input ------------------------------------------------------------------------

def _assert_unharmed(target, before: int) -> None:
    target.wait_progress()
    assert target.read_counter() > before
    target.assert_ok()
    assert _state(target.pid) in "RS"


def _assert_one_line_error(res, code: int, *words: str) -> None:
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_no_such_pid(ptckpt, tmp_path):
    pid = 1
    while os.path.exists(f"/proc/{pid}"):
        pid = (pid * 7919 + 13) % 30000 + 2
    res = ptckpt("dump", pid, "-D", tmp_path / "img")
    _assert_one_line_error(res, ExitCode.NO_SUCH_PROCESS, str(pid))
    assert not (tmp_path / "img").exists()


def test_kernel_thread(ptckpt, tmp_path):
    res = ptckpt("dump", 2, "-D", tmp_path / "img")       # kthreadd
    _assert_one_line_error(res, ExitCode.KERNEL_THREAD, "kernel thread")
    assert not (tmp_path / "img").exists()


def _drop_cap_sys_ptrace() -> None:
    """preexec_fn: root, but without CAP_SYS_PTRACE (dropped from the bounding set before exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(24, ctypes.c_ulong(19), 0, 0, 0) != 0:      # PR_CAPBSET_DROP, CAP_SYS_PTRACE
        os._exit(99)


def test_pid_we_may_not_trace(spawn, ptckpt_cmd, tmp_path):
    """A non-dumpable target and a tracer without CAP_SYS_PTRACE: ptrace is refused (EPERM)."""
    script = tmp_path / "secret.py"
    script.write_text("import ctypes, os, sys, time\n"
                      "ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)        # PR_SET_DUMPABLE 0\n"
                      "out = open(sys.argv[1], 'w')\n"
                      "n = 0\n"
                      "print('READY', os.getpid(), flush=True)\n"
                      "while True:\n"
                      "    n += 1; out.seek(0); out.write(f'{n:20d}\\n'); out.flush(); time.sleep(0.01)\n")
    target = spawn(str(script))
    before = target.read_counter()
    proc = subprocess.run(ptckpt_cmd + ["dump", str(target.pid), "-D", str(tmp_path / "img")],
                          capture_output=True, text=True, timeout=60, preexec_fn=_drop_cap_sys_ptrace)
    assert proc.returncode == ExitCode.ACCESS_DENIED, proc.stderr
    assert "not permitted" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "img").exists()
    _assert_unharmed(target, before)


def test_pid_already_traced(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    before = target.read_counter()
    session = Session()
    session.freeze_process(target.pid)
    try:
        res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    finally:
        session.resume_all()
    _assert_one_line_error(res, ExitCode.ALREADY_TRACED, "already traced", str(os.getpid()))
    assert not (tmp_path / "img").exists()
    _assert_unharmed(target, before)


@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_the_shell_that_runs_ptckpt_is_refused_as_its_own_ancestor(ptckpt_cmd, tmp_path, shell):
    """`ptckpt dump $$` from a shell: the shell's tree holds ptckpt itself.  The refusal names
    the shell, not ptckpt's own pid (which the freeze met first), and the way out."""
    cmd = " ".join(ptckpt_cmd) + f" dump $$ -D {tmp_path / 'img'}; echo rc=$?"
    proc = subprocess.run([shell, "-c", cmd], capture_output=True, text=True, timeout=60)
    shell_pid = re.search(r"process (\d+) \((\w+)\)", proc.stderr)
    assert f"rc={ExitCode.ACCESS_DENIED}" in proc.stdout, (proc.stdout, proc.stderr)
    assert shell_pid and shell_pid.group(2) == shell, proc.stderr
    assert "ptckpt's own ancestor (the shell that runs it)" in proc.stderr
    assert "run ptckpt from another shell" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "img").exists()


def test_in_a_pid_namespace_dump_1_names_process_1(ptckpt_cmd, tmp_path):
    """Issue 37: in a pid namespace whose init is the shell, `ptckpt dump 1` answered about
    "process 2" (ptckpt's own pid there); the refusal names process 1, the shell.  The
    namespace ends with its shell (unshare --fork waits for it)."""
    import shlex
    import shutil
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    inner = shlex.join(ptckpt_cmd + ["dump", "1", "-D", str(tmp_path / "img")]) + "; echo rc=$?"
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", inner],
                          capture_output=True, text=True, timeout=60, check=False)
    assert f"rc={ExitCode.ACCESS_DENIED}" in proc.stdout, (proc.stdout, proc.stderr)
    assert "process 1 (bash) is ptckpt's own ancestor" in proc.stderr, proc.stderr
    assert "process 2" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "img").exists()


def test_an_ancestor_further_up_is_refused_by_name(ptckpt_cmd, tmp_path):
    proc = subprocess.run(["bash", "-c", f"sh -c '{' '.join(ptckpt_cmd)} dump '$$' -D {tmp_path / 'img'}'; true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert re.search(r"process \d+ \(bash\) is ptckpt's own ancestor \(ptckpt runs 2 levels below it\)",
                     proc.stderr), proc.stderr


def test_a_file_given_as_the_directory_is_named_a_file(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    path = tmp_path / "notes"
    path.write_text("keep me")
    res = ptckpt("dump", target.pid, "-D", path)
    _assert_one_line_error(res, ExitCode.DESTINATION_EXISTS, f"{path} is a file, not a directory")
    assert "not empty" not in res.stderr and path.read_text() == "keep me"
    res = ptckpt("restore", "-D", path)
    _assert_one_line_error(res, ExitCode.NOT_AN_IMAGE, f"{path}: a file, not a directory")
    assert "no such directory" not in res.stderr


@pytest.mark.parametrize("fd", [1, 7])
def test_a_pipe_its_starter_still_holds_is_refused_with_how_to_start_it_without(ptckpt, tmp_path, fd):
    """A CI runner (here: this test) hands a pipe to the program it starts, and keeps its end:
    the holder is an ancestor of the tree, which "dump the common ancestor" cannot mean;
    the way out is to start the program without that fd.  fd 1 of a child (not the root)."""
    r, w = os.pipe()
    script = ("import os, subprocess, sys, time\n"
              f"if {fd} > 2: os.dup2({w}, {fd})\n"
              f"child = subprocess.Popen(['sleep', '600'], stdout={w} if {fd} == 1 else None, pass_fds=({fd},))\n"
              f"os.close({w})\n"
              "print('READY', child.pid, flush=True)\n"
              "time.sleep(600)\n")
    line = ""
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            pass_fds=(w,), text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        res = ptckpt("dump", proc.pid, "-D", tmp_path / "img")
        _assert_one_line_error(res, ExitCode.UNSUPPORTED_RESOURCE, "is connected outside the tree",
                               f"fd {fd} (pipe:[", f"pid {os.getpid()} fd ", f"{os.getpid()} is an ancestor of the tree",
                               "setsid PROG </dev/null >LOG 2>&1" + (f" {fd}>&-" if fd > 2 else "`"))
        assert "dump the common ancestor" not in res.stderr
    finally:
        with contextlib.suppress(ValueError, IndexError, ProcessLookupError):
            os.kill(int(line.split()[1]), signal.SIGKILL)
        proc.kill()
        proc.wait()
        os.close(r)
        os.close(w)


def test_directory_exists_and_not_empty(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    before = target.read_counter()
    img = tmp_path / "img"
    img.mkdir()
    (img / "something").write_text("keep me")
    res = ptckpt("dump", target.pid, "-D", img)
    _assert_one_line_error(res, ExitCode.DESTINATION_EXISTS, str(img))
    assert (img / "something").read_text() == "keep me"
    _assert_unharmed(target, before)


def test_disk_full_leaves_no_image_and_target_running(spawn, ptckpt, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        target = spawn("bigheap", 8)
        res = ptckpt("dump", target.pid, "-D", mnt / "img")
        _assert_one_line_error(res, ExitCode.IO_ERROR, "cannot write image")
        assert list(mnt.iterdir()) == [], "no half-written image"
        target.signal(signal.SIGUSR1)
        target.wait_for_line("VERIFY 1 OK")
        target.assert_ok()
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_target_exits_mid_dump(spawn, tmp_path, monkeypatch):
    """The library API raises TargetVanished and leaves no image when the target dies while frozen."""
    target = spawn("counter")
    real = memory.dump_vmas

    def dying(pid, *args):
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        return real(pid, *args)

    monkeypatch.setattr(memory, "dump_vmas", dying)
    with pytest.raises(Exception) as err:
        library_dump(target.pid, str(tmp_path / "img"))
    assert isinstance(err.value, TargetVanished), repr(err.value)
    assert f"process {target.pid} exited" in str(err.value)
    assert not (tmp_path / "img").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".img")]


def test_threads_come_and_go_during_the_freeze(spawn, ptckpt, tmp_path):
    """Threads created and exiting all the time: the dump re-scans until the set is stable."""
    script = tmp_path / "churn.py"
    script.write_text("import os, sys, threading, time\n"
                      "out = open(sys.argv[1], 'w')\n"
                      "n = 0\n"
                      "print('READY', os.getpid(), flush=True)\n"
                      "while True:\n"
                      "    ts = [threading.Thread(target=time.sleep, args=(0.002,)) for _ in range(4)]\n"
                      "    [t.start() for t in ts]; [t.join() for t in ts]\n"
                      "    n += 1; out.seek(0); out.write(f'{n:20d}\\n'); out.flush()\n")
    target = spawn(str(script))
    for i in range(5):
        res = ptckpt("dump", target.pid, "-D", tmp_path / f"img{i}")
        assert res.returncode == 0, res.stderr
        with ImageReader(tmp_path / f"img{i}") as image:
            proc = image.process(target.pid)
            assert proc.threads[0].tid == target.pid
            assert set(proc.task.tids) == {t.tid for t in proc.threads}
    target.wait_progress()
    target.assert_ok()

"""`ptckpt restore` round trips on real processes: they go on exactly where they were.

Each test dumps a fixture with --kill, waits until its pid is free, restores it
and checks, through the fixture's own reports, that its state survived.  The
restored process keeps the fixture's pid, so the `spawn` handle still refers
to it and the teardown kills it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader, ImageWriter
from ptckpt.formats.model import PAGE_SIZE

from conftest import IDLE_TAIL, idle_script, kill_pids, pid_alive, reap_orphans, wait_pid_free, wait_until


def _dump_kill(ptckpt, target, image: Path, members=()) -> None:
    """dump --kill, then wait until the target's pid (and each of `members`) is free."""
    res = ptckpt("dump", target.pid, "-D", image, "--kill")
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    for pid in {target.pid, *members}:
        wait_pid_free(pid)


def _restore(ptckpt, image: Path, *extra) -> int:
    res = ptckpt("restore", "-D", image, "--detach", *extra)
    assert res.returncode == 0, res.stderr
    return int(res.stdout.strip().splitlines()[-1])


def _image_digest(image: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(image.iterdir()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
        h.update(str(f.stat().st_mtime_ns).encode())
    return h.hexdigest()


# --- round trips ----------------------------------------------------------------------

def test_counter_goes_on_from_its_value(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    target.wait_progress()
    _dump_kill(ptckpt, target, tmp_path / "img")
    at_dump = target.read_counter()
    assert at_dump > 0
    pid = _restore(ptckpt, tmp_path / "img")
    assert pid == target.pid
    wait_until(lambda: target.read_counter() > at_dump + 20, 10, message="counter goes on")
    value = target.read_counter()
    assert value > at_dump, "goes on from its value, not from 0"
    target.assert_ok()


def test_four_threads_all_go_on_with_their_tids(spawn, ptckpt, tmp_path):
    target = spawn("threads")
    tids = list(target.tids)
    _dump_kill(ptckpt, target, tmp_path / "img")
    at_dump = target.read_counters()
    pid = _restore(ptckpt, tmp_path / "img")
    assert pid == target.pid
    wait_until(lambda: all(a > b for a, b in zip(target.read_counters(), at_dump)), 10,
               message="every thread counts on")
    assert sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")) == sorted([pid] + tids)
    for tid in tids:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            assert f.read().strip() == "threads"
    target.assert_ok()                     # the fixture checks gettid() itself


def test_sleeping_process_wakes_at_the_right_time(spawn, ptckpt, tmp_path):
    secs = 2.0
    target = spawn("sleeper", secs)
    time.sleep(0.5)
    _dump_kill(ptckpt, target, tmp_path / "img")
    restored_at = time.monotonic()
    _restore(ptckpt, tmp_path / "img")
    restored = time.monotonic()
    target.wait_for_line(r"WOKE 1", timeout=10)
    # It sleeps what it had left at the freeze (at most secs - 0.5; the time it was dumped
    # does not count, as under CRIU), counted from when it runs again: not a whole sleep.
    woke_after = time.monotonic() - restored
    assert woke_after <= secs - 0.5 + 0.7, (f"slept {woke_after:.2f} s after the restore "
                                           f"(which took {restored - restored_at:.2f} s)")
    m = re.search(r"ELAPSED 1 ([0-9.]+)", target.stdout_text())
    assert m and float(m.group(1)) >= secs, "no early wake"
    assert target.wait_exit(10) == 0
    target.assert_ok()


def test_a_sleep_dumped_twice_goes_on_after_restore(spawn, ptckpt, tmp_path):
    """The first (leave-running) dump leaves the sleep going on in restart_syscall; the
    second dump finds it there, and the restore must not re-run restart_syscall (EINTR)."""
    sleep_dumped_twice(spawn, ptckpt, tmp_path, "sleeper", "219")


def sleep_dumped_twice(spawn, ptckpt, tmp_path, program: str, restart_syscall: str) -> None:
    """`program` (a sleeper) dumped leaving it running, then again once /proc/PID/syscall
    shows it in restart_syscall (`restart_syscall`, that ABI's number), killed, restored: it
    wakes and exits 0."""
    target = spawn(program, 3.0)
    time.sleep(0.3)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "first")
    assert res.returncode == 0, res.stderr
    wait_until(lambda: open(f"/proc/{target.pid}/syscall").read().split()[0] == restart_syscall, timeout=5)
    _dump_kill(ptckpt, target, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    target.wait_for_line(r"WOKE 1", timeout=10)
    assert target.wait_exit(10) == 0
    target.assert_ok()


def test_blocked_read_completes_without_eintr(spawn, ptckpt_cmd, ptckpt, tmp_path):
    target = spawn("blocked_read", stdin="pipe")
    target.send_line("before")
    target.wait_for_line("GOT before")
    _dump_kill(ptckpt, target, tmp_path / "img")
    # The restored process's stdin is ptckpt restore's own (a shell job): a pipe of ours.
    r, w = os.pipe()
    proc = subprocess.run(ptckpt_cmd + ["restore", "-D", str(tmp_path / "img"), "--detach"],
                          stdin=r, capture_output=True, text=True, timeout=60)
    os.close(r)
    assert proc.returncode == 0, proc.stderr
    try:
        time.sleep(0.3)
        os.write(w, b"after-restore\n")
        target.wait_for_line("GOT after-restore")
        assert target.alive()
        target.assert_ok()
    finally:
        os.close(w)


DUP_STDIN = r'''
import os, sys, time
os.dup2(0, 7)                       # fd 7 shares fd 0's description (top's fd 3, bash's fd 255)
os.dup2(1, 9)
print("READY", os.getpid(), flush=True)
buf = b""
while b"\n" not in buf:
    buf += os.read(7, 100)          # read through the dup
os.write(9, b"GOT " + buf)
time.sleep(600)
'''


def test_a_dup_of_stdio_above_2_gets_the_stdio_of_the_restore(spawn, ptckpt_cmd, ptckpt, tmp_path):
    """Fds sharing the root's stdio description are handed ptckpt restore's own fd 0-2
    (the handoff once dup'ed ptckpt's fd of the highest such number: fd 7 here)."""
    (tmp_path / "dup.py").write_text(DUP_STDIN)
    target = spawn(str(tmp_path / "dup.py"), out=False, stdin="pipe")
    _dump_kill(ptckpt, target, tmp_path / "img")
    r, w = os.pipe()
    proc = subprocess.run(ptckpt_cmd + ["restore", "-D", str(tmp_path / "img"), "--detach",
                                        "--file-policy", "ignore"],
                          stdin=r, capture_output=True, text=True, timeout=60)
    os.close(r)
    try:
        assert proc.returncode == 0, proc.stderr
        links = {n: os.readlink(f"/proc/{target.pid}/fd/{n}") for n in (0, 1, 7, 9)}
        assert links[7] == links[0] == f"pipe:[{os.fstat(w).st_ino}]", links
        assert links[9] == links[1] == str(target.stdout_path), links     # a file: by path
        os.write(w, b"typed-after\n")
        wait_until(lambda: "GOT typed-after" in target.stdout_text(), 10)
    finally:
        os.close(w)
        kill_pids([target.pid])


def test_stdin_fifo_is_reopened_by_path(spawn, ptckpt, tmp_path):
    target = spawn("blocked_read", stdin="fifo")
    target.send_line("before")
    target.wait_for_line("GOT before")
    _dump_kill(ptckpt, target, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    target.send_line("through-the-fifo")
    target.wait_for_line("GOT through-the-fifo")
    assert os.readlink(f"/proc/{target.pid}/fd/0") == str(target.fifo_path)
    target.assert_ok()


@pytest.mark.parametrize("mib", [48, 160])
def test_heap_contents_intact(spawn, ptckpt, tmp_path, mib):
    """48 MiB: the new process reads all its pages itself; 160 MiB: ptckpt copies half of
    them meanwhile (resources/fillbeside), and the heap's checksum is the same."""
    target = spawn("bigheap", mib)
    _dump_kill(ptckpt, target, tmp_path / "img")
    res = ptckpt("-v", "restore", "-D", tmp_path / "img", "--detach")
    assert res.returncode == 0, res.stderr
    beside = re.search(r"fill: ([\d.]+) MiB of \d+'s pages copied by ptckpt beside", res.stderr)
    if mib < 64:
        assert beside is None, res.stderr
    else:
        assert beside and mib / 4 <= float(beside.group(1)) <= mib * 3 / 4, res.stderr
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK")
    target.assert_ok()


def test_file_mappings_intact(spawn, ptckpt, tmp_path):
    target = spawn("filemap", tmp_path / "private.dat", tmp_path / "shared.dat", 16)
    _dump_kill(ptckpt, target, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK")
    target.assert_ok()


@pytest.mark.parametrize("mode", ["ymm", "zmm"])
def test_avx_registers_intact(spawn, ptckpt, tmp_path, cpu_has, mode):
    if mode == "zmm" and not cpu_has("avx512f"):
        pytest.skip("no AVX-512 on this CPU")
    # The fixture spins flat out with its patterns loaded in the vector registers;
    # the dump must catch it inside the spin for the check to mean something.
    for attempt in range(5):
        target = spawn("avx", mode, 1 << 22, 0)
        target.wait_progress()
        image = tmp_path / f"img{attempt}"
        _dump_kill(ptckpt, target, image)
        with ImageReader(image) as reader:
            t = reader.process(target.pid).threads[0]
        rip = t.regs[16]
        if target.symbols["spin_begin"] <= rip < target.symbols["spin_end"]:
            break
    else:
        pytest.fail("never froze the fixture inside its spin loop")
    assert t.xfeatures & 0b100, "the image holds AVX state"
    if mode == "zmm":
        assert t.xfeatures & 0xE0 == 0xE0, "and AVX-512 state"
    before = target.read_counter()
    _restore(ptckpt, image)
    wait_until(lambda: target.read_counter() > before + 3, 20, message="AVX checks go on")
    assert target.out_text().startswith("AVX OK")
    target.assert_ok()


def test_python3_loop_goes_on(spawn, ptckpt, tmp_path):
    target = spawn("counter.py")
    target.wait_progress()
    _dump_kill(ptckpt, target, tmp_path / "img")
    at_dump = target.read_counter()
    _restore(ptckpt, tmp_path / "img")
    wait_until(lambda: target.read_counter() > at_dump + 10, 10, message="python counts on")
    target.assert_ok()


def test_getpid_and_restored_task_state(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    with open(f"/proc/{target.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    exe = os.readlink(f"/proc/{target.pid}/exe")
    _dump_kill(ptckpt, target, tmp_path / "img")
    pid = _restore(ptckpt, tmp_path / "img")
    assert pid == target.pid
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert f.read() == cmdline, "arg area restored (PR_SET_MM_MAP)"
    assert os.readlink(f"/proc/{pid}/exe") == exe
    assert os.readlink(f"/proc/{pid}/cwd") == str(tmp_path)
    assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null", "character devices reopened by path"
    with open(f"/proc/{pid}/comm") as f:
        assert f.read().strip() == "counter"
    maps = open(f"/proc/{pid}/maps").read()
    assert "[heap]" in maps or "[stack]" in maps
    assert "ptckpt-restorer" not in maps
    target.wait_progress()
    target.assert_ok()


def test_ten_restores_of_one_image(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    target.wait_progress()
    image = tmp_path / "img"
    _dump_kill(ptckpt, target, image)
    at_dump = target.read_counter()
    digest = _image_digest(image)
    for i in range(10):
        # each run writes the counter's state file: a change the image must be told to accept
        _restore(ptckpt, image, "--file-policy", f"{target.out_path}=ignore")
        wait_until(lambda: target.read_counter() > at_dump, 10, message=f"restore {i} counts")
        target.assert_ok()
        target.kill()
        with open(target.out_path, "r+") as f:        # start each run from a clean state file
            f.write(f"{0:020d}\n")
    assert _image_digest(image) == digest, "restores never modify the image"


def test_five_concurrent_pidns_restores(spawn, ptckpt_cmd, ptckpt, tmp_path):
    target = spawn("counter")
    image = tmp_path / "img"
    _dump_kill(ptckpt, target, image)
    # Output through files: the restored processes keep ptckpt's stdio (a shell job).
    outs = [(tmp_path / f"r{i}.out", tmp_path / f"r{i}.err") for i in range(5)]
    procs = []
    for out, err in outs:
        with open(out, "w") as o, open(err, "w") as e:
            procs.append(subprocess.Popen(ptckpt_cmd + ["restore", "-D", str(image), "--pidns",
                                                        "--detach", "--file-policy", "ignore"],
                                          stdout=o, stderr=e))
    outer = []
    try:
        for p, (out, err) in zip(procs, outs):
            p.wait(timeout=60)
            assert p.returncode == 0, err.read_text()
            outer.append(int(out.read_text().strip().splitlines()[-1]))
        assert len(set(outer)) == 5
        for pid in outer:
            assert pid_alive(pid)
            with open(f"/proc/{pid}/status") as f:
                nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
            assert [int(x) for x in nspid] == [pid, target.pid], "each sees its original getpid()"
        at_dump = target.read_counter()
        wait_until(lambda: target.read_counter() > at_dump + 20, 10, message="they count on")
        assert all(pid_alive(pid) for pid in outer), "all five run"
        assert not target.out_text().startswith("FAIL"), target.out_text()
    finally:
        # Killing a namespace's init ends the whole namespace.
        inits = []
        for pid in outer:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    inits.append(int(f.read().rsplit(")", 1)[1].split()[1]))
            except OSError:
                pass
        kill_pids(outer + inits)
        time.sleep(0.2)
        reap_orphans()


def test_restore_waits_and_passes_the_exit_status(spawn, ptckpt, tmp_path):
    target = spawn("sleeper", 1.0)
    _dump_kill(ptckpt, target, tmp_path / "img")
    res = ptckpt("restore", "-D", tmp_path / "img", timeout=30)
    assert res.returncode == 0, res.stderr
    target.wait_for_line("WOKE 1")
    # A restored process killed by a signal: ptckpt exits 128+signal, like a shell.
    target2 = spawn("counter")
    _dump_kill(ptckpt, target2, tmp_path / "img2")
    # SIGTERM once it runs again (its output file moves), not at a guessed moment
    out = target2.out_path
    killer = subprocess.Popen(["sh", "-c", f"a=$(cat {out}); while [ \"$(cat {out})\" = \"$a\" ]; do "
                                           f"sleep 0.05; done; kill -TERM {target2.pid}"])
    res = ptckpt("restore", "-D", tmp_path / "img2", timeout=30)
    killer.wait()
    assert res.returncode == 128 + signal.SIGTERM, res.stderr


# --- bad input: refused before any process is created -------------------------------------

def _one_line(res, code: int, *words: str) -> None:
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = [line for line in res.stderr.strip().splitlines() if not line.startswith("ptckpt: warning")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture
def counter_image(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    image = tmp_path / "img"
    _dump_kill(ptckpt, target, image)
    return target, image


def test_truncated_image(counter_image, ptckpt, tmp_path):
    target, image = counter_image
    core = image / f"core-{target.pid}.img"
    data = core.read_bytes()
    core.write_bytes(data[: len(data) // 2])
    _one_line(ptckpt("restore", "-D", image), ExitCode.CORRUPT_IMAGE, "truncated")
    assert not pid_alive(target.pid)


def test_corrupt_image(counter_image, ptckpt):
    target, image = counter_image
    pages = image / f"pages-{target.pid}.img"
    with open(pages, "r+b") as f:
        f.seek(PAGE_SIZE + 100)
        b = f.read(1)
        f.seek(PAGE_SIZE + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    _one_line(ptckpt("restore", "-D", image), ExitCode.CORRUPT_IMAGE, "checksum")
    assert not pid_alive(target.pid)


def test_corrupt_page_block_is_named_and_the_half_built_process_killed(spawn, ptckpt, tmp_path):
    """The page data is checked block by block (1 MiB, xxh3) while the new process reads it
    into its memory: a byte changed in the sixth block is named by its range in the file,
    and the process that was being built is killed before it ran, so its pid is free."""
    target = spawn("bigheap", 8)
    image = tmp_path / "img"
    _dump_kill(ptckpt, target, image)
    pages = image / f"pages-{target.pid}.img"
    block = 1 << 20
    where = PAGE_SIZE + 5 * block + 12345
    with open(pages, "r+b") as f:
        f.seek(where)
        b = f.read(1)
        f.seek(where)
        f.write(bytes([b[0] ^ 0x01]))
    res = ptckpt("-v", "restore", "-D", image)
    assert res.returncode == ExitCode.CORRUPT_IMAGE, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    first = PAGE_SIZE + 5 * block
    for w in (str(pages), f"bytes {first}-{first + block - 1}", "(block 5)", "killed before they ran"):
        assert w in last, last
    phases = [line for line in res.stderr.splitlines() if line.startswith("ptckpt: ")]
    assert any("fix up" in line for line in phases), res.stderr      # checked beside the restore
    assert not pid_alive(target.pid)


def test_newer_format_version(counter_image, ptckpt):
    target, image = counter_image
    inv = image / "inventory.img"
    data = bytearray(inv.read_bytes())
    data[6:8] = (99).to_bytes(2, "little")             # header: magic, kind u16, version u16
    inv.write_bytes(bytes(data))
    _one_line(ptckpt("restore", "-D", image), ExitCode.UNSUPPORTED_VERSION, "99", "newer")
    assert not pid_alive(target.pid)


def _rewrite_image(src: Path, dst: Path, change, pages_change=None) -> None:
    """A copy of image `src` (not incremental) whose process records went through
    change(ProcessImage), and each run of their saved pages through pages_change(vaddr,
    bytes) -> bytes (same length; None leaves the run out)."""
    with ImageReader(src) as image:
        with ImageWriter(dst) as out:
            for pid in image.pids:
                out.write_process(change(image.process(pid)))
                pages = out.pages_writer(pid)
                for run in image.page_runs(pid):
                    data = image.read_pages(pid, run)
                    if pages_change is not None:
                        data = pages_change(run.vaddr, data)
                        if data is None:
                            continue
                        assert len(data) == run.npages * PAGE_SIZE
                    offset = pages.write(data)
                    pages.add_run(run.vaddr, run.npages, offset)
                pages.close()
            out.write_inventory(image.inventory, image.shared_records())


def test_cpu_without_an_xstate_feature(counter_image, ptckpt, tmp_path):
    from ptckpt.restore import Host
    target, image = counter_image
    # A feature this CPU lacks: AMX tiles (17, 18) on most, else APX (19), or bit 63.
    xcr0 = Host.probe().xcr0
    absent = next(1 << b for b in (17, 18, 19, 63) if not xcr0 & 1 << b)
    _rewrite_image(image, tmp_path / "amx", lambda p: dataclasses.replace(
        p, threads=tuple(dataclasses.replace(t, xfeatures=t.xfeatures | absent) for t in p.threads)))
    from ptckpt.cpuid import xfeature_names
    _one_line(ptckpt("restore", "-D", tmp_path / "amx"), ExitCode.INCOMPATIBLE, "xsave features",
              *xfeature_names(absent))           # by name: "AMX tile data", "APX" ...
    assert not pid_alive(target.pid)


def _older_image_with_a_smaller_vdso(src: Path, dst: Path) -> None:
    """A copy of image `src` as an older ptckpt (which saved no vdso bytes) would have made it
    on a kernel whose [vdso] is a page smaller (a bigger one would overlap its neighbour)."""
    from ptckpt.formats.model import VmaKind
    with ImageReader(src) as image:
        vdso = next(v for v in image.process(image.inventory.root_pid).vmas if v.kind is VmaKind.VDSO)
    assert vdso.end - vdso.start > PAGE_SIZE

    def smaller_vdso(p):
        return dataclasses.replace(p, vmas=tuple(dataclasses.replace(v, end=v.end - PAGE_SIZE)
                                                 if v.kind is VmaKind.VDSO else v for v in p.vmas))

    def without_vdso_bytes(vaddr: int, data: bytes):
        if vaddr < vdso.end and vaddr + len(data) > vdso.start:
            assert (vaddr, vaddr + len(data)) == (vdso.start, vdso.end), "the vdso's pages: a run of their own"
            return None
        return data

    _rewrite_image(src, dst, smaller_vdso, without_vdso_bytes)


def test_vdso_of_another_size_is_refused_without_its_bytes(counter_image, ptckpt, tmp_path):
    """An image that holds no copy of its vdso (an older ptckpt's) can have no vdso proxy:
    a vdso of another size than this kernel's is refused (tests/test_vdso.py: with the copy)."""
    target, image = counter_image
    _older_image_with_a_smaller_vdso(image, tmp_path / "vdso")
    _one_line(ptckpt("restore", "-D", tmp_path / "vdso"), ExitCode.INCOMPATIBLE, "[vdso]", "bytes", "no copy")
    assert not pid_alive(target.pid)


def test_pidfile(counter_image, ptckpt, tmp_path):
    target, image = counter_image
    pidfile = tmp_path / "restored.pid"
    res = ptckpt("restore", "-D", image, "--detach", "--pidfile", pidfile)
    assert res.returncode == 0, res.stderr
    assert int(pidfile.read_text()) == target.pid == int(res.stdout.split()[-1])
    target.wait_progress()
    target.assert_ok()


def test_mapped_file_missing_or_changed(spawn, ptckpt, tmp_path):
    target = spawn("filemap", tmp_path / "private.dat", tmp_path / "shared.dat", 16)
    image = tmp_path / "img"
    _dump_kill(ptckpt, target, image)
    private = tmp_path / "private.dat"
    saved = private.read_bytes()
    st = private.stat()
    os.utime(private, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _one_line(ptckpt("restore", "-D", image), ExitCode.INCOMPATIBLE, str(private), "mtime")
    with open(private, "ab") as f:
        f.write(b"x" * 10)
    _one_line(ptckpt("restore", "-D", image), ExitCode.INCOMPATIBLE, "size")
    replacement = tmp_path / "replacement.dat"       # made while the old inode still exists
    replacement.write_bytes(saved)
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(replacement, private)
    _one_line(ptckpt("restore", "-D", image), ExitCode.INCOMPATIBLE, "inode")
    private.unlink()
    _one_line(ptckpt("restore", "-D", image), ExitCode.INCOMPATIBLE, f"{private}: missing")
    assert not pid_alive(target.pid)


def test_busy_pid(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")       # leave running: pid busy
    assert res.returncode == 0, res.stderr
    _one_line(ptckpt("restore", "-D", tmp_path / "img"), ExitCode.PID_BUSY,
              f"pid {target.pid}", "counter", "--pidns")
    target.wait_progress()
    target.assert_ok()


def test_deleted_file_above_the_ghost_limit_is_refused_at_dump(spawn, ptckpt, tmp_path):
    big = tmp_path / "big.bin"
    script = idle_script(tmp_path, "ghost.py",
                         f"import os, time\nf = open({str(big)!r}, 'wb')\nf.write(bytes([1]) * ((64 << 20) + 1))\n"
                         f"f.flush()\nos.unlink({str(big)!r})\n")
    target = spawn(str(script), out=False)
    _one_line(ptckpt("dump", target.pid, "-D", tmp_path / "img"), ExitCode.UNSUPPORTED_RESOURCE,
              f"{big} (deleted)", "67108865 bytes of data", "64 MiB at most")
    assert pid_alive(target.pid) and not (tmp_path / "img").exists()
    target.kill()
    # a sparse one counts by its data: 1 GiB of holes and a byte
    script = idle_script(tmp_path, "sparse.py",
                         f"import os, time\nf = open({str(big)!r}, 'wb')\nf.seek(1 << 30)\nf.write(b'x')\n"
                         f"f.flush()\nos.unlink({str(big)!r})\n")
    target = spawn(str(script), out=False)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img2")
    assert res.returncode == 0, res.stderr
    with ImageReader(tmp_path / "img2") as image:
        (ghost,) = image.ghost_files
    assert ghost.size == (1 << 30) + 1 and len(ghost.data) <= 4096


def test_failure_halfway_kills_the_half_built_process(spawn, ptckpt, tmp_path):
    """An injected syscall fails (openat of a path that became a directory): the message names
    the step, the syscall, its errno and arguments, and nothing is left running."""
    data = tmp_path / "data.txt"
    script = idle_script(tmp_path, "holder.py", f"import os, time\nf = open({str(data)!r}, 'w')\n")
    target = spawn(str(script), out=False)
    _dump_kill(ptckpt, target, tmp_path / "img")
    data.unlink()
    data.mkdir()
    res = ptckpt("restore", "-D", tmp_path / "img", "--file-policy", "ignore")
    _one_line(res, ExitCode.REMOTE_SYSCALL, "killed", "openat", "EISDIR", str(data))
    time.sleep(0.2)
    reap_orphans()
    assert not pid_alive(target.pid)


_STATE_PROGRAM = r'''
import ctypes, os, resource, signal, sys, time
out = sys.argv[1]
def log(text):
    with open(out, "a") as f:
        f.write(text + "\n")
def on_usr1(sig, frame):
    log("USR1 delivered")
def on_usr2(sig, frame):
    log("USR2 handler")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGUSR2, on_usr2)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
os.umask(0o027)
os.nice(5)
with open("/proc/self/oom_score_adj", "w") as f:
    f.write("123")
resource.setrlimit(resource.RLIMIT_NOFILE, (512, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
ctypes.CDLL(None).prctl(15, b"statekeeper", 0, 0, 0)
print("READY", os.getpid(), flush=True)
while True:
    time.sleep(0.02)
'''


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def test_signals_and_task_state_survive(spawn, ptckpt, tmp_path):
    """Dispositions, the blocked mask, a pending signal, umask, nice, oom_score_adj, rlimits, comm."""
    script = tmp_path / "state.py"
    script.write_text(_STATE_PROGRAM)
    target = spawn(str(script))
    os.kill(target.pid, signal.SIGUSR1)               # blocked: stays pending
    wait_until(lambda: int(_status(target.pid)["ShdPnd"], 16) & (1 << (signal.SIGUSR1 - 1)), 5)
    before = _status(target.pid)
    limits = open(f"/proc/{target.pid}/limits").read()
    _dump_kill(ptckpt, target, tmp_path / "img")
    pid = _restore(ptckpt, tmp_path / "img")
    after = _status(pid)
    for key in ("SigBlk", "SigIgn", "SigCgt", "Umask", "Name"):
        assert after[key] == before[key], key
    assert int(after["ShdPnd"], 16) & (1 << (signal.SIGUSR1 - 1)), "the pending SIGUSR1 is queued again"
    assert open(f"/proc/{pid}/oom_score_adj").read().strip() == "123"
    assert os.getpriority(os.PRIO_PROCESS, pid) == 5
    assert open(f"/proc/{pid}/limits").read() == limits
    assert not target.out_path.exists(), "no handler ran during the restore"
    os.kill(pid, signal.SIGUSR2)                      # its handler unblocks SIGUSR1
    target.wait_for_line("USR2 handler", where="out")
    target.wait_for_line("USR1 delivered", where="out")
    assert target.alive()


_THREAD_SIGNAL_PROGRAM = r'''
import os, signal, sys, threading, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})    # every thread blocks it
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
def worker():
    print("TID", threading.get_native_id(), flush=True)
    while not os.path.exists(sys.argv[1] + ".go"):
        time.sleep(0.02)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})   # its own pending one arrives
threading.Thread(target=worker, daemon=True).start()
time.sleep(0.2)
print("READY", os.getpid(), flush=True)
while not got:
    time.sleep(0.02)
open(sys.argv[1], "w").write("USR1 delivered\n")
while True:
    time.sleep(0.05)
'''


def test_a_signal_pending_on_one_thread_is_queued_by_that_thread(spawn, ptckpt, tmp_path):
    """tgkill leaves SIGUSR1 pending on a second thread (si_code SI_TKILL): the kernel lets
    only that thread queue such a siginfo again, so the restore injects it there."""
    script = tmp_path / "threadsig.py"
    script.write_text(_THREAD_SIGNAL_PROGRAM)
    target = spawn(str(script))
    tid = int(next(l for l in target.preamble if l.startswith("TID")).split()[1])
    assert ctypes.CDLL(None).syscall(234, target.pid, tid, signal.SIGUSR1) == 0     # tgkill
    bit = 1 << (signal.SIGUSR1 - 1)
    wait_until(lambda: int(_status_of(target.pid, tid)["SigPnd"], 16) & bit, 5)
    _dump_kill(ptckpt, target, tmp_path / "img")
    pid = _restore(ptckpt, tmp_path / "img")
    assert int(_status_of(pid, tid)["SigPnd"], 16) & bit, "pending on that thread again"
    assert not int(_status(pid)["ShdPnd"], 16) & bit
    open(f"{target.out_path}.go", "w").close()
    target.wait_for_line("USR1 delivered", where="out")


def _status_of(pid: int, tid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def test_shared_anonymous_memory_and_python_heap(spawn, ptckpt, tmp_path):
    """python3's mmap(-1, n) is MAP_SHARED|MAP_ANONYMOUS: its contents come back, still shared-anon."""
    script = tmp_path / "shm.py"
    script.write_text("import hashlib, mmap, os, signal, sys, time\n"
                      "m = mmap.mmap(-1, 8 << 20)\n"
                      "for i in range(0, len(m), 4096): m[i:i+8] = i.to_bytes(8, 'little')\n"
                      "want = hashlib.sha256(m).hexdigest()\n"
                      "data = [str(i) * 3 for i in range(200000)]\n"
                      "def check(sig, frame):\n"
                      "    ok = hashlib.sha256(m).hexdigest() == want and data[12345] == '12345' * 3\n"
                      "    open(sys.argv[1], 'a').write('OK\\n' if ok else 'FAIL shm\\n')\n"
                      "signal.signal(signal.SIGUSR1, check)\n" + IDLE_TAIL)
    target = spawn(str(script))
    _dump_kill(ptckpt, target, tmp_path / "img")
    pid = _restore(ptckpt, tmp_path / "img")
    maps = open(f"/proc/{pid}/maps").read()
    assert "/dev/zero (deleted)" in maps, "the region is shared anonymous memory again"
    target.signal(signal.SIGUSR1)
    target.wait_for_line("^OK$", where="out")
    target.assert_ok()


def test_credentials_of_an_unprivileged_process(ptckpt, tmp_path):
    """A process running as nobody comes back as nobody (uids, gids, groups set last, from inside)."""
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system python3 that an unprivileged user can run")
    work = Path(tempfile.mkdtemp(prefix="ptckpt-creds-", dir="/tmp"))
    os.chmod(work, 0o777)
    out = work / "count"
    code = ("import os, sys, time\n"
            "n = 0\n"
            "f = open(sys.argv[1], 'w')\n"
            "print('READY', os.getpid(), flush=True)\n"
            "while True:\n"
            "    n += 1; f.seek(0); f.write(f'{n:20d}\\n'); f.flush(); time.sleep(0.01)\n")

    def drop():
        os.setgroups([65534])
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)

    proc = subprocess.Popen([python, "-c", code, str(out)], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work, preexec_fn=drop, start_new_session=True)
    restored = 0
    try:
        assert proc.stdout.readline().startswith(b"READY")
        proc.stdout.close()
        wait_until(lambda: out.exists() and out.read_text().strip(), 5)
        res = ptckpt("dump", proc.pid, "-D", tmp_path / "img", "--kill")
        assert res.returncode == 0, res.stderr
        proc.wait(10)
        wait_pid_free(proc.pid)
        restored = _restore(ptckpt, tmp_path / "img")
        status = _status(restored)
        assert status["Uid"].split() == ["65534"] * 4
        assert status["Gid"].split() == ["65534"] * 4
        assert status["Groups"].split() == ["65534"]
        at = int(out.read_text())
        wait_until(lambda: int(out.read_text() or 0) > at, 5, message="counts on as nobody")
    finally:
        kill_pids([proc.pid] + ([restored] if restored else []))
        time.sleep(0.1)
        reap_orphans()
        shutil.rmtree(work, ignore_errors=True)


def test_check_image_says_beforehand_whether_this_host_can_restore_it(counter_image, ptckpt, tmp_path):
    """`ptckpt check --image DIR` runs restore's plan without building anything: an image
    this host can restore is exit 0; one made for a vdso of another size, or using xsave
    features this CPU lacks, is restore's exit 15 with the reason; nothing is restored."""
    from ptckpt.restore import Host
    target, image = counter_image
    res = ptckpt("check", "--image", image, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    found = {f["what"]: f for f in json.loads(res.stdout)}
    assert all(f["ok"] for f in found.values()) and str(target.pid) in found["pids"]["detail"], found

    absent = next(1 << b for b in (17, 18, 19, 63) if not Host.probe().xcr0 & 1 << b)
    _older_image_with_a_smaller_vdso(image, tmp_path / "vdso")
    _rewrite_image(image, tmp_path / "xs", lambda p: dataclasses.replace(
        p, threads=tuple(dataclasses.replace(t, xfeatures=t.xfeatures | absent) for t in p.threads)))
    for bad, words in ((tmp_path / "vdso", "[vdso]"), (tmp_path / "xs", "xsave features")):
        res = ptckpt("check", "--image", bad)
        assert res.returncode == ExitCode.INCOMPATIBLE, res.stdout + res.stderr
        assert any(line.startswith("this host") and "NO" in line and words in line
                   for line in res.stdout.splitlines()), res.stdout
        assert len(res.stderr.strip().splitlines()) == 1 and words in res.stderr
    assert not pid_alive(target.pid), "nothing was restored"
    res = ptckpt("check", "--image", tmp_path / "nothing-here")
    assert res.returncode == ExitCode.NOT_AN_IMAGE, res.stdout + res.stderr


POKE = '''
import os, signal
from ptckpt.plugins import Plugin

class Poke(Plugin):
    name = "poke"
    recorded = False

    def restored(self, proc, ctx):
        os.kill(proc.pid, signal.SIGUSR1)     # pending before the process runs again
'''


def test_a_signal_pending_when_a_restored_pause_resumes_makes_it_return(spawn, ptckpt, tmp_path):
    """A thread frozen in pause() whose handler runs as soon as it resumes gets EINTR from
    pause(), as the kernel gives it (-ERESTARTNOHAND after a handler), instead of waiting in
    pause() again: the restored thread goes on through the kernel's own restart logic."""
    target = spawn("pauser")
    image = tmp_path / "img"
    _dump_kill(ptckpt, target, image)
    plugin = tmp_path / "poke.py"
    plugin.write_text(POKE)
    pid = _restore(ptckpt, image, "--plugin", f"{plugin}:Poke")
    try:
        wait_until(lambda: "WOKE 1" in target.out_text(), 10, message=lambda: f"a wake-up: {target.out_text()!r}")
        os.kill(pid, signal.SIGUSR1)                          # and it goes on as before
        wait_until(lambda: "WOKE 2" in target.out_text(), 10, message=lambda: f"a wake-up: {target.out_text()!r}")
    finally:
        kill_pids([pid])

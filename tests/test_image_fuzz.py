"""Bad images are refused before anything runs, by every reader alike, with one line.

First the defects measured in issue 19, each as the image that showed it (checksums right,
contents wrong); then a seeded campaign of mutants of real images (tests/imagefuzz.py):
every mutant is refused cleanly or, where its change is one no check can see (an edited
field that still makes sense), restored; never a traceback, an internal error, a second
line, a hang or a process left behind.  bench/image_fuzz runs ten thousand.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import struct
import zlib
from pathlib import Path

import pytest

import imagefuzz
from conftest import descendants, kill_pids, reap_orphans
from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader, ImageWriter, core_name
from ptckpt.formats.model import PageRun, VmaKind

FUZZ_MUTANTS = int(os.environ.get("PTCKPT_FUZZ_MUTANTS", "80"))


@pytest.fixture
def counter_image(killed_counter):
    return killed_counter[1]


def _edited(src: Path, dst: Path, *, proc=None, inventory=None, runs=None, member=None) -> Path:
    """A copy of `src` with its records changed and every checksum right: `proc` changes the
    root's process record, `member` (pid, record) any process's."""
    with ImageReader(src) as image:
        with ImageWriter(dst) as out:
            for pid in image.inventory.pids:
                p = image.process(pid)
                if proc and pid == image.inventory.root_pid:
                    p = proc(p)
                out.write_process(member(pid, p) if member else p)
                pages = out.pages_writer(pid)
                written = [PageRun(run.vaddr, run.npages, pages.write(image.read_pages(pid, run)))
                           for run in image.page_runs(pid)]
                for run in (runs(written) if runs and pid == image.inventory.root_pid else written):
                    pages.add_run(run.vaddr, run.npages, run.offset)
                pages.close()
            out.write_inventory(inventory(image.inventory) if inventory else image.inventory)
    return dst


def _refused_alike(ptckpt, image: Path, *words: str, code: int = ExitCode.CORRUPT_IMAGE) -> None:
    for argv in (["show", image], ["restore", "-D", image, "--detach"], ["diff", image, image]):
        res = ptckpt(*argv)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == code and len(lines) == 1 and "Traceback" not in res.stderr, \
            (argv[0], res.returncode, res.stderr)
        for word in words:
            assert word in lines[0], (argv[0], lines[0])


def test_a_page_run_outside_the_mappings(counter_image, ptckpt, tmp_path):
    """Was: BufferError from memory.fill_pages (its finally hid the real error)."""
    bad = _edited(counter_image, tmp_path / "bad", runs=lambda rs: [
        dataclasses.replace(r, vaddr=0x7FFFFFF00000) if i == 0 else r for i, r in enumerate(rs)])
    _refused_alike(ptckpt, bad, "page run", "outside the mappings")


def test_page_runs_that_overlap(counter_image, ptckpt, tmp_path):
    bad = _edited(counter_image, tmp_path / "bad", runs=lambda rs: rs + [
        PageRun(rs[0].vaddr, 1, rs[0].offset)])
    _refused_alike(ptckpt, bad, "overlaps")


def test_a_root_pid_that_is_not_in_the_image(counter_image, ptckpt, tmp_path):
    """Was: KeyError in restore."""
    bad = _edited(counter_image, tmp_path / "bad", inventory=lambda inv: dataclasses.replace(
        inv, root_pid=inv.root_pid + 1))
    _refused_alike(ptckpt, bad, "root pid")


def test_a_mapping_kind_no_version_knows(counter_image, ptckpt, tmp_path):
    """Was: AttributeError while the error message was built (an unknown kind parses to an int)."""
    bad = _edited(counter_image, tmp_path / "bad", proc=lambda p: dataclasses.replace(
        p, vmas=(dataclasses.replace(p.vmas[0], kind=77),) + p.vmas[1:]))
    _refused_alike(ptckpt, bad, "77", "VmaKind")


@pytest.mark.parametrize("change, words", [
    (lambda p: dataclasses.replace(p, vmas=(dataclasses.replace(p.vmas[0], end=p.vmas[1].end),) + p.vmas[1:]),
     ("overlaps",)),
    (lambda p: dataclasses.replace(p, vmas=(dataclasses.replace(p.vmas[0], start=p.vmas[0].start + 1),)
                                   + p.vmas[1:]), ("page-aligned",)),
    (lambda p: dataclasses.replace(p, threads=p.threads + p.threads[:1]), ("thread", "twice")),
    (lambda p: dataclasses.replace(p, threads=(dataclasses.replace(p.threads[0], xstate=p.threads[0].xstate[:64]),)),
     ("xstate of 64 bytes",)),
    (lambda p: dataclasses.replace(p, sigactions=(dataclasses.replace(p.sigactions[0], signo=4114),)
                                   + p.sigactions[1:]), ("SIGACTION", "4114")),
    (lambda p: dataclasses.replace(p, fds=p.fds + p.fds[:1]), ("fd", "twice")),
    # from the 10,000-mutant run of bench/image_fuzz: IndexError, OverflowError (os.makedev)
    (lambda p: dataclasses.replace(p, task=dataclasses.replace(p.task, cgroups="4memory/x\n")),
     ("cgroup line", "ID:CONTROLLERS:/PATH")),
    (lambda p: dataclasses.replace(p, task=dataclasses.replace(p.task, cgroup_dirs="d\tname=x\t/a\t9\t0\n")),
     ("cgroup directory line", "MODE UID GID")),
    (lambda p: dataclasses.replace(p, vmas=(dataclasses.replace(p.vmas[0], dev_major=1 << 20),) + p.vmas[1:]),
     ("device", "out of range")),
    (lambda p: dataclasses.replace(p, task=dataclasses.replace(p.task, state="T", stop_signal=9)),
     ("TASK stop signal 9",)),
    (lambda p: dataclasses.replace(p, mm=dataclasses.replace(p.mm, membarrier=1 << 3)),
     ("membarrier", "0x8", "unknown bits")),
], ids=["overlapping-mappings", "unaligned-mapping", "thread-twice", "short-xstate", "signal-4114",
        "fd-twice", "cgroup-line", "cgroup-dir-line", "device-number", "stop-signal-9", "membarrier-bits"])
def test_records_that_contradict_each_other(counter_image, ptckpt, tmp_path, change, words):
    _refused_alike(ptckpt, _edited(counter_image, tmp_path / "bad", proc=change), *words)


def _patch_file(path: Path, at: int, data: bytes, *, fix_crc: bool) -> None:
    raw = bytearray(path.read_bytes())
    raw[at:at + len(data)] = data
    if fix_crc:
        struct.pack_into("<I", raw, 16, zlib.crc32(bytes(raw[24:])))
    path.write_bytes(raw)


def test_a_member_whose_parent_is_not_in_the_image(spawn, ptckpt, tmp_path):
    """Was (bench/image_fuzz, 10,000 mutants): KeyError in restore."""
    target = spawn("forkserver")
    image = tmp_path / "img"
    res = ptckpt("dump", target.pid, "-D", image, "--kill")
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    bad = _edited(image, tmp_path / "bad", member=lambda pid, p: p if pid == target.pid else dataclasses.replace(
        p, task=dataclasses.replace(p.task, ppid=4242)))
    _refused_alike(ptckpt, bad, "its parent 4242 is not in the image")


def test_a_name_that_is_not_utf8_restores(counter_image, ptckpt, tmp_path):
    """Was (bench/image_fuzz): UnicodeEncodeError when the name went back (comm is bytes to
    the kernel; the image keeps undecodable ones as surrogates)."""
    odd = _edited(counter_image, tmp_path / "odd", proc=lambda p: dataclasses.replace(
        p, task=dataclasses.replace(p.task, comm="cou\udcffnter"),
        threads=tuple(dataclasses.replace(t, comm="cou\udcffnter") for t in p.threads)))
    res = ptckpt("restore", "-D", odd, "--detach", "--file-policy", "ignore")
    assert res.returncode == 0, res.stderr
    pid = int(res.stdout.split()[-1])
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            assert f.read() == b"cou\xffnter\n"
    finally:
        kill_pids([pid])
        reap_orphans()


def test_reserved_bytes_are_checked(counter_image, ptckpt, tmp_path):
    """Bytes 20-23 of every file header and 2-3 of every entry header are reserved: zero."""
    pid = int(next(counter_image.glob("core-*.img")).name[5:-4])
    header = tmp_path / "header"
    shutil.copytree(counter_image, header)
    _patch_file(header / core_name(pid), 20, b"\x01", fix_crc=False)
    _refused_alike(ptckpt, header, "reserved")
    entry = tmp_path / "entry"
    shutil.copytree(counter_image, entry)
    _patch_file(entry / core_name(pid), 24 + 2, b"\x01", fix_crc=True)
    _refused_alike(ptckpt, entry, "reserved")


def test_an_entry_of_unknown_kind_is_not_skipped(counter_image, ptckpt, tmp_path):
    """An unknown kind in an image of a version this reader knows is damage; skipping it
    would lose what it held."""
    pid = int(next(counter_image.glob("core-*.img")).name[5:-4])
    bad = tmp_path / "bad"
    shutil.copytree(counter_image, bad)
    _patch_file(bad / core_name(pid), 24, struct.pack("<H", 999), fix_crc=True)
    _refused_alike(ptckpt, bad, "unknown kind 999")


def test_the_parser_s_words_make_one_line(counter_image, ptckpt, tmp_path):
    """Was: construct's 'stream read less than specified amount' as a second line."""
    bad = tmp_path / "bad"
    shutil.copytree(counter_image, bad)
    raw = bytearray((bad / "inventory.img").read_bytes())
    at = raw.index(b"x86_64")
    raw[at - 1] = 0x7F                              # the string's length prefix: longer than the entry
    struct.pack_into("<I", raw, 16, zlib.crc32(bytes(raw[24:])))
    (bad / "inventory.img").write_bytes(raw)
    _refused_alike(ptckpt, bad, "field arch", "bytes")


def test_a_failed_restore_of_a_tree_in_its_own_pid_namespace_ends(spawn, ptckpt, tmp_path):
    """Was: a hang.  A child's mapped file missing at restore: the half-built tree is killed,
    and the namespace's init waited for ever for a zombie that ptckpt traced and did not reap."""
    target = spawn("forkserver")
    image = tmp_path / "img"
    res = ptckpt("dump", target.pid, "-D", image, "--kill")
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    with ImageReader(image) as reader:
        last = reader.pids[-1]
    # the child's own copy of the dynamic loader's path, renamed to a file that does not exist
    core = image / core_name(last)
    raw = bytearray(core.read_bytes())
    at = raw.index(b"/ld-linux-x86-64.so.2")
    raw[at + 1:at + 3] = b"zz"
    struct.pack_into("<I", raw, 16, zlib.crc32(bytes(raw[24:])))
    core.write_bytes(raw)
    res = ptckpt("restore", "-D", image, "--pidns", "--detach", "--file-policy", "warn", timeout=60)
    assert res.returncode == ExitCode.REMOTE_SYSCALL and "ENOENT" in res.stderr, res.stderr
    assert not descendants(os.getpid()) or all(
        os.path.basename(os.readlink(f"/proc/{p}/exe")) != "forkserver" for p in descendants(os.getpid())
        if os.path.exists(f"/proc/{p}/exe"))


def test_mutants_of_real_images_are_refused_cleanly_or_restored(spawn, ptckpt, tmp_path):
    images = []
    for name in ("counter", "threads", "forkserver"):
        target = spawn(name)
        image = tmp_path / f"img-{name}"
        res = ptckpt("dump", target.pid, "-D", image, "--kill")
        assert res.returncode == 0, res.stderr
        target.wait_exit(10)
        images.append(image)
    counts: collections.Counter = collections.Counter()
    bad = []

    def seen(i, mutant, outcomes):
        for command, outcome in outcomes.items():
            counts[(mutant.kind, command, outcome.verdict)] += 1
            if outcome.verdict == "BAD":
                bad.append(f"#{i} {mutant.kind} {mutant.what}: {command} {outcome.why}: "
                           f"{outcome.stderr.strip()[-300:]}")

    work = tmp_path / "fuzz"
    work.mkdir()
    imagefuzz.campaign(images, FUZZ_MUTANTS, seed=19, work=work, on_result=seen, jobs=2)
    print("\nmutants by kind, command and outcome:")
    for key, n in sorted(counts.items()):
        print(f"  {' '.join(key):40} {n}")
    assert not bad, "\n".join(bad)
    assert sum(n for (k, c, v), n in counts.items() if v == "refused") > FUZZ_MUTANTS / 2


def test_a_path_with_a_newline_is_one_line_in_the_refusal(counter_image, ptckpt, tmp_path):
    """Was (bench/image_fuzz): a mapped file's path with a newline in it made a refusal of
    several lines."""
    bad = _edited(counter_image, tmp_path / "bad", proc=lambda p: dataclasses.replace(p, vmas=tuple(
        dataclasses.replace(v, path=v.path + "\nsecond line") if v.kind is VmaKind.FILE_PRIVATE else v
        for v in p.vmas)))
    res = ptckpt("restore", "-D", bad, "--detach", "--file-policy", "warn")
    lines = [ln for ln in res.stderr.strip().splitlines() if not ln.startswith("ptckpt: warning")]
    assert res.returncode not in (0, 1) and len(lines) == 1 and "\\nsecond line" in lines[0], res.stderr


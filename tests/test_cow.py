"""Memory a parent and its forked child still share copy-on-write is saved once and shared
again after a restore: memory use stays the same, and a write in one is still not seen by
the other (ptckpt.resources.memory: shared_with_parent, inherited mappings)."""

from __future__ import annotations

import os
import signal


from ptckpt.formats.image import ImageReader
from ptckpt import procfs
from ptckpt.resources import memory

from test_restore import _dump_kill, _restore
from conftest import kill_pids, reap_orphans, wait_until

FAMILY = r"""
import mmap, os, signal, sys, time
MB = 1 << 20
buf = mmap.mmap(-1, 32 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, 32 * MB, 4096):
    buf[i:i + 8] = (i // 4096).to_bytes(8, "little")      # every page written before the fork
def check(who):
    bad = [i for i in range(0, 32 * MB, 4096) if int.from_bytes(buf[i:i + 8], "little") != i // 4096]
    with open(sys.argv[1] + "." + who + ".tmp", "w") as f:
        f.write(f"{len(bad)} {buf[0]}")
    os.replace(sys.argv[1] + "." + who + ".tmp", sys.argv[1] + "." + who)
child = os.fork()
if child == 0:
    def on_usr1(*a):
        buf[0] = 0x7f                                      # a write of its own, after the restore
        check("child")
    signal.signal(signal.SIGUSR1, on_usr1)
    while True: time.sleep(0.05)
signal.signal(signal.SIGUSR1, lambda *a: check("parent"))
time.sleep(0.2)
print("KID", child, flush=True)
print("READY", os.getpid(), flush=True)
while True: time.sleep(0.05)
"""


def _family(spawn, tmp_path, source: str):
    """(parent Target, child pid) of a family program (it prints KID before READY)."""
    script = tmp_path / "family.py"
    script.write_text(source)
    parent = spawn(str(script))
    return parent, int(next(l for l in parent.preamble if l.startswith("KID")).split()[1])


def _shared_kib(pid: int, ppid: int) -> int:
    return sum(e - s for runs in memory.shared_with_parent(pid, ppid).values() for s, e in runs) // 1024


def test_pages_shared_copy_on_write_stay_shared(spawn, ptckpt, tmp_path):
    parent, child = _family(spawn, tmp_path, FAMILY)
    members = [parent.pid, child]
    try:
        before = _shared_kib(child, parent.pid)
        assert before >= 32 * 1024
        _dump_kill(ptckpt, parent, tmp_path / "img", members)
        with ImageReader(tmp_path / "img") as image:
            inherited = sum(e - s for v in image.process(child).vmas for s, e in v.cow) // 1024
            saved = [sum(r.npages for r in image.page_runs(p)) * 4 for p in members]
        assert inherited >= 32 * 1024
        assert saved[1] < 8 * 1024, "the child's copy of the shared pages is not saved again"
        parent.adopt(_restore(ptckpt, tmp_path / "img"))
        assert _shared_kib(child, parent.pid) >= 32 * 1024, "shared again after the restore"
        os.kill(child, signal.SIGUSR1)
        wait_until(lambda: os.path.exists(f"{parent.out_path}.child"), 5)
        os.kill(parent.pid, signal.SIGUSR1)
        wait_until(lambda: os.path.exists(f"{parent.out_path}.parent"), 5)
        assert open(f"{parent.out_path}.child").read() == "1 127", "the child sees its own write"
        assert open(f"{parent.out_path}.parent").read() == "0 0", "the parent does not"
    finally:
        kill_pids(members)
        reap_orphans()


def test_a_dump_that_leaves_the_tree_running_leaves_its_pages_shared(spawn, ptckpt, tmp_path):
    """Reading a page through process_vm_readv pins it, and a pin of a page shared
    copy-on-write gives the pinned process a copy: the parent's shared pages are read
    through /proc/PID/mem instead, so the running tree's memory use does not grow."""
    parent, child = _family(spawn, tmp_path, FAMILY)
    try:
        assert _shared_kib(child, parent.pid) >= 32 * 1024
        res = ptckpt("dump", parent.pid, "-D", tmp_path / "img", "--leave-running")
        assert res.returncode == 0, res.stderr
        assert _shared_kib(child, parent.pid) >= 32 * 1024
        with ImageReader(tmp_path / "img") as image:
            assert sum(r.npages for r in image.page_runs(parent.pid)) * 4 >= 32 * 1024
    finally:
        kill_pids([parent.pid, child])
        reap_orphans()


# A Python tree: objects made before the fork, then each side allocates on its own, so the
# parent's heap and its newest anonymous mapping grow past the child's (the child's mappings
# are parts of the parent's, no longer equal to them).
PYTHON_FAMILY = r"""
import hashlib, os, signal, sys, time
data = [list(range(1000)) for _ in range(2000)]            # about 70 MiB of objects
blob = bytearray(40 << 20)
for i in range(0, len(blob), 4096):
    blob[i] = i // 4096 % 251
digest = hashlib.sha256(repr(data).encode() + bytes(blob)).hexdigest()
def check(who):
    ok = hashlib.sha256(repr(data).encode() + bytes(blob)).hexdigest() == digest
    with open(sys.argv[1] + "." + who + ".tmp", "w") as f:
        f.write("ok" if ok else "changed")
    os.replace(sys.argv[1] + "." + who + ".tmp", sys.argv[1] + "." + who)
child = os.fork()
if child == 0:
    mine = [str(i) * 10 for i in range(20000)]
    signal.signal(signal.SIGUSR1, lambda *a: check("child"))
    while True: time.sleep(0.05)
more = [dict(a=i) for i in range(100000)]
signal.signal(signal.SIGUSR1, lambda *a: check("parent"))
time.sleep(0.2)
print("KID", child, flush=True)
print("READY", os.getpid(), flush=True)
while True: time.sleep(0.05)
"""


def test_a_python_tree_whose_mappings_grew_after_the_fork_stays_shared(spawn, ptckpt, tmp_path):
    parent, child = _family(spawn, tmp_path, PYTHON_FAMILY)
    members = [parent.pid, child]
    try:
        parts = [(c.start, c.end) for c in procfs.read_maps(child) if not c.shared
                 and any(p.start <= c.start and c.end <= p.end and (p.start, p.end) != (c.start, c.end)
                         for p in procfs.read_maps(parent.pid) if p.path == c.path and not p.shared)]
        assert parts, "no mapping of the child is a part of a larger one of the parent's"
        before = _shared_kib(child, parent.pid)
        assert before >= 64 * 1024
        _dump_kill(ptckpt, parent, tmp_path / "img", members)
        with ImageReader(tmp_path / "img") as image:
            saved_child = sum(r.npages for r in image.page_runs(child)) * 4
        assert saved_child < before / 4, "the shared pages are saved once, in the parent's image"
        parent.adopt(_restore(ptckpt, tmp_path / "img"))
        after = _shared_kib(child, parent.pid)
        assert after >= before * 0.98, f"shared before {before} KiB, after the restore {after} KiB"
        for pid, who in ((child, "child"), (parent.pid, "parent")):
            os.kill(pid, signal.SIGUSR1)
            wait_until(lambda: os.path.exists(f"{parent.out_path}.{who}"), 10)
            assert open(f"{parent.out_path}.{who}").read() == "ok", who
    finally:
        kill_pids(members)
        reap_orphans()

"""AIO contexts (io_setup(2)): the ring, its head and tail, and the completions not yet reaped.

A context shows only as its ring, the "/[aio] (deleted)" mapping of
/proc/PID/maps, whose address is the context id the program holds.  The ring
is struct aio_ring (fs/aio.c) followed by `nr` struct io_event slots.

Dump half: :func:`dump_aio_rings_frozen` reads each ring's header and the
io_event slots from head to tail (completions the program has not reaped yet).

Restore half: :func:`restore_aio_rings_frozen`, inside the restored process
after its mappings are in place: io_setup with a request count that makes a
ring of the same size (the kernel doubles the count, rounds it up to at least
4 per possible CPU and fills whole pages, so (nr - 2) / 2 gives `nr` back on a
machine with as many CPUs or fewer), then the new context is brought to the
same head and tail: `head` writes to /dev/null submitted and reaped, then
`tail - head` more submitted and left unreaped, whose io_event slots get the
recorded completions.  Last, the ring is moved with mremap to the dumped
address, which becomes the context id again (the kernel follows the move).

Requests in flight (submitted, not completed) are not in the ring, and they
cannot be saved: :func:`check_in_flight_frozen` counts them and refuses the
dump if there is one.  No interface shows the count; the kernel's request
budget does.  A context starts with nr - 1 request slots; each submission takes
one, each completion holds it until the program reaps it.  The free slots sit
in a shared pool, taken and given back whole batches at a time (nr - 1 divided
by 4 per possible CPU), and in a cache per CPU.  So with the pool drained (it
then holds exactly (nr - 1) mod batch) and every CPU's cache emptied,
in flight = nr - 1 - that remainder - completions in the ring.  Draining is
done in the frozen process, pinned to each CPU in turn, with writes of nothing
to /dev/null, which complete at once; afterwards they are reaped and the
completions the program had not reaped are put back, the ring taken round to
the same head and tail (as at restore).  A CPU the thread may not run
on keeps its cache out of reach: the count is then an upper bound, and a
non-zero one is refused as "cannot tell".  A completion arriving while the tree
is frozen is seen too: :func:`check_rings_quiet` reads each tail again just
before the image is committed and refuses the dump if one moved.  A ring of
another size (a machine with more CPUs) fails the restore, by name.
"""

from __future__ import annotations

import errno as _errno
import os
import struct
from collections.abc import Sequence

from ..errors import PtckptError, RestoreFailed, UnsupportedResource
from ..formats.model import AioRing, Vma
from ..tracee import AddressSpace

AIO_RING_MAGIC = 0xA10A10A1
_HEADER = struct.Struct("<IIIIIIII")   # id nr head tail magic compat incompat header_length
EVENT_SIZE = 32                        # struct io_event: data obj res res2
_IOCB = struct.Struct("<QIIHhIQQqQII")   # struct iocb (aio_abi.h, little-endian): 64 bytes
IOCB_CMD_PWRITE = 1
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
O_WRONLY, O_CLOEXEC = 0o1, 0o2000000
AT_FDCWD = -100 & (2**64 - 1)
_BATCH = 32


def is_aio_ring(vma: Vma) -> bool:
    """The ring of an AIO context: "/[aio] (deleted)" in /proc/PID/maps."""
    return vma.path == "/[aio]" and vma.file_deleted


# --- dump half -----------------------------------------------------------------

def dump_aio_rings_frozen(pid: int, mem, vmas: Sequence[Vma]) -> list[AioRing]:
    """Each AIO ring of the frozen process `pid` (`mem`: its AddressSpace)."""
    out = []
    for v in vmas:
        if not is_aio_ring(v):
            continue
        where = f"AIO context {v.start:#x} (mapping {v.start:#x}-{v.end:#x})"
        try:
            _id, nr, head, tail, magic, _compat, _incompat, hlen = _HEADER.unpack(mem.read(v.start, _HEADER.size))
        except PtckptError as err:
            raise UnsupportedResource(pid, f"{where}: its ring cannot be read ({err})") from None
        if magic != AIO_RING_MAGIC or hlen != _HEADER.size or not nr or head >= nr or tail >= nr \
                or hlen + nr * EVENT_SIZE > v.end - v.start:
            raise UnsupportedResource(pid, f"{where}: a ring this version does not understand "
                                           f"(magic {magic:#x}, nr {nr}, head {head}, tail {tail})")
        slots = [(head + i) % nr for i in range((tail - head) % nr)]
        events = b"".join(mem.read(v.start + hlen + s * EVENT_SIZE, EVENT_SIZE) for s in slots)
        out.append(AioRing(start=v.start, end=v.end, nr=nr, head=head, tail=tail, events=events))
    return out


def check_in_flight_frozen(pid: int, remote, vmas: Sequence[Vma]) -> None:
    """Refuse the dump when an AIO context of the frozen process `pid` has requests in flight
    (see the module's notes); `remote` injects into one of its threads."""
    rings = [v for v in vmas if is_aio_ring(v)]
    if not rings:
        return
    tid = remote.task.tid
    cpus = _possible_cpus()
    allowed = os.sched_getaffinity(tid)
    with remote.scratch(b"/dev/null\0") as path:
        null = remote.checked("openat", AT_FDCWD, int(path), O_WRONLY | O_CLOEXEC, 0,
                              step="open /dev/null to count AIO requests in flight")
    try:
        for v in rings:
            where = f"AIO context {v.start:#x}"
            in_flight, unsure = _count_in_flight(remote, tid, v.start, null, cpus, where)
            if in_flight > 0 and unsure:
                raise UnsupportedResource(pid, f"{where}: cannot tell whether requests are in flight (CPUs "
                                               f"{unsure} are out of its reach, and their caches of request "
                                               f"slots with them); checkpoint when the program has reaped "
                                               f"its requests, with the process allowed on every CPU")
            if in_flight > 0:
                raise UnsupportedResource(pid, f"{where}: {in_flight} request(s) in flight (submitted, not "
                                               f"completed: a poll, or I/O not done yet), which a restore "
                                               f"cannot submit again; checkpoint when the program has reaped "
                                               f"its requests")
    finally:
        os.sched_setaffinity(tid, allowed)
        remote.checked("close", null, step="close /dev/null")


def _possible_cpus() -> list[int]:
    with open("/sys/devices/system/cpu/possible") as f:
        return _cpu_list(f.read())


def _cpu_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _count_in_flight(remote, tid: int, ctx: int, null: int, cpus: list[int], where: str) -> tuple[int, list[int]]:
    """(requests in flight in context `ctx`, the CPUs whose caches could not be drained).  The
    ring is as it was afterwards (its completions put back), whatever happens."""
    _id, nr, head, tail, *_rest = _HEADER.unpack(remote.mem.read(ctx, _HEADER.size))
    unreaped = (tail - head) % nr
    events = b"".join(remote.mem.read(ctx + _HEADER.size + (head + i) % nr * EVENT_SIZE, EVENT_SIZE)
                      for i in range(unreaped))
    batch = max(1, (nr - 1) // (len(cpus) * 4))
    taken, unsure = 0, []
    with remote.scratch(_BATCH * _IOCB.size + _BATCH * 8 + _BATCH * EVENT_SIZE) as buf:
        base = int(buf)
        pointers = base + _BATCH * _IOCB.size
        slots = pointers + _BATCH * 8
        remote.mem.write(base, b"".join(_IOCB.pack(0, 0, 0, IOCB_CMD_PWRITE, 0, null, base, 0, 0, 0, 0, 0)
                                        for _ in range(_BATCH))
                         + b"".join(struct.pack("<Q", base + i * _IOCB.size) for i in range(_BATCH)))
        try:
            for cpu in cpus:
                try:
                    os.sched_setaffinity(tid, {cpu})
                except OSError:
                    unsure.append(cpu)
                    continue
                while True:
                    done = remote.syscall("io_submit", ctx, min(_BATCH, nr), pointers)
                    if done == -_errno.EAGAIN:
                        break
                    if done < 0:
                        raise UnsupportedResource(remote.task.tgid, f"{where}: counting its requests in flight: "
                                                  f"io_submit failed ({_errno.errorcode.get(-done, -done)})")
                    taken += done
        finally:
            # the ring holds what the program had not reaped, then `taken` writes: reap all,
            # go round the ring to its head again (head and tail are the program's to read),
            # then make the program's completions again
            left = unreaped + taken
            while left:
                got = remote.checked("io_getevents", ctx, min(left, _BATCH), min(left, _BATCH), slots, 0,
                                     step=f"{where}: reap the writes that counted its requests")
                left -= got
            _complete(remote, ctx, null, (nr - (unreaped + taken) % nr) % nr, reap=True,
                      step=f"{where}: its ring back to its head")
            _unreaped_again(remote, ctx, nr, head, null, events, step=f"{where}: its completions, back")
    return (nr - 1) - (nr - 1) % batch - unreaped - taken, unsure


def check_rings_quiet(pid: int, rings: Sequence[AioRing]) -> None:
    """Refuse the dump when a ring's tail moved since it was read: a request completed while
    the process was frozen, so requests were in flight (the only trace of them a dump can see)."""
    if not rings:
        return
    with AddressSpace(pid) as mem:
        for ring in rings:
            tail = _HEADER.unpack(mem.read(ring.start, _HEADER.size))[3]
            if tail != ring.tail:
                done = (tail - ring.tail) % ring.nr
                raise UnsupportedResource(pid, f"AIO context {ring.start:#x}: {done} request(s) completed "
                                               f"while the process was frozen, so requests were in flight "
                                               f"(their completions would be lost); checkpoint when the "
                                               f"program has reaped its requests")


# --- restore half --------------------------------------------------------------

def restore_aio_rings_frozen(remote, rings: Sequence[AioRing]) -> None:
    """Make each context again at its address, with its head, tail and unreaped completions."""
    if not rings:
        return
    with remote.scratch(b"/dev/null\0") as path:
        null = remote.checked("openat", AT_FDCWD, int(path), O_WRONLY | O_CLOEXEC, 0, step="open /dev/null for AIO")
    try:
        for ring in rings:
            _restore_ring(remote, ring, null)
    finally:
        remote.checked("close", null, step="close /dev/null for AIO")


def _restore_ring(remote, ring: AioRing, null: int) -> None:
    step = f"AIO context {ring.start:#x}"
    size = ring.end - ring.start
    with remote.scratch(8) as ctxp:
        remote.checked("io_setup", (ring.nr - 2) // 2, int(ctxp), step=step)
        ctx = struct.unpack("<Q", remote.mem.read(int(ctxp), 8))[0]
    _id, nr, head, tail, *_rest = _HEADER.unpack(remote.mem.read(ctx, _HEADER.size))
    if nr != ring.nr or (head, tail) != (0, 0):
        remote.syscall("io_destroy", ctx)
        raise RestoreFailed(f"{step}: io_setup made a ring of {nr} events here, the image's has {ring.nr} "
                            f"(a machine with more CPUs?)")
    _complete(remote, ctx, null, ring.head, reap=True, step=step)
    _unreaped_again(remote, ctx, ring.nr, ring.head, null, ring.events, step=step)
    _id, nr, head, tail, *_rest = _HEADER.unpack(remote.mem.read(ctx, _HEADER.size))
    if (head, tail) != (ring.head, ring.tail):
        raise RestoreFailed(f"{step}: its ring reached head {head} tail {tail}, not {ring.head} {ring.tail}")
    if ctx != ring.start:
        remote.checked("mremap", ctx, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, ring.start,
                       step=f"{step}: move the ring from {ctx:#x}")


def _unreaped_again(remote, ctx: int, nr: int, head: int, null: int, events: bytes, *, step: str) -> None:
    """The completions `events` (io_event slots, in order) waiting in the ring again, from its
    `head` on (its tail at head): as many writes submitted and left unreaped, their slots
    then given those events."""
    count = len(events) // EVENT_SIZE
    _complete(remote, ctx, null, count, reap=False, step=step)
    for i in range(count):
        remote.mem.write(ctx + _HEADER.size + (head + i) % nr * EVENT_SIZE, events[i * EVENT_SIZE:(i + 1) * EVENT_SIZE])


def _complete(remote, ctx: int, null: int, count: int, *, reap: bool, step: str) -> None:
    """Submit `count` writes of nothing to /dev/null (they complete at once), reaping them
    (the ring's head moves on with its tail) or not (they stay as completions)."""
    while count:
        n = min(count, _BATCH)
        with remote.scratch(n * _IOCB.size + n * 8 + n * EVENT_SIZE) as buf:
            base = int(buf)
            iocbs = b"".join(_IOCB.pack(0, 0, 0, IOCB_CMD_PWRITE, 0, null, base, 0, 0, 0, 0, 0) for _ in range(n))
            pointers = b"".join(struct.pack("<Q", base + i * _IOCB.size) for i in range(n))
            remote.mem.write(base, iocbs + pointers)
            done = remote.checked("io_submit", ctx, n, base + len(iocbs), step=f"{step}: advance its ring")
            if done != n:
                raise RestoreFailed(f"{step}: {done} of {n} requests submitted while advancing its ring")
            if reap:
                events = base + len(iocbs) + len(pointers)
                got = remote.checked("io_getevents", ctx, n, n, events, 0, step=f"{step}: advance its ring")
                if got != n:
                    raise RestoreFailed(f"{step}: {got} of {n} completions reaped while advancing its ring")
        count -= n

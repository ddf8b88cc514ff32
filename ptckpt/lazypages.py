"""Lazy restore (``restore --lazy``): the processes run before their anonymous memory is
in; a page server puts it in, first what they touch, then all the rest.

* While a process is rebuilt (frozen), its private anonymous mappings with saved pages
  (readable and writable, not mlocked, not shared copy-on-write with a parent) are
  registered with a userfaultfd made in it by injection (MISSING mode, with the fork,
  remap, remove and unmap events).  ptckpt keeps the only fd (pidfd_getfd) and leaves
  those pages out of the eager fill.  A thread of the restore answers the faults that
  ptckpt's own work on the frozen processes causes.
* Before the tree runs, the server moves into a process of its own (its own session,
  stdio on /dev/null, a log file in :func:`log_dir`).  A fault gets the 64 KiB window of
  pages around it (UFFDIO_COPY from the page file, mapped read-only); between faults the
  rest is copied 1 MiB at a time.  A fault where the image had no page gets a zero page.
  A fork of a restored process hands the server the child's userfaultfd: the child lacks
  what its parent lacked, and is served the same way; mremap moves, and madvise and
  munmap drop, what is still to come.
* Page data a dump sent to a page server (``restore --lazy --page-server``) is fetched
  from there a block (1 MiB) at a time, the first time a page of it is needed, over the
  restore's authenticated connection, which the server process inherits.  A page server
  that goes away (or answers nothing for 30 s) ends the tree as a corrupt block does,
  and the log says so.
* Page data is checked as it is first served: each block against the image's xxh3 sum
  (formats/pagesums.py).  A block that differs ends the tree (SIGKILL), and the log names
  the file and bytes.  (An eager restore checks before anything runs; a lazy one cannot.)
* Once every page is in, the server and its watchdog close their copies: the
  registrations go with the last one, and the processes depend on nothing any more.
* If the server dies first (killed, out of memory), the last close of a userfaultfd
  would unregister the mappings and the missing pages would read as zeros: silent
  loss.  So a watchdog process holds a copy of every userfaultfd (a fault then waits
  instead of reading zeros) and, when the server is gone without saying it finished,
  kills (SIGKILL) every process that may lack pages (the restored ones, their
  descendants, and processes of their sessions with a registered mapping) and says so
  in the log.  Killing both the server and the watchdog is not covered.
"""

from __future__ import annotations

import array
import ctypes
import errno
import logging
import os
import select
import signal
import socket
import struct
import threading
import time
from bisect import bisect_right
from collections.abc import Sequence

import xxhash

from . import procfs, testhooks
from .errors import CorruptImage, PtckptError, TransferError
from .formats import compression, pagesums
from .formats.model import PageRun, Vma, VmaKind
from .tracee import pidfd_getfd

log = logging.getLogger("ptckpt.lazy")

PAGE = 4096
WINDOW = 64 * 1024            # bytes served around a fault
CHUNK = 1 << 20               # bytes per background copy
UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F
UFFDIO_REGISTER = 0xC020AA00
UFFDIO_COPY = 0xC028AA03
UFFDIO_ZEROPAGE = 0xC020AA04
UFFDIO_WAKE = 0x8010AA02
UFFDIO_REGISTER_MODE_MISSING = 1
UFFD_FEATURE_EVENT_FORK = 1 << 1
UFFD_FEATURE_EVENT_REMAP = 1 << 2
UFFD_FEATURE_EVENT_REMOVE = 1 << 3
UFFD_FEATURE_EVENT_UNMAP = 1 << 6
FEATURES = UFFD_FEATURE_EVENT_FORK | UFFD_FEATURE_EVENT_REMAP | UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_UNMAP
EV_PAGEFAULT, EV_FORK, EV_REMAP, EV_REMOVE, EV_UNMAP = 0x12, 0x13, 0x14, 0x15, 0x16
MSG = 32                      # sizeof(struct uffd_msg)
O_CLOEXEC, O_NONBLOCK = 0o2000000, 0o4000
PROT_READ, PROT_WRITE = 1, 2
LAZY_KINDS = frozenset({VmaKind.ANON_PRIVATE, VmaKind.HEAP, VmaKind.STACK})

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def log_dir() -> str:
    if os.geteuid() == 0:
        return "/run/ptckpt/lazy"
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/ptckpt-{os.geteuid()}", "ptckpt", "lazy")


def lazy_candidate(vma: Vma) -> bool:
    flags = vma.vmflags.split()
    return (vma.kind in LAZY_KINDS and not vma.shared and not vma.cow and not vma.guards
            and vma.prot & (PROT_READ | PROT_WRITE) == PROT_READ | PROT_WRITE
            and "lo" not in flags and "dp" not in flags)


def _ioctl(fd: int, request: int, arg) -> int:
    """ioctl() with a ctypes argument; 0 or the errno (the GIL is let go meanwhile)."""
    if _libc.ioctl(fd, request, ctypes.addressof(arg)) < 0:
        return ctypes.get_errno()
    return 0


class Pending:
    """The pages an address space still lacks: sorted, disjoint [start, end) segments, each
    with its source (the restore's fd of a page file) and the file offset of its start."""

    def __init__(self, segs: list[list[int]] | None = None):
        self.segs = sorted(segs or [])
        self.starts = [s[0] for s in self.segs]

    def copy(self) -> "Pending":
        return Pending([list(s) for s in self.segs])

    def bytes(self) -> int:
        return sum(e - s for s, e, _src, _off in self.segs)

    def find(self, addr: int) -> list[int] | None:
        i = bisect_right(self.starts, addr) - 1
        if i >= 0 and self.segs[i][1] > addr:
            return self.segs[i]
        return None

    def remove(self, start: int, end: int) -> list[list[int]]:
        """Take [start, end) out; returns the pieces that were pending there."""
        if start >= end:
            return []
        i = max(bisect_right(self.starts, start) - 1, 0)
        taken: list[list[int]] = []
        keep: list[list[int]] = []
        j = i
        while j < len(self.segs) and self.segs[j][0] < end:
            s, e, src, off = self.segs[j]
            if e > start:
                if s < start:
                    keep.append([s, start, src, off])
                lo, hi = max(s, start), min(e, end)
                taken.append([lo, hi, src, off + lo - s])
                if e > end:
                    keep.append([end, e, src, off + end - s])
            else:
                keep.append([s, e, src, off])
            j += 1
        self.segs[i:j] = keep
        self.starts[i:j] = [k[0] for k in keep]
        return taken

    def move(self, frm: int, to: int, length: int) -> None:
        """What was pending in [frm, frm+length) is now at `to` (mremap)."""
        moved = self.remove(frm, frm + length)
        self.remove(to, to + length)
        for s, e, src, off in moved:
            k = [s - frm + to, e - frm + to, src, off]
            i = bisect_right(self.starts, k[0])
            self.segs.insert(i, k)
            self.starts.insert(i, k[0])


class Source:
    """A page file mapped read-only in the server, its blocks checked at first use; or, for
    compressed data (`check` a FrameSpec), the memfd its frames go into, each frame
    decompressed (and so checked) the first time a page of it is needed; or, for page data
    on a page server (`check` a pagestream.LazyFetch), the memfd each block is fetched
    into (then checked) the first time a page of it is needed."""

    def __init__(self, fd: int, check):
        self.path = procfs.readlink_fd(os.getpid(), fd)
        self.size = os.fstat(fd).st_size
        self.frames = check if isinstance(check, compression.FrameSpec) else None
        self.remote = check if hasattr(check, "fetch") else None
        if self.remote is not None:
            self.path = self.remote.where
            self.addr = _map(self.remote.fd, self.size, PROT_READ | PROT_WRITE, self.path)
            check = self.remote.check
            self._lock = threading.Lock()
        elif self.frames is None:
            self.addr = _map(fd, self.size, PROT_READ, self.path)
        else:
            # the reader's own fd of the memfd (writable), and the compressed file beside it
            self.addr = _map(self.frames.raw_fd, self.size, PROT_READ | PROT_WRITE, self.path)
            check = None
            self.path = self.frames.path
            end = self.frames.stored_end()
            if os.fstat(self.frames.src).st_size < end:
                raise CorruptImage(self.path, f"compressed page data ends before byte {end}")
            self._zaddr = _map(self.frames.src, end, PROT_READ, self.path)
            self._starts, self._stored_at, pos, at = [], [], 0, self.frames.data_offset
            for raw, stored in self.frames.sizes:
                self._starts.append(pos)
                self._stored_at.append(at)
                pos += raw
                at += stored
            self._unpacked = bytearray(len(self.frames.sizes))
            self._lock = threading.Lock()
            self._zstd = None
        self.check = check if check is not None and check.sums else None
        self.verified = bytearray(pagesums.block_count(check.length, check.block)) if self.check else None

    def verify(self, off: int, length: int) -> None:
        """CorruptImage unless file bytes [off, off+length) exist and their blocks hash right
        (compressed: their frames decompressed, here, and whole)."""
        if off + length > self.size:
            raise CorruptImage(self.path, f"page data ends at byte {self.size}, {off + length} needed")
        if self.frames is not None:
            for i in range(bisect_right(self._starts, off) - 1, bisect_right(self._starts, off + length - 1)):
                if not self._unpacked[i]:
                    self._unpack(i)
            return
        c = self.check
        if c is None:
            return
        first = max(off - c.start, 0) // c.block
        last = (off + length - 1 - c.start) // c.block
        for i in range(first, last + 1):
            if i >= len(self.verified) or self.verified[i]:
                continue
            if self.remote is not None:
                with self._lock:              # the restore's two threads may both ask
                    if not self.verified[i]:
                        self._verify_block(c, i, fetch=True)
                continue
            self._verify_block(c, i)

    def _verify_block(self, c, i: int, fetch: bool = False) -> None:
        lo = c.start + i * c.block
        n = min(c.block, c.start + c.length - lo)
        if fetch:
            self.remote.fetch(self.addr, lo, n)
        data = (ctypes.c_char * n).from_address(self.addr + lo)
        if xxhash.xxh3_64_intdigest(memoryview(data)) != struct.unpack_from("<Q", c.sums, 8 * i)[0]:
            raise CorruptImage(self.path, f"checksum mismatch in page data at bytes {lo}-{lo + n - 1} "
                                          f"of the file (block {i})")
        self.verified[i] = 1

    def fetch_ahead(self) -> None:
        """Fetch (and check) every block of remote data not in yet, in file order: run in a
        thread of the server process, so that the network and the copies overlap.  An error
        stops it; whoever needs that block next meets the error itself."""
        c = self.check
        try:
            for i in range(len(self.verified)):
                if not self.verified[i]:
                    self.verify(c.start + i * c.block, 1)
        except (PtckptError, OSError):
            return

    def keep_fds(self) -> set[int]:
        """What a server process of its own needs besides the mapping: the connection."""
        return self.remote.keep_fds() if self.remote is not None else set()

    def frames_unpacked(self) -> int:
        return sum(self._unpacked)

    def _unpack(self, i: int) -> None:
        """Decompress frame `i` into the memfd (once, whichever thread asks first)."""
        with self._lock:
            if self._unpacked[i]:
                return
            if self._zstd is None:
                self._zstd = compression.decompressor()
            raw, stored = self.frames.sizes[i]
            at = self._stored_at[i]
            data = (ctypes.c_char * stored).from_address(self._zaddr + at)
            out = compression.decompress_frame(self._zstd, data, raw, self.path, at)
            ctypes.memmove(self.addr + self._starts[i], out, raw)
            self._unpacked[i] = 1


def _map(fd: int, size: int, prot: int, path: str) -> int:
    """`size` bytes of `fd` mapped shared: the address (the mapping outlives the fd)."""
    addr = _libc.mmap(None, max(size, PAGE), prot, 1, fd, 0)     # MAP_SHARED
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {path}")
    return addr


class Space:
    """One address space served: its userfaultfd (ours) and the pages still to come."""

    def __init__(self, uffd: int, pid: int, pending: Pending):
        self.uffd = uffd
        self.pid = pid                 # as seen here; 0 for a child forked since the restore
        self.pending = pending
        self.dead = False


class _Copy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("copy", ctypes.c_int64)]


class _Zero(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("zeropage", ctypes.c_int64)]


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class Server:
    """The page server of one lazy restore."""

    def __init__(self):
        self.sources: dict[int, Source] = {}
        self.spaces: list[Space] = []
        self.error: BaseException | None = None
        self.warnings: list[str] = []
        self.faults = self.copied = self.zeroed = 0
        self.lazy_bytes = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._next = 0                 # round robin of the background copy
        self._watchdog: socket.socket | None = None
        self._log_fd = -1
        self._pids: list[int] = []              # the restored processes, as seen here ...
        self._session_ids: set[int] = set()     # ... and their sessions (the daemon's to end)

    # --- registration, in the frozen process ---------------------------------------

    def add_source(self, fd: int, check: pagesums.PagesToCheck | None) -> None:
        if fd not in self.sources:
            self.sources[fd] = Source(fd, check)

    def register_frozen(self, remote, pid: int, vmas: Sequence[Vma], sources) -> list:
        """Register the lazy mappings of `pid` (a syscall scope `remote` in it); returns the
        (fd, base, runs) sources with only the pages still to fill eagerly (their frames
        decompressed, where the data is compressed)."""
        eager = self._register(remote, pid, vmas, sources)
        self.ready(eager)
        return eager

    def ready(self, sources, within: tuple[int, int] | None = None) -> None:
        """The pages of (fd, base, runs) `sources` (those `within` (start, end) only) made
        readable from their fds now, ahead of their use: compressed frames decompressed,
        blocks on a page server fetched."""
        for fd, base, runs in sources:
            src = self.sources.get(fd)
            if src is not None and (src.frames is not None or src.remote is not None):
                for r in runs:
                    if within is None or r.vaddr < within[1] and r.vaddr + r.npages * PAGE > within[0]:
                        src.verify(base + r.offset, r.npages * PAGE)

    def _register(self, remote, pid: int, vmas: Sequence[Vma], sources) -> list:
        spans = sorted((v.start, v.end) for v in vmas if lazy_candidate(v))
        if not spans or not any(fd in self.sources for fd, _b, _r in sources):
            return sources
        made = remote.syscall("userfaultfd", O_CLOEXEC | O_NONBLOCK)
        if made < 0:
            self.warnings.append(f"process {pid}: no userfaultfd ({os.strerror(-made)}): "
                                 f"its memory was filled before it ran, not lazily")
            return sources
        try:
            uffd = pidfd_getfd(pid, made)
        finally:
            remote.syscall("close", made)
        api = (ctypes.c_uint64 * 3)(UFFD_API, FEATURES, 0)
        err = _ioctl(uffd, UFFDIO_API, api)
        if err:
            os.close(uffd)
            self.warnings.append(f"process {pid}: the userfaultfd refuses the events a lazy restore needs "
                                 f"({os.strerror(err)}): its memory was filled before it ran")
            return sources
        registered = []
        for start, end in spans:
            reg = (ctypes.c_uint64 * 4)(start, end - start, UFFDIO_REGISTER_MODE_MISSING, 0)
            err = _ioctl(uffd, UFFDIO_REGISTER, reg)
            if err:
                log.debug("lazy: %d %#x-%#x not registered: %s", pid, start, end, os.strerror(err))
            else:
                registered.append((start, end))
        eager, segs = [], []
        for fd, base, runs in sources:
            if fd not in self.sources:
                eager.append((fd, base, runs))
                continue
            left = []
            for r in runs:
                for s, e, inside in _split(r.vaddr, r.vaddr + r.npages * PAGE, registered):
                    if inside:
                        segs.append([s, e, fd, base + r.offset + s - r.vaddr])
                    else:
                        left.append(PageRun(s, (e - s) // PAGE, r.offset + s - r.vaddr))
            if left:
                eager.append((fd, base, left))
        if not segs:
            os.close(uffd)
            return sources
        space = Space(uffd, pid, Pending(segs))
        self.lazy_bytes += space.pending.bytes()
        with self._lock:
            self.spaces.append(space)
        if self._thread is None:
            self._thread = threading.Thread(target=self._thread_main, name="lazy-pages", daemon=True)
            self._thread.start()
        return eager

    # --- serving ---------------------------------------------------------------------

    def _thread_main(self) -> None:
        """During the restore: faults only (ptckpt's own reads and writes of the processes)."""
        try:
            while not self._stop:
                self._serve(0.05)
        except BaseException as err:          # noqa: BLE001 - asked for by check()
            self.error = err

    def _serve(self, timeout: float) -> None:
        with self._lock:
            spaces = [s for s in self.spaces if not s.dead]
        if not spaces:
            time.sleep(timeout)
            return
        poll = select.poll()
        for s in spaces:
            poll.register(s.uffd, select.POLLIN)
        by_fd = {s.uffd: s for s in spaces}
        for fd, _ev in poll.poll(timeout * 1000):
            self._events(by_fd[fd])

    def _events(self, space: Space) -> None:
        try:
            data = os.read(space.uffd, MSG * 64)
        except BlockingIOError:
            return
        for at in range(0, len(data) - MSG + 1, MSG):
            event = data[at]
            if event == EV_PAGEFAULT:
                _flags, addr = struct.unpack_from("<QQ", data, at + 8)
                self._fault(space, addr & ~(PAGE - 1))
            elif event == EV_FORK:
                (ufd,) = struct.unpack_from("<I", data, at + 8)
                child = Space(ufd, 0, space.pending.copy())
                with self._lock:
                    self.spaces.append(child)
                self._hand_to_watchdog(ufd)
                self._say(f"a process with pages to come forked: its child is served too "
                          f"({child.pending.bytes() >> 20} MiB to come there)")
            elif event == EV_REMAP:
                frm, to, length = struct.unpack_from("<QQQ", data, at + 8)
                space.pending.move(frm, to, length)
            elif event in (EV_REMOVE, EV_UNMAP):
                start, end = struct.unpack_from("<QQ", data, at + 8)
                space.pending.remove(start, end)

    def _fault(self, space: Space, addr: int) -> None:
        self.faults += 1
        seg = space.pending.find(addr)
        if seg is None:                       # not in the image (or in already): zeros, or a wake
            z = _Zero(addr, PAGE, 0, 0)
            err = _ioctl(space.uffd, UFFDIO_ZEROPAGE, z)
            if err == errno.EEXIST:
                _ioctl(space.uffd, UFFDIO_WAKE, _Range(addr, PAGE))
            elif not err:
                self.zeroed += 1
            return
        lo = max(seg[0], addr & ~(WINDOW - 1))
        hi = min(seg[1], (addr & ~(WINDOW - 1)) + WINDOW)
        try:
            self._fill(space, lo, hi)
        except (CorruptImage, TransferError) as err:
            if self._thread is not None and threading.current_thread() is self._thread:
                self.error = err              # the restore fails; meanwhile no one may wait
                _ioctl(space.uffd, UFFDIO_ZEROPAGE, _Zero(addr, PAGE, 0, 0))
                space.pending.remove(lo, hi)
                return
            raise

    def _fill(self, space: Space, lo: int, hi: int) -> None:
        """Copy [lo, hi), pending and inside one segment, into the space."""
        seg = space.pending.find(lo)
        src = self.sources[seg[2]]
        foff = seg[3] + lo - seg[0]
        src.verify(foff, hi - lo)
        pos = lo
        arg = _Copy()
        while pos < hi:
            arg.dst, arg.src, arg.len, arg.mode, arg.copy = pos, src.addr + foff + pos - lo, hi - pos, 0, 0
            err = _ioctl(space.uffd, UFFDIO_COPY, arg)
            if not err:
                self.copied += hi - pos
                pos = hi
                break
            if arg.copy > 0:
                self.copied += arg.copy
                pos += arg.copy
                continue
            err = -arg.copy if arg.copy < 0 else err
            if err == errno.EEXIST:           # in already (a race with a fault): next page
                _ioctl(space.uffd, UFFDIO_WAKE, _Range(pos, PAGE))
                pos += PAGE
            elif err == errno.EAGAIN:         # the layout is changing: its events first
                space.pending.remove(lo, pos)
                self._events(space)
                return
            elif err == errno.ESRCH:          # the process is gone (exited, or exec'd)
                space.dead = True
                space.pending = Pending()
                return
            elif err in (errno.ENOENT, errno.EINVAL):   # no longer mapped there
                break
            else:
                raise OSError(err, f"UFFDIO_COPY at {pos:#x}: {os.strerror(err)}")
        space.pending.remove(lo, hi)

    def _prefetch(self) -> bool:
        """Copy the next chunk of some space's pages; False when nothing is left."""
        live = [s for s in self.spaces if not s.dead and s.pending.segs]
        if not live:
            return False
        space = live[self._next % len(live)]
        self._next += 1
        s, e, _src, _off = space.pending.segs[0]
        self._fill(space, s, min(e, s + CHUNK))
        return True

    def check(self) -> None:
        """Raise what the serving thread ran into (a corrupt block) before anything runs."""
        if self.error is not None:
            raise self.error

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop = True
            self._thread.join()

    def abort(self) -> None:
        """The restore failed: stop serving and drop every registration."""
        self._stop_thread()
        for s in self.spaces:
            os.close(s.uffd)
        self.spaces = []

    # --- the server and its watchdog, processes of their own ------------------------

    def start_daemon(self, pids: Sequence[int]) -> tuple[int, int, str]:
        """Move the serving into a server process and a watchdog (both detached from the
        caller); returns (server pid, watchdog pid, log path).  Our fds are closed."""
        self._stop_thread()
        self.check()
        os.makedirs(log_dir(), mode=0o700, exist_ok=True)
        path = os.path.join(log_dir(), f"lazy-{pids[0]}-{int(time.time())}-{os.getpid()}.log")
        log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._pids = list(pids)
        for p in pids:
            try:
                self._session_ids.add(os.getsid(p))
            except OSError:
                pass
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        told_r, told_w = os.pipe()
        mid = os.fork()
        if mid == 0:                          # the intermediate: forks both, says their pids, goes
            code = 1
            try:
                os.setsid()
                _quiet_stdio()
                watchdog = os.fork()
                if watchdog == 0:
                    ours.close()
                    _run_child(lambda: _watch(theirs, [s.uffd for s in self.spaces], self._pids, self._session_ids,
                                              log_fd),
                               keep={theirs.fileno(), log_fd, *(s.uffd for s in self.spaces)})
                server = os.fork()
                if server == 0:
                    theirs.close()
                    self._watchdog, self._log_fd = ours, log_fd
                    _run_child(self._daemon_main,
                               keep={ours.fileno(), log_fd, *(s.uffd for s in self.spaces),
                                     *(fd for src in self.sources.values() for fd in src.keep_fds())})
                os.write(told_w, f"{server} {watchdog}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(told_w)
        os.waitpid(mid, 0)
        said = os.read(told_r, 64).decode().split()
        os.close(told_r)
        ours.close()
        theirs.close()
        os.close(log_fd)
        for s in self.spaces:
            os.close(s.uffd)
        self.spaces = []
        if len(said) != 2:
            raise OSError(errno.ECHILD, "the lazy page server did not start")
        return int(said[0]), int(said[1]), path

    def _say(self, line: str) -> None:
        if self._log_fd >= 0:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(self._log_fd, f"{stamp} server {os.getpid()}: {line}\n".encode())

    def _hand_to_watchdog(self, ufd: int) -> None:
        if self._watchdog is not None:
            try:
                self._watchdog.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ufd]))])
            except OSError:
                pass                          # no watchdog any more: serve on regardless

    def _daemon_main(self) -> None:
        started = time.monotonic()
        total = sum(s.pending.bytes() for s in self.spaces)
        frames = [src for src in self.sources.values() if src.frames is not None]
        unpacked_before = sum(src.frames_unpacked() for src in frames)
        self._say(f"serving {total >> 20} MiB of {len(self.spaces)} process(es) "
                  f"({', '.join(str(s.pid) for s in self.spaces)})")
        pace = testhooks.lazy_pace()
        if not pace:                          # (a test's pace keeps pages from coming early)
            for src in self.sources.values():
                if src.remote is not None:
                    threading.Thread(target=src.fetch_ahead, name="fetch-ahead", daemon=True).start()
        try:
            while True:
                self._serve(pace)
                testhooks.reached("lazy-copy")
                if not self._prefetch():
                    self._serve(0)            # what came meanwhile (a fork: pages to come)
                    if not any(s.pending.segs for s in self.spaces if not s.dead):
                        break
        except (CorruptImage, TransferError) as err:
            self._say(f"{err}" if isinstance(err, CorruptImage) else f"the page server went away: {err}")
            killed = _kill_tree(self._pids, self._session_ids)
            self._say(f"killed {' '.join(map(str, killed)) or 'nothing'}: their memory cannot be completed")
            self._tell(b"K")
            return
        except BaseException as err:
            self._say(f"failed: {err!r}")
            raise
        gone = [s.pid for s in self.spaces if s.dead and s.pid]
        unpacked = sum(src.frames_unpacked() for src in frames) - unpacked_before
        self._say(f"all pages in after {time.monotonic() - started:.3f} s: {self.copied >> 20} MiB copied, "
                  f"{self.faults} faults served, {self.zeroed} zero pages"
                  + (f", {unpacked} compressed frames decompressed here (of "
                     f"{sum(len(src._unpacked) for src in frames)})" if frames else "")
                  + (f"; gone meanwhile: {' '.join(map(str, gone))}" if gone else ""))
        self._tell(b"D")

    def _tell(self, what: bytes) -> None:
        if self._watchdog is not None:
            try:
                self._watchdog.send(what)
            except OSError:
                pass


def _split(start: int, end: int, spans: Sequence[tuple[int, int]]):
    """[start, end) cut at the spans' edges: (s, e, inside a span) pieces, in order."""
    pos = start
    for s, e in spans:
        if e <= pos or s >= end:
            continue
        if s > pos:
            yield pos, s, False
            pos = s
        hi = min(e, end)
        yield pos, hi, True
        pos = hi
    if pos < end:
        yield pos, end, False


def _quiet_stdio() -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)


def _run_child(main, keep: set[int]) -> None:
    """In a forked child: close every fd but `keep` (and stdio), run `main`, never return."""
    code = 1
    try:
        for fd in procfs.list_fds(os.getpid()):
            if fd > 2 and fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        main()
        code = 0
    finally:
        os._exit(code)


def _watch(sock: socket.socket, uffds: list[int], pids: list[int], sessions: set[int], log_fd: int) -> None:
    """The watchdog: holds a copy of every userfaultfd until the server says it finished; if
    the server goes without saying so, kills what may lack pages."""
    held = list(uffds)
    while True:
        try:
            msg, anc, _flags, _addr = sock.recvmsg(16, socket.CMSG_SPACE(4 * 16))
        except InterruptedError:
            continue
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                held.extend(array.array("i", data[:len(data) - len(data) % 4]))
        if msg in (b"D", b"K"):
            return
        if not msg:                           # the server is gone and never said it finished
            killed = _kill_tree(pids, sessions)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(log_fd, f"{stamp} watchdog {os.getpid()}: the page server died before every page was in: "
                             f"killed {' '.join(map(str, killed)) or 'nothing'} (SIGKILL), whose memory was "
                             f"incomplete\n".encode())
            return


def _kill_tree(pids: Sequence[int], sessions: set[int]) -> list[int]:
    """SIGKILL `pids`, their descendants, and the processes of `sessions` with a mapping
    registered for missing pages (VmFlags "um"); returns whom."""
    stats: dict[int, tuple[int, int]] = {}
    for pid in procfs.list_pids():
        try:
            st = procfs.read_stat(pid)
            stats[pid] = (st.ppid, st.session)
        except (OSError, PtckptError, IndexError, ValueError):
            pass
    victims = {p for p in pids if p in stats}
    grew = True
    while grew:
        more = {p for p, (ppid, _sid) in stats.items() if ppid in victims} - victims
        victims |= more
        grew = bool(more)
    for p, (_ppid, sid) in stats.items():
        if sid in sessions and p not in victims and p != os.getpid() and _has_missing_registration(p):
            victims.add(p)
    for p in sorted(victims):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    return sorted(victims)


def _has_missing_registration(pid: int) -> bool:
    try:
        return any("um" in e.vmflag_set for e in procfs.read_smaps(pid))
    except (OSError, PtckptError):
        return False


def why_killed(path: str, wait: float = 1.0) -> str | None:
    """The log's line saying the server or its watchdog killed the processes, if any.  They
    write it just after the kill, so a caller who saw the process die may be first: the log
    is read again for up to `wait` seconds until that line is there."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(path) as f:
                lines = [line.strip() for line in f
                         if " killed " in line or "checksum mismatch" in line or "page server went away" in line]
        except OSError:
            return None
        if any(" killed " in line for line in lines) or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if not lines:
        return None
    return "lazy restore: " + " ".join(line.split(": ", 1)[1] for line in lines[-2:])

"""The image directory: its writer and its reader.

Layout of an image directory (all files 0600, the directory 0700)::

    inventory.img       INVENTORY file: one Inventory entry
    core-PID.img        CORE file: Task, Creds, Mm, Rlimit*, Vma*, Thread*,
                        Sigaction*, PendingSignal*, Fd* entries
    pagemap-PID.img     PAGEMAP file: PageRun* entries
    pages-PID.img       PAGES file: header padded to 4096 bytes, then raw page
                        data; PageRun.offset is relative to the data (file
                        offset - PAGES_DATA_OFFSET)

The writer builds everything in a hidden temporary directory beside the target
and renames it into place on commit(), so an image either exists complete or
not at all.  The reader validates every file (magic, version, length,
checksum, entries) in open() and never writes.
"""

from __future__ import annotations

import dataclasses
import bisect
import contextlib
import errno
import ctypes
import fcntl
import glob
import mmap
import os
import queue
import shutil
import stat
import tempfile
import threading
import uuid
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from ptckpt.errors import (
    BadMagic,
    CorruptImage,
    DestinationExists,
    ImageAccessDenied,
    ImageWriteError,
    NotAnImage,
    PagesOnServer,
    ParentMissing,
    UnsupportedVersion,
)
from ptckpt.formats import compression, pagesums, validate
from ptckpt.formats.model import (
    AioRing,
    FD_STATE_TYPES,
    PAGE_SIZE,
    Creds,
    Fd,
    FdOwner,
    GhostFile,
    HeldLock,
    InetSocket,
    Itimer,
    Inventory,
    Mm,
    MsgImage,
    NetlinkSocket,
    PageFrames,
    PageRun,
    PageServerPages,
    PageSums,
    ParentPages,
    PendingSignal,
    PosixTimer,
    PipeBuffer,
    PluginData,
    ProcessImage,
    Rlimit,
    SavedFile,
    SemImage,
    ShmImage,
    Sigaction,
    Task,
    Terminal,
    Pty,
    Thread,
    UnixSocket,
    InFlightFd,
    Vma,
    Zombie,
)
from ptckpt.formats.records import (
    FILE_ENTRY_KINDS,
    ENTRY_HEADER_SIZE,
    FORMAT_VERSION,
    HEADER_SIZE,
    KIND_OF,
    MAGIC,
    PAGES_DATA_OFFSET,
    EntryDecodeError,
    FileHeader,
    FileKind,
    RawEntry,
    build_file,
    build_header,
    decode_entries,
    encode_entry,
    encode_page_runs,
    encode_parent_pages,
    parse_header,
)

INVENTORY_NAME = "inventory.img"
FILE_MODE = 0o600
DIR_MODE = 0o700
# PagesWriter buffers: 4 x 4 MiB, so a buffer is usually still in the L3 cache
# when the checksum and write threads read it (measured: 16 MiB x 3 is ~30%
# slower, 2 MiB x 4 about the same).
DEFAULT_BUFFER_SIZE = 4 << 20
DEFAULT_NBUFFERS = 4
MAX_BUFFER_SIZE = 64 << 20
_CHUNK = 4 << 20                     # unit of work of the checksum and write threads
PAGE_SUMS_SINCE = 10                 # format that hashes the page data by block


def core_name(pid: int) -> str:
    return f"core-{pid}.img"


def pagemap_name(pid: int) -> str:
    return f"pagemap-{pid}.img"


def pages_name(pid: int) -> str:
    return f"pages-{pid}.img"


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    """Up to `size` bytes at `offset` (fewer only at end of file)."""
    parts = []
    while size > 0:
        chunk = os.pread(fd, min(size, 1 << 30), offset)
        if not chunk:
            break
        parts.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


# =============================================================================
# writer
# =============================================================================

def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporary directories (`.NAME.tmp-*` beside `directory`) that writers
    killed before they could clean up left behind: those whose lock nobody holds.  A writer
    at work holds its own (an flock on the directory, gone with its process)."""
    parent, name = os.path.split(os.path.abspath(directory))
    removed = []
    for path in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.tmp-*")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue                               # a live writer's
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


class PagesSink(Protocol):
    """Where page data goes instead of pages-PID.img files (ptckpt.pagestream sends it to a
    page server).  Each NAME is a PAGES file there, written at file offsets as it would be
    here (the header at 0 last, the data from PAGES_DATA_OFFSET); called from the writer's
    thread; an error is raised from the next call of the PagesWriter."""

    def pwrite(self, name: str, data, offset: int) -> None: ...
    def record(self, name: str, length: int, crc32: int) -> PageServerPages: ...
    def discard(self, name: str) -> None: ...
    def seal(self) -> None: ...
    def abort(self) -> None: ...


class ImageWriter:
    """Writes one image directory atomically.

    ::

        with ImageWriter("/var/tmp/ckpt") as image:     # create(); commit() on success, abort() on error
            image.write_inventory(inventory)
            for proc in processes:
                image.write_process(proc)
                with image.pages_writer(proc.task.pid) as pages:
                    ...                                 # see PagesWriter
        # the directory now exists, complete

    The target must not exist, or be an empty directory (which is replaced).
    Every OSError becomes ImageWriteError; misuse (a missing process, a
    PagesWriter left open) raises ValueError at commit().
    `durable=True` fsyncs every file and both directories at commit.
    `compress=("zstd", LEVEL)` compresses the page data (PagesWriter).
    `pages_to` (a :class:`PagesSink`) takes the page data instead of pages-PID.img files:
    the pagemap then records where it went (PAGE_SERVER), and commit() first has the sink
    make it durable there (seal), abort() has it dropped.
    """

    def __init__(self, directory: str | os.PathLike, *, durable: bool = False,
                 compress: tuple[str, int] | None = None, pages_to: PagesSink | None = None):
        self.path = os.path.abspath(os.fspath(directory))
        self.durable = durable
        self.compress = compress
        self.pages_to = pages_to
        self.image_id = uuid.uuid4().hex
        self.temp_path: str | None = None
        self._temp_lock = -1            # the temporary directory, flock'ed while we write it
        self._inventory: Inventory | None = None
        self._cores: set[int] = set()
        self._pages_done: set[int] = set()
        self._open_pages: dict[int, PagesWriter] = {}
        self._state = "new"             # new -> open -> committed | aborted

    # --- lifecycle -------------------------------------------------------------

    def create(self) -> ImageWriter:
        """Make the temporary directory `.NAME.tmp-XXXX` beside the target."""
        if self._state != "new":
            raise ValueError(f"ImageWriter for {self.path} is {self._state}")
        self._check_destination()
        parent, name = os.path.split(self.path)
        with self._write_errors(self.path):
            remove_stale_temporaries(self.path)
            self.temp_path = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
            self._temp_lock = os.open(self.temp_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fcntl.flock(self._temp_lock, fcntl.LOCK_EX)  # ours while this process lives
            os.chmod(self.temp_path, DIR_MODE)      # mkdtemp's 0700 is subject to umask
        self._state = "open"
        return self

    def commit(self) -> None:
        """Check the image is complete and rename it onto the target."""
        self._require_open()
        self._check_complete()
        if self.pages_to is not None:
            self.pages_to.seal()                    # the pages are safe there before the image exists
        with self._write_errors(self.path):
            if self.durable:
                self._fsync_dir(self.temp_path)
            try:
                # rename(2) replaces an empty directory atomically and refuses a
                # non-empty one, so a racing writer cannot be clobbered.
                os.rename(self.temp_path, self.path)
            except OSError as err:
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    self.abort()
                    raise DestinationExists(self.path) from err
                raise
            if self.durable:
                self._fsync_dir(os.path.dirname(self.path))
        self.temp_path = None
        self._unlock()
        self._state = "committed"

    def _unlock(self) -> None:
        if self._temp_lock >= 0:
            os.close(self._temp_lock)
            self._temp_lock = -1

    def abort(self) -> None:
        """Throw away everything written so far (idempotent)."""
        for pages in list(self._open_pages.values()):
            pages._discard()
        self._open_pages.clear()
        if self.pages_to is not None and self._state == "open":
            self.pages_to.abort()
        self._unlock()          # first: its fd is one rmtree may need (a dump out of open files)
        if self.temp_path is not None:
            shutil.rmtree(self.temp_path, ignore_errors=True)
            self.temp_path = None
        if self._state in ("new", "open"):
            self._state = "aborted"

    def __enter__(self) -> ImageWriter:
        if self._state == "new":
            self.create()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise

    # --- content ---------------------------------------------------------------

    def write_inventory(self, inventory: Inventory, shared: Sequence = ()) -> None:
        """inventory.img: the INVENTORY record and the image-wide ones (zombies, pipes, sockets)."""
        self._require_open()
        if self._inventory is not None:
            raise ValueError("inventory already written")
        if not inventory.image_id:
            inventory = dataclasses.replace(inventory, image_id=self.image_id)
        self._write_file(INVENTORY_NAME, build_file(FileKind.INVENTORY, [inventory, *shared]))
        self._inventory = inventory

    def write_process(self, proc: ProcessImage) -> None:
        """core-PID.img for one process."""
        self._require_open()
        pid = proc.task.pid
        if pid in self._cores:
            raise ValueError(f"process {pid} already written")
        records = [proc.task, proc.creds, proc.mm, *proc.rlimits, *proc.vmas,
                   *proc.threads, *proc.sigactions, *proc.pending, *proc.fds, *proc.locks,
                   *proc.timers, *proc.itimers, *proc.owners, *proc.aio_rings]
        self._write_file(core_name(pid), build_file(FileKind.CORE, records))
        self._cores.add(pid)

    def pages_writer(self, pid: int, *, buffer_size: int = DEFAULT_BUFFER_SIZE,
                     nbuffers: int = DEFAULT_NBUFFERS) -> PagesWriter:
        """A PagesWriter for pages-PID.img and pagemap-PID.img (close() it)."""
        self._require_open()
        if pid in self._pages_done or pid in self._open_pages:
            raise ValueError(f"pages of process {pid} already written")
        pages = PagesWriter(self, pid, buffer_size=buffer_size, nbuffers=nbuffers)
        self._open_pages[pid] = pages
        return pages

    # --- internals -------------------------------------------------------------

    def _require_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"ImageWriter for {self.path} is {self._state}, not open")

    def _check_destination(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        except OSError as err:
            raise ImageWriteError(self.path, err) from err
        if not stat.S_ISDIR(st.st_mode):
            raise DestinationExists(self.path, f"is {_kind_of(st.st_mode)}, not a directory")
        try:
            if os.listdir(self.path):
                raise DestinationExists(self.path)
        except OSError as err:
            raise ImageWriteError(self.path, err) from err

    def _check_complete(self) -> None:
        if self._open_pages:
            raise ValueError(f"pages writer of process(es) {sorted(self._open_pages)} not closed")
        if self._inventory is None:
            raise ValueError("no inventory written")
        pids = set(self._inventory.pids)
        problems = []
        for pid in sorted(pids - self._cores):
            problems.append(f"process {pid} has no core (write_process)")
        for pid in sorted(pids - self._pages_done):
            problems.append(f"process {pid} has no pages (pages_writer)")
        for pid in sorted((self._cores | self._pages_done) - pids):
            problems.append(f"process {pid} is not in inventory.pids")
        if problems:
            raise ValueError("incomplete image: " + "; ".join(problems))

    def _display_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    @contextmanager
    def _write_errors(self, path: str) -> Iterator[None]:
        try:
            yield
        except OSError as err:
            raise ImageWriteError(path, err) from err

    def _create_file(self, name: str) -> int:
        """O_EXCL-create `name` in the temp dir, mode exactly 0600; returns the fd."""
        fd = os.open(os.path.join(self.temp_path, name),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)                # do not depend on the umask
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write_file(self, name: str, data: bytes) -> None:
        with self._write_errors(self._display_path(name)):
            fd = self._create_file(name)
            try:
                _pwrite_all(fd, data, 0)
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Ticket:
    """One submitted buffer in flight: done when every chunk is checksummed and written."""

    __slots__ = ("on_done", "_pending", "_lock")

    def __init__(self, steps: int, on_done):
        self.on_done = on_done
        self._pending = steps
        self._lock = threading.Lock()

    def step_done(self) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self.on_done()


def _open_direct(path: str) -> int:
    """A second, O_DIRECT descriptor of the pages file, or -1 where the file system refuses it.

    Page data goes through it: writing fresh page cache costs a page
    allocation per 4 KiB, which on the VMs we run on (free page reporting to
    the host) is five times slower than the disk itself.  The header and any
    unaligned buffer still go through the ordinary descriptor.
    """
    if os.environ.get("PTCKPT_NO_DIRECT"):
        return -1
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return -1


def _aligned(view: memoryview) -> bool:
    """O_DIRECT needs the buffer address and length page-aligned."""
    if len(view) % PAGE_SIZE or view.readonly:
        return False
    addr = ctypes.addressof((ctypes.c_char * len(view)).from_buffer(view))
    return addr % PAGE_SIZE == 0


class PagesWriter:
    """Streams one process's page data into pages-PID.img, and its runs into pagemap-PID.img.

    Two ways to hand over page data; both return the data offset at which the
    bytes were placed, for add_run(), and both take whole pages only:

    * **Buffers owned by the writer** (the fast path: no copy, and filling the
      next buffer overlaps checksumming and writing the previous ones)::

          buf = pages.get_buffer()        # writable memoryview, len == buffer_size
          n = fill(buf)                   # e.g. process_vm_readv / preadv(/proc/PID/mem) into it
          offset = pages.submit(buf, n)   # hands buf back; do not touch it afterwards
          pages.add_run(vaddr, n // PAGE_SIZE, offset)

      The writer owns `nbuffers` buffers (page-aligned anonymous mmaps).
      get_buffer() blocks while all of them are in flight; submit() never
      blocks.  ``submit(buf, 0)`` returns an unused buffer.

    * **write(data)** with any bytes-like object: returns once the writer is done
      with `data`, so the caller may reuse its buffer at once (checksum and write
      still run in parallel, but the caller waits for both).

    Behind both, one thread computes the running zlib.crc32 and another
    pwrite()s, each processing buffers in submission order; both release the GIL.
    With the image's `compress`, a thread before them cuts the data into frames of
    FRAME bytes and compresses them (zstd, on every CPU); offsets stay those of the
    raw data, and the frame sizes go into the pagemap (PAGE_FRAMES).
    add_parent() records ranges an incremental image leaves to its parent.
    A write error (ENOSPC ...) is raised as ImageWriteError from the next call.
    close() waits for everything in flight, pwrite()s the final header (payload
    length + crc) at offset 0 and writes pagemap-PID.img.  Use it as a context
    manager: a clean exit closes it, an exception discards it (and the
    ImageWriter's abort() removes the files).
    """

    def __init__(self, image: ImageWriter, pid: int, *, buffer_size: int, nbuffers: int):
        if buffer_size <= 0 or buffer_size % PAGE_SIZE or buffer_size > MAX_BUFFER_SIZE:
            raise ValueError(f"buffer_size must be a multiple of {PAGE_SIZE} up to {MAX_BUFFER_SIZE}")
        if nbuffers < 1:
            raise ValueError("nbuffers must be >= 1")
        self.pid = pid
        self.path = image._display_path(pages_name(pid))
        self.buffer_size = buffer_size
        self._image = image
        self._nbuffers = nbuffers
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        self._checked_out: set[int] = set()        # id() of views handed to the caller
        self._length = 0                           # data bytes submitted so far
        self._crc = 0
        self._sums = pagesums.BlockHasher()        # fed by the checksum thread
        self._runs: list[tuple[int, int, int]] = []
        self._parent: list[ParentPages] = []
        self._stored = 0                           # bytes of the file's data (compressed)
        self._frames: list[tuple[int, int]] = []   # (raw, stored) per compressed frame
        self._error: BaseException | None = None
        self._closed = False
        self._sink = image.pages_to
        self._fd = self._direct_fd = -1
        if self._sink is None:
            with image._write_errors(self.path):
                self._fd = image._create_file(pages_name(pid))
                self._direct_fd = _open_direct(os.path.join(image.temp_path, pages_name(pid)))
        self._crc_q: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._write_q: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._crc_loop, name=f"pages-{pid}-crc", daemon=True),
            threading.Thread(target=self._write_loop, name=f"pages-{pid}-write", daemon=True),
        ]
        self._zip = None
        if image.compress is not None:
            self._zip = compression.FrameCompressor(*image.compress)
            self._zip_q: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
            self._threads.insert(0, threading.Thread(target=self._compress_loop, name=f"pages-{pid}-zip",
                                                     daemon=True))
        for t in self._threads:
            t.start()

    # --- caller side -------------------------------------------------------------

    @property
    def length(self) -> int:
        """Data bytes submitted so far (the offset the next submit/write gets)."""
        return self._length

    def drain(self) -> None:
        """Wait until everything submitted so far is compressed, checksummed and written."""
        self._check_usable()
        done = threading.Event()
        if self._zip is not None:
            self._zip_q.put((memoryview(b""), done.set))
            done.wait()
            done.clear()
        marker = (_Ticket(2, done.set), memoryview(b""), self._stored)     # behind all before it
        self._crc_q.put(marker)
        self._write_q.put(marker)
        done.wait()
        self._raise_pending_error()

    def get_buffer(self) -> memoryview:
        """A free writable buffer of buffer_size bytes; blocks while all are in flight."""
        self._check_usable()
        if len(self._maps) < self._nbuffers and self._free.empty():
            m = mmap.mmap(-1, self.buffer_size)
            self._maps.append(m)
            view = memoryview(m)
            self._views.append(view)
        else:
            view = self._free.get()
        self._checked_out.add(id(view))
        self._raise_pending_error()
        return view

    def submit(self, buf: memoryview, nbytes: int, done=None) -> int:
        """Queue the first `nbytes` of a buffer from get_buffer(); returns their data offset.
        `done()` is called (from the writer's thread) once they are written, or compressed."""
        if id(buf) not in self._checked_out:
            raise ValueError("submit() takes a buffer returned by get_buffer() (and each only once)")
        self._checked_out.discard(id(buf))
        if nbytes < 0 or nbytes > len(buf) or nbytes % PAGE_SIZE:
            self._free.put(buf)
            raise ValueError(f"nbytes must be a multiple of {PAGE_SIZE} within the buffer, got {nbytes}")
        if nbytes == 0 or self._error is not None:
            self._free.put(buf)
            self._raise_pending_error()
            if done is not None:
                done()
            return self._length

        def finished() -> None:
            self._free.put(buf)
            if done is not None:
                done()
        return self._enqueue(buf[:nbytes], finished)

    def write(self, data) -> int:
        """Write whole pages from any bytes-like object; returns their data offset.

        Returns only once the writer no longer needs `data`.
        """
        self._check_usable()
        view = memoryview(data).cast("B")
        if len(view) % PAGE_SIZE:
            raise ValueError(f"write() takes whole pages, got {len(view)} bytes")
        if not view:
            return self._length
        done = threading.Event()
        offset = self._enqueue(view, done.set)
        done.wait()
        self._raise_pending_error()
        return offset

    def add_run(self, vaddr: int, npages: int, offset: int) -> None:
        """Record that `npages` pages at `vaddr` are at data `offset` (checked at close)."""
        self._check_usable()
        self._runs.append((vaddr, npages, offset))

    def add_runs(self, runs) -> None:
        """add_run() for many (vaddr, npages, offset) at once."""
        self._check_usable()
        self._runs.extend(runs)

    def add_parent(self, vaddr: int, npages: int) -> None:
        """Record that `npages` pages at `vaddr` are unchanged since the parent image."""
        self.add_parents([(vaddr, vaddr + npages * PAGE_SIZE)])

    def add_parents(self, spans) -> None:
        """add_parent() for many (start, end) spans at once."""
        self._check_usable()
        self._parent.extend(ParentPages(s, (e - s) // PAGE_SIZE) for s, e in spans)

    def close(self) -> None:
        """Finish pages-PID.img (header) and write pagemap-PID.img."""
        if self._closed:
            return
        self._stop_threads()
        self._closed = True
        try:
            self._raise_pending_error()
            self._check_runs()
            header = build_header(FileKind.PAGES, self._stored, self._crc).ljust(PAGES_DATA_OFFSET, b"\0")
            extra: list = list(self._parent)
            if self._sink is not None:
                self._sink.pwrite(pages_name(self.pid), header, 0)
                extra.append(self._sink.record(pages_name(self.pid), self._stored, self._crc))
            else:
                with self._image._write_errors(self.path):
                    _pwrite_all(self._fd, header, 0)
                    if self._image.durable:
                        os.fsync(self._fd)
            if self._zip is not None:
                extra.append(PageFrames(self._zip.codec, self._zip.level, compression.pack_sizes(self._frames)))
            self._image._write_file(pagemap_name(self.pid), build_file_from_runs(
                self._runs, PageSums(self._sums.block, self._sums.sums()), extra))
        finally:
            self._release()
            self._image._open_pages.pop(self.pid, None)
        self._image._pages_done.add(self.pid)

    def __enter__(self) -> PagesWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._discard()

    # --- internals -------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise ValueError(f"pages writer of process {self.pid} is closed")
        self._raise_pending_error()

    def _raise_pending_error(self) -> None:
        err = self._error
        if err is None:
            return
        if isinstance(err, OSError):
            raise ImageWriteError(self.path, err) from err
        raise err

    def _enqueue(self, view: memoryview, on_done) -> int:
        offset = self._length
        self._length += len(view)
        if self._zip is not None:
            self._zip_q.put((view, on_done))
        else:
            self._enqueue_stored(view, on_done)
        return offset

    def _enqueue_stored(self, view: memoryview, on_done) -> None:
        # Both threads work through the same chunk at about the same time, so
        # a big buffer is read from memory once, not twice.
        offset = self._stored
        self._stored += len(view)
        starts = range(0, len(view), _CHUNK)
        ticket = _Ticket(2 * len(starts), on_done)
        for start in starts:
            job = (ticket, view[start:start + _CHUNK], offset + start)
            self._crc_q.put(job)
            self._write_q.put(job)

    def _compress_loop(self) -> None:
        while (job := self._zip_q.get()) is not None:
            view, on_done = job
            data = None
            try:
                if self._error is None:
                    sizes, data = self._zip.compress(view)
                    self._frames.extend(sizes)
            except BaseException as err:      # noqa: BLE001 - handed to the caller's thread
                self._error = self._error or err
            finally:
                on_done()                     # the caller's buffer is free once compressed
            if data:
                self._enqueue_stored(memoryview(data), lambda: None)

    def _crc_loop(self) -> None:
        crc = 0
        while (job := self._crc_q.get()) is not None:
            ticket, view, _offset = job
            try:
                if self._error is None:
                    crc = zlib.crc32(view, crc)
                    self._sums.update(view)
            except BaseException as err:      # noqa: BLE001 - handed to the caller's thread
                self._error = self._error or err
            finally:
                ticket.step_done()
        self._crc = crc

    def _write_loop(self) -> None:
        fd = self._fd
        while (job := self._write_q.get()) is not None:
            ticket, view, offset = job
            try:
                if self._error is None and self._sink is not None:
                    self._sink.pwrite(pages_name(self.pid), view, PAGES_DATA_OFFSET + offset)
                elif self._error is None:
                    target = fd
                    if self._direct_fd >= 0 and _aligned(view):
                        target = self._direct_fd
                    _pwrite_all(target, view, PAGES_DATA_OFFSET + offset)
            except BaseException as err:      # noqa: BLE001 - handed to the caller's thread
                self._error = self._error or err
            finally:
                ticket.step_done()

    def _stop_threads(self) -> None:
        if not self._threads:
            return
        if self._zip is not None:
            self._zip_q.put(None)
            self._threads[0].join()
            self._zip.close()
        self._crc_q.put(None)
        self._write_q.put(None)
        for t in self._threads:
            t.join()
        self._threads = []

    def _check_runs(self) -> None:
        for vaddr, npages, offset in self._runs:
            if (vaddr % PAGE_SIZE or offset % PAGE_SIZE or npages <= 0 or vaddr < 0 or offset < 0
                    or offset + npages * PAGE_SIZE > self._length):
                raise ValueError(
                    f"process {self.pid}: bad page run vaddr={vaddr:#x} npages={npages} "
                    f"offset={offset} (data length {self._length})")

    def _release(self) -> None:
        for view in self._views:
            view.release()
        for m in self._maps:
            try:
                m.close()
            except BufferError:       # the caller still holds a slice; GC will unmap it
                pass
        self._views.clear()
        self._maps.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1

    def discard(self) -> None:
        """Give up this process's pages: stop, and remove pages-PID.img (the image goes on
        without it; a new pages_writer() for the pid may follow)."""
        self._discard()
        if self._sink is not None:
            self._sink.discard(pages_name(self.pid))
            return
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self._image.temp_path, pages_name(self.pid)))

    def _discard(self) -> None:
        """Stop without finishing (the ImageWriter's abort() deletes the files)."""
        if not self._closed:
            self._stop_threads()
            self._closed = True
            self._release()
        self._image._open_pages.pop(self.pid, None)


def build_file_from_runs(runs, sums: PageSums | None = None, extra: Sequence = ()) -> bytes:
    """A whole PAGEMAP file from (vaddr, npages, offset) runs (fast path of build_file),
    the page data's block sums and `extra` records (PAGE_PARENT, PAGE_FRAMES)."""
    parents = [e for e in extra if isinstance(e, ParentPages)]
    payload = encode_page_runs(runs) + (encode_entry(sums) if sums is not None else b"") \
        + encode_parent_pages(parents) + b"".join(encode_entry(e) for e in extra if not isinstance(e, ParentPages))
    return build_header(FileKind.PAGEMAP, len(payload), zlib.crc32(payload)) + payload


# =============================================================================
# reader
# =============================================================================

class PagesSource(Protocol):
    """Where a reader gets page data that a dump sent to a page server (ptckpt.pagestream):
    open() gives an fd holding the PAGES file `record` names (all of it fetched, or, for a
    lazy restore, a file of that size whose blocks lazy() fetches as they are needed)."""

    def open(self, record: PageServerPages, here: str) -> int: ...
    def lazy(self, fd: int, check: pagesums.PagesToCheck): ...


class ImageReader:
    """Reads and validates an image directory; never writes to it.

    ::

        with ImageReader(path) as image:          # open(): validates everything
            image.inventory
            proc = image.process(pid)             # ProcessImage
            for run in image.page_runs(pid):
                data = image.read_pages(pid, run) # or pages_location() for bulk reads

    open() raises NotAnImage (no directory / no inventory.img), BadMagic,
    UnsupportedVersion or CorruptImage (truncated, checksum mismatch,
    undecodable or missing entries, missing per-process files, bad page runs).
    `verify_pages=False` skips the checksum pass over the page data (it reads
    all of it); pages_crc_ok() can do it later.  `memory=False` reads the records
    only, not the page maps (a dump's check of the image it has just written:
    its page runs are its own); the page methods are then not to be called.
    """

    def __init__(self, directory: str | os.PathLike, *, verify_pages: bool = True, defer_frames: bool = False,
                 pages_from: PagesSource | None = None, memory: bool = True):
        self.path = os.path.abspath(os.fspath(directory))
        self.verify_pages = verify_pages
        self.memory = memory
        # page data a dump sent to a page server (PAGE_SERVER): where it comes from; without
        # one (and no pages-PID.img beside), the image is read but its pages cannot be
        self.pages_from = pages_from
        self._remote: dict[int, PageServerPages] = {}
        # compressed page data left compressed until a lazy restore's page server needs
        # each frame (page_sources gives an empty memfd of the raw size; lazy_checks the frames)
        self.defer_frames = defer_frames
        self._deferred: dict[int, compression.FrameSpec] = {}
        self.inventory: Inventory | None = None
        self.zombies: tuple[Zombie, ...] = ()      # image-wide records of inventory.img
        self.pipes: tuple[PipeBuffer, ...] = ()
        self.unix_sockets: tuple[UnixSocket, ...] = ()
        self.sysv: tuple[ShmImage | SemImage | MsgImage, ...] = ()
        self.ghost_files: tuple[GhostFile, ...] = ()
        self.saved_files: tuple[SavedFile, ...] = ()
        self.fd_states: tuple = ()                # EventfdState ... EpollState, by desc
        self.terminals: tuple[Terminal, ...] = ()
        self.ptys: tuple[Pty, ...] = ()
        self.inet_sockets: tuple[InetSocket, ...] = ()
        self.netlink_sockets: tuple[NetlinkSocket, ...] = ()
        self.in_flight: tuple[Fd, ...] = ()       # descriptions in flight in unix sockets
        self.plugin_data: tuple[PluginData, ...] = ()
        self.version = 0                          # format version of inventory.img
        self._processes: dict[int, ProcessImage] = {}
        self._unknown: dict[int, tuple[RawEntry, ...]] = {}
        self._runs: dict[int, list[PageRun]] = {}
        self._pages: dict[int, tuple[int, FileHeader]] = {}     # pid -> (fd, header)
        self._sums: dict[int, PageSums] = {}                    # pid -> block sums (format 10)
        self._parent_pages: dict[int, list[ParentPages]] = {}   # pid -> ranges the parent holds
        self._frames: dict[int, list[tuple[int, int]]] = {}     # pid -> (raw, stored) per frame
        self._raw_length: dict[int, int] = {}                   # pid -> bytes of raw page data
        self._frames_entry: dict[int, PageFrames] = {}
        self._unpacked: dict[int, int] = {}                     # pid -> memfd of decompressed data
        self._resolved: dict[int, tuple[list[PageRun], list[tuple[int, ImageReader]]]] = {}
        self.parent: ImageReader | None = None                  # an incremental image's parent

    # --- lifecycle -------------------------------------------------------------

    def open(self) -> ImageReader:
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for fd, _header in self._pages.values():
            if fd >= 0:
                os.close(fd)
        self._pages.clear()
        for fd in self._unpacked.values():
            os.close(fd)
        self._unpacked.clear()
        if self.parent is not None:
            self.parent.close()

    def __enter__(self) -> ImageReader:
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    # --- access ------------------------------------------------------------------

    @property
    def pids(self) -> tuple[int, ...]:
        return self.inventory.pids

    def process(self, pid: int) -> ProcessImage:
        return self._processes[pid]

    def unknown_entries(self, pid: int) -> tuple[RawEntry, ...]:
        """Entries of core-PID.img of kinds this version does not know."""
        return self._unknown[pid]

    def page_runs(self, pid: int) -> list[PageRun]:
        """Every saved page of the process, by run.  In an incremental image these are its own
        runs and those its parents hold for it; offsets are then in a space spanning the
        chain's page data (pages_location() and page_sources() find the file)."""
        return list(self._resolve(pid)[0])

    def own_page_runs(self, pid: int) -> list[PageRun]:
        """The runs of pages this image itself stores (offsets: its own raw page data)."""
        return list(self._runs[pid])

    def parent_pages(self, pid: int) -> list[ParentPages]:
        return list(self._parent_pages.get(pid, ()))

    def pages_length(self, pid: int) -> int:
        """Bytes of page data this image holds for the process (before compression)."""
        return self._raw_length[pid]

    def stored_length(self, pid: int) -> int:
        """Bytes of page data in pages-PID.img, as stored (compressed or not)."""
        return self._pages[pid][1].payload_length

    def compression(self, pid: int) -> str:
        """"zstd:LEVEL" for compressed page data, "" for raw."""
        frames = self._frames_entry.get(pid)
        return f"{frames.codec}:{frames.level}" if frames is not None else ""

    def shared_records(self) -> list:
        """The image-wide records of inventory.img, in order (everything after the INVENTORY)."""
        return self._read_entries(INVENTORY_NAME, FileKind.INVENTORY)[1][1:]

    def chain(self) -> list[str]:
        """This image's directory and its parents', newest first."""
        out, image = [], self
        while image is not None:
            out.append(image.path)
            image = image.parent
        return out

    def page_sources(self, pid: int) -> list[tuple[int, int, list[PageRun]]]:
        """(fd, base, runs) per file holding pages of the process: a run's bytes are at file
        offset base + run.offset of fd (the reader's own fd, valid until close())."""
        out = []
        for vbase, image, mine in self._source_images(pid):
            fd, data_offset = image._raw_data(pid)
            out.append((fd, data_offset - vbase, mine))
        return out

    def lazy_checks(self, pid: int) -> list[pagesums.PagesToCheck | compression.FrameSpec | None]:
        """Beside each of page_sources(pid): how its blocks are checked at first use by a
        lazy restore (fd -1: the checker reads the data where it has it mapped); for
        compressed data left compressed (defer_frames) its frames, each decompressed and
        checked (zstd's checksum, its size) when first needed; None for a file whose data
        must be checked whole before the process runs (an image older than the block sums:
        page_check(lazy=True))."""
        return [image._lazy_check(pid) for _vbase, image, _mine in self._source_images(pid)]

    def _lazy_check(self, pid: int):
        if not self._block_checked(pid):
            return self._deferred.get(pid)
        check = self._pages_to_check(pid, -1)
        if pid in self._remote and self.pages_from is not None and not self._local_remote(pid):
            return self.pages_from.lazy(self._pages[pid][0], check)
        return check

    def _local_remote(self, pid: int) -> bool:
        """Whether the page data of a PAGE_SERVER image is here after all (pages-PID.img)."""
        return os.path.exists(self._file(pages_name(pid)))

    def _source_images(self, pid: int):
        """(virtual base, image, its runs) for each image of the chain holding pages of `pid`."""
        runs, bases = self._resolve(pid)
        for i, (vbase, image) in enumerate(bases):
            vend = bases[i + 1][0] if i + 1 < len(bases) else 2**63
            mine = [r for r in runs if vbase <= r.offset < vend]
            if mine:
                yield vbase, image, mine

    def _block_checked(self, pid: int) -> bool:
        return pid not in self._frames and self._sums.get(pid) is not None

    def pages_crc32(self, pid: int) -> int:
        """The checksum pages-PID.img's header records for its data."""
        return self._pages[pid][1].crc32

    def pages_location(self, pid: int, run: PageRun) -> tuple[int, int]:
        """(fd, file offset) of a run's data (a run of page_runs()), for bulk reads
        (pread/preadv/mmap/splice).

        The fd is the reader's own, read-only; it stays valid until close().
        """
        _runs, bases = self._resolve(pid)
        i = max(0, bisect.bisect_right([b for b, _ in bases], run.offset) - 1)
        vbase, image = bases[i]
        fd, data_offset = image._raw_data(pid)
        return fd, data_offset + run.offset - vbase

    def _raw_data(self, pid: int) -> tuple[int, int]:
        """(fd, offset of the raw page data) of this image's own pages: pages-PID.img, or
        a memfd its compressed frames were decompressed into (on first use)."""
        if pid not in self._frames:
            return self._own_fd(pid), PAGES_DATA_OFFSET
        if pid not in self._unpacked:
            fd = os.memfd_create(f"ptckpt-pages-{pid}", os.MFD_CLOEXEC)
            try:
                if self.defer_frames:
                    os.ftruncate(fd, sum(raw for raw, _stored in self._frames[pid]))
                    self._deferred[pid] = compression.FrameSpec(self._own_fd(pid), PAGES_DATA_OFFSET,
                                                                self._frames[pid], fd,
                                                                self._file(pages_name(pid)))
                else:
                    compression.decompress_to_fd(self._own_fd(pid), PAGES_DATA_OFFSET, self._frames[pid], fd,
                                                 self._file(pages_name(pid)))
            except BaseException:
                os.close(fd)
                raise
            self._unpacked[pid] = fd
        return self._unpacked[pid], 0

    def _resolve(self, pid: int) -> tuple[list[PageRun], list[tuple[int, ImageReader]]]:
        """(runs, [(virtual base, image)]): every page of the process along the chain,
        offsets shifted so that each image's data has a range of its own."""
        if pid in self._resolved:
            return self._resolved[pid]
        runs = list(self._runs[pid])
        bases: list[tuple[int, ImageReader]] = [(0, self)]
        ranges = sorted((p.vaddr, p.vaddr + p.npages * PAGE_SIZE) for p in self._parent_pages.get(pid, ()))
        if ranges:
            shift = self._raw_length[pid]
            parent_runs, parent_bases = self.parent._resolve(pid)
            bases += [(b + shift, image) for b, image in parent_bases]
            starts = [s for s, _ in ranges]
            for r in sorted(parent_runs, key=lambda r: r.vaddr):
                end = r.vaddr + r.npages * PAGE_SIZE
                i = max(0, bisect.bisect_right(starts, r.vaddr) - 1)
                while i < len(ranges) and ranges[i][0] < end:
                    a, b = max(ranges[i][0], r.vaddr), min(ranges[i][1], end)
                    if a < b:
                        runs.append(PageRun(a, (b - a) // PAGE_SIZE, shift + r.offset + a - r.vaddr))
                    i += 1
        self._resolved[pid] = (runs, bases)
        return self._resolved[pid]

    def read_pages(self, pid: int, run: PageRun) -> bytes:
        fd, offset = self.pages_location(pid, run)
        size = run.npages * PAGE_SIZE
        data = _pread_exact(fd, size, offset)
        if len(data) != size:
            raise CorruptImage(self._file(pages_name(pid)), f"truncated page data at offset {run.offset}")
        return data

    def read_memory(self, pid: int, start: int, end: int) -> bytes | None:
        """The saved bytes of the process's memory [start, end), along the chain; None where
        a page of it was not saved.  Compressed data not unpacked yet stays so: only the
        frames holding these bytes are decompressed."""
        out = bytearray(end - start)
        have = 0
        for vbase, image, mine in self._source_images(pid):
            for r in mine:
                s, e = max(r.vaddr, start), min(r.vaddr + r.npages * PAGE_SIZE, end)
                if s < e:
                    out[s - start:e - start] = image._raw_bytes(pid, r.offset - vbase + (s - r.vaddr), e - s)
                    have += e - s
        return bytes(out) if have == end - start else None

    def _raw_bytes(self, pid: int, offset: int, length: int) -> bytes:
        """`length` bytes of this image's own raw page data from `offset`."""
        path = self._file(pages_name(pid))
        if pid not in self._frames or pid in self._unpacked and pid not in self._deferred:
            fd, data_offset = self._raw_data(pid)
            data = _pread_exact(fd, length, data_offset + offset)
        else:
            parts, raw_pos, stored_pos = [], 0, PAGES_DATA_OFFSET
            for raw, stored in self._frames[pid]:
                if raw_pos < offset + length and offset < raw_pos + raw:
                    frame = compression.decompress_frame(compression.decompressor(),
                                                         _pread_exact(self._pages[pid][0], stored, stored_pos),
                                                         raw, path, stored_pos)
                    parts.append(frame[max(offset - raw_pos, 0):offset + length - raw_pos])
                raw_pos, stored_pos = raw_pos + raw, stored_pos + stored
            data = b"".join(parts)
        if len(data) != length:
            raise CorruptImage(path, f"page data ends early at offset {offset}")
        return data

    def pages_crc_ok(self, pid: int) -> bool:  # (this image's own file)
        """Whether the page data matches the crc32 its PAGES header records."""
        fd, header = self._own_fd(pid), self._pages[pid][1]
        try:
            pagesums.verify(pagesums.PagesToCheck(self._file(pages_name(pid)), fd, PAGES_DATA_OFFSET,
                                                  header.payload_length, crc32=header.crc32))
        except CorruptImage:
            return False
        return True

    def page_check(self, lazy: bool = False) -> pagesums.PageCheck:
        """Check every process's page data in a thread, started now: by block where the
        image has block sums, else its crc32.  Its wait() raises CorruptImage naming the
        file (and the offset).  `lazy`: only the files a lazy restore cannot check block
        by block as it serves them (lazy_checks)."""
        return pagesums.PageCheck(self._all_to_check(lazy))

    def _all_to_check(self, lazy: bool) -> list[pagesums.PagesToCheck]:
        own = [self._pages_to_check(pid, os.dup(self._pages[pid][0])) for pid in self.inventory.pids
               if self._pages[pid][0] >= 0
               and not (lazy and (self._block_checked(pid) or self.defer_frames and pid in self._frames))]
        return own + (self.parent._all_to_check(lazy) if self.parent is not None else [])

    def _pages_to_check(self, pid: int, fd: int) -> pagesums.PagesToCheck:
        header = self._pages[pid][1]
        sums = self._sums.get(pid)
        return pagesums.PagesToCheck(self._file(pages_name(pid)), fd, PAGES_DATA_OFFSET, header.payload_length,
                                     sums.block_size if sums else 0, sums.sums if sums else b"", header.crc32)

    # --- validation --------------------------------------------------------------

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _require_inventory(self) -> None:
        """NotAnImage without an inventory; ImageAccessDenied when the user may not look."""
        try:
            os.stat(self._file(INVENTORY_NAME))
        except PermissionError:
            try:
                owner = os.stat(self.path).st_uid
            except OSError:
                owner = None
            raise ImageAccessDenied(self.path, owner) from None
        except OSError:
            raise NotAnImage(self.path, f"no {INVENTORY_NAME}, not a ptckpt image") from None

    def _open(self) -> None:
        if not os.path.isdir(self.path):
            try:
                st = os.stat(self.path)
            except OSError:
                raise NotAnImage(self.path, "no such directory") from None
            raise NotAnImage(self.path, f"{_kind_of(st.st_mode)}, not a directory (an image is a directory)")
        self._require_inventory()
        header, entries = self._read_entries(INVENTORY_NAME, FileKind.INVENTORY)
        self.version = header.version
        inventories = [e for e in entries if isinstance(e, Inventory)]
        if len(inventories) != 1:
            raise CorruptImage(self._file(INVENTORY_NAME), f"{len(inventories)} INVENTORY entries, expected 1")
        self.inventory = inventories[0]
        self.zombies = tuple(e for e in entries if isinstance(e, Zombie))
        self.pipes = tuple(e for e in entries if isinstance(e, PipeBuffer))
        self.unix_sockets = tuple(e for e in entries if isinstance(e, UnixSocket))
        self.sysv = tuple(e for e in entries if isinstance(e, (ShmImage, SemImage, MsgImage)))
        self.ghost_files = tuple(e for e in entries if isinstance(e, GhostFile))
        self.saved_files = tuple(e for e in entries if isinstance(e, SavedFile))
        self.fd_states = tuple(e for e in entries if isinstance(e, FD_STATE_TYPES))
        self.terminals = tuple(e for e in entries if isinstance(e, Terminal))
        self.ptys = tuple(e for e in entries if isinstance(e, Pty))
        self.inet_sockets = tuple(e for e in entries if isinstance(e, InetSocket))
        self.netlink_sockets = tuple(e for e in entries if isinstance(e, NetlinkSocket))
        self.in_flight = tuple(e.fd for e in entries if isinstance(e, InFlightFd))
        self.plugin_data = tuple(e for e in entries if isinstance(e, PluginData))
        if len(set(self.inventory.pids)) != len(self.inventory.pids):
            raise CorruptImage(self._file(INVENTORY_NAME), "duplicate pids")
        validate.refuse(self._file, validate.check_inventory, INVENTORY_NAME, self.inventory)
        for pid in self.inventory.pids:
            self._load_process(pid)
        validate.refuse(self._file, validate.check_tree, INVENTORY_NAME, self.inventory.root_pid, self._processes)
        if self.inventory.parent:
            self._open_parent()
        descs = {f.desc for p in self._processes.values() for f in p.fds}
        validate.refuse(self._file, validate.check_shared, INVENTORY_NAME, entries, set(self.inventory.pids), descs)

    def _load_process(self, pid: int) -> None:
        name = core_name(pid)
        _header, entries = self._read_entries(name, FileKind.CORE)
        self._processes[pid], self._unknown[pid] = self._assemble(name, pid, entries)
        spans = validate.refuse(self._file, validate.check_process, name, pid, self._processes[pid],
                                self.inventory.xstate_size)
        if not self.memory:
            return
        name = pagemap_name(pid)
        _header, entries = self._read_entries(name, FileKind.PAGEMAP)
        self._runs[pid] = [e for e in entries if isinstance(e, PageRun)]
        sums = [e for e in entries if isinstance(e, PageSums)]
        parents = [e for e in entries if isinstance(e, ParentPages)]
        frames = [e for e in entries if isinstance(e, PageFrames)]
        remote = [e for e in entries if isinstance(e, PageServerPages)]

        name = pages_name(pid)
        fd, header = self._open_remote(pid, remote) if remote else self._open_file(name, FileKind.PAGES)
        self._pages[pid] = (fd, header)
        raw_length = self._check_frames(pid, frames, header.payload_length)
        self._raw_length[pid] = raw_length
        for run in self._runs[pid]:
            if (run.npages <= 0 or run.vaddr % PAGE_SIZE or run.offset % PAGE_SIZE
                    or run.offset + run.npages * PAGE_SIZE > raw_length):
                raise CorruptImage(self._file(pagemap_name(pid)),
                                   f"page run vaddr={run.vaddr:#x} npages={run.npages} offset={run.offset} "
                                   f"does not fit {name} ({raw_length} data bytes)")
        if parents and not self.inventory.parent:
            raise CorruptImage(self._file(pagemap_name(pid)), "PAGE_PARENT entries in an image without a parent")
        for p in parents:
            if p.npages <= 0 or p.vaddr % PAGE_SIZE or p.vaddr < 0:
                raise CorruptImage(self._file(pagemap_name(pid)), f"PAGE_PARENT {p.vaddr:#x}+{p.npages}")
        self._parent_pages[pid] = parents
        validate.refuse(self._file, validate.check_page_runs, pagemap_name(pid),
                        self._runs[pid] + [PageRun(p.vaddr, p.npages, 0) for p in parents], spans)
        if sums or self.version >= PAGE_SUMS_SINCE:
            self._sums[pid] = self._check_sums(pid, sums, header.payload_length)
        if self.verify_pages and fd >= 0:
            pagesums.verify(self._pages_to_check(pid, fd))

    def _open_remote(self, pid: int, remote: list[PageServerPages]) -> tuple[int, FileHeader]:
        """(fd, header) of page data a dump sent to a page server: pages-PID.img here if it
        was brought beside the records (the same header), else what `pages_from` gives
        (fetched, or to be fetched as needed), else -1 (the records can be read, the pages not)."""
        name = pages_name(pid)
        if len(remote) > 1:
            raise CorruptImage(self._file(pagemap_name(pid)), f"{len(remote)} PAGE_SERVER entries")
        r = self._remote[pid] = remote[0]
        header = FileHeader(FileKind.PAGES, self.version, r.length, r.crc32)
        if os.path.exists(self._file(name)):
            fd, here = self._open_file(name, FileKind.PAGES)
            if (here.payload_length, here.crc32) != (r.length, r.crc32):
                os.close(fd)
                raise CorruptImage(self._file(name), f"not the page data the dump sent to {r.address} "
                                                     f"({here.payload_length} bytes, crc {here.crc32:#010x}; "
                                                     f"{r.length}, {r.crc32:#010x} expected)")
            return fd, here
        if self.pages_from is None:
            return -1, header
        return self.pages_from.open(r, self._file(name)), header

    def remote_pages(self, pid: int) -> PageServerPages | None:
        """Where a page server holds the process's page data (dump --page-server), or None."""
        return self._remote.get(pid)

    def _own_fd(self, pid: int) -> int:
        fd = self._pages[pid][0]
        if fd < 0:
            r = self._remote[pid]
            raise PagesOnServer(self.path, r.address, r.path)
        return fd

    def _check_frames(self, pid: int, frames: list[PageFrames], stored: int) -> int:
        """The raw length of the page data: its stored length, or what the frames add up to."""
        if not frames:
            return stored
        path = self._file(pagemap_name(pid))
        if len(frames) > 1:
            raise CorruptImage(path, f"{len(frames)} PAGE_FRAMES entries")
        f = frames[0]
        try:
            compression.parse_spec(f"{f.codec}:{f.level}")
            sizes = compression.unpack_sizes(f.sizes)
        except ValueError as err:
            raise CorruptImage(path, f"PAGE_FRAMES: {err}") from None
        if sum(s for _r, s in sizes) != stored or any(r <= 0 or r > compression.FRAME or s <= 0 for r, s in sizes):
            raise CorruptImage(path, f"PAGE_FRAMES sizes do not match {stored} stored bytes")
        self._frames[pid] = sizes
        self._frames_entry[pid] = f
        return sum(r for r, _s in sizes)

    def _open_parent(self) -> None:
        """An incremental image's parent, which must be the very image it was dumped against."""
        inv = self.inventory
        where = os.path.normpath(os.path.join(self.path, inv.parent))
        if inv.parent_id == inv.image_id or not inv.parent_id:
            raise CorruptImage(self._file(INVENTORY_NAME), f"parent image id {inv.parent_id!r}")
        try:
            parent = ImageReader(where, verify_pages=self.verify_pages, defer_frames=self.defer_frames,
                                 memory=self.memory).open()
        except NotAnImage as err:
            raise ParentMissing(self.path, where, str(err)) from None
        self.parent = parent
        if parent.inventory.image_id != inv.parent_id:
            raise ParentMissing(self.path, where, f"it is another image than the one this image was dumped "
                                                  f"against (id {parent.inventory.image_id or 'none'}, "
                                                  f"expected {inv.parent_id})")
        for pid in inv.pids:
            if self._parent_pages.get(pid) and pid not in parent.inventory.pids:
                raise ParentMissing(self.path, where, f"it has no process {pid}")

    def _check_sums(self, pid: int, sums: list[PageSums], length: int) -> PageSums:
        path = self._file(pagemap_name(pid))
        if self.version < PAGE_SUMS_SINCE or len(sums) != 1:
            raise CorruptImage(path, f"{len(sums)} PAGE_SUMS entries in a format {self.version} image "
                                     f"(one from format {PAGE_SUMS_SINCE} on)")
        s = sums[0]
        if s.block_size <= 0 or s.block_size % PAGE_SIZE or s.block_size > pagesums.MAX_BLOCK or \
                len(s.sums) != 8 * pagesums.block_count(length, s.block_size):
            raise CorruptImage(path, f"PAGE_SUMS of {len(s.sums)} bytes for blocks of {s.block_size} bytes "
                                     f"does not match {length} bytes of page data")
        return s

    def _assemble(self, name: str, pid: int, entries) -> tuple[ProcessImage, tuple[RawEntry, ...]]:
        single: dict[type, object] = {}
        lists: dict[type, list] = {Rlimit: [], Vma: [], Thread: [], Sigaction: [], PendingSignal: [], Fd: [],
                                   HeldLock: [], PosixTimer: [], Itimer: [], FdOwner: [], AioRing: []}
        unknown = []
        for entry in entries:
            if isinstance(entry, RawEntry):
                unknown.append(entry)
            elif type(entry) in lists:
                lists[type(entry)].append(entry)
            elif type(entry) in (Task, Creds, Mm):
                if type(entry) in single:
                    raise CorruptImage(self._file(name), f"more than one {type(entry).__name__.upper()} entry")
                single[type(entry)] = entry
        for cls in (Task, Creds, Mm):
            if cls not in single:
                raise CorruptImage(self._file(name), f"no {cls.__name__.upper()} entry")
        task = single[Task]
        if task.pid != pid:
            raise CorruptImage(self._file(name), f"TASK entry is for pid {task.pid}")
        proc = ProcessImage(
            task=task, creds=single[Creds], mm=single[Mm],
            rlimits=tuple(lists[Rlimit]), vmas=tuple(lists[Vma]), threads=tuple(lists[Thread]),
            sigactions=tuple(lists[Sigaction]), pending=tuple(lists[PendingSignal]),
            fds=tuple(lists[Fd]), locks=tuple(lists[HeldLock]), timers=tuple(lists[PosixTimer]),
            itimers=tuple(lists[Itimer]), owners=tuple(lists[FdOwner]),
            aio_rings=tuple(lists[AioRing]))
        return proc, tuple(unknown)

    @classmethod
    def read_inventory(cls, directory: str | os.PathLike) -> Inventory:
        """Only the INVENTORY record (the first entry of inventory.img), its file's header
        and checksum validated: what the image is, without decoding what it holds."""
        reader = cls(directory)
        reader._require_inventory()
        _header, entries = reader._read_entries(INVENTORY_NAME, FileKind.INVENTORY, first_only=True)
        if not entries or not isinstance(entries[0], Inventory):
            raise CorruptImage(reader._file(INVENTORY_NAME), "the first entry is not the INVENTORY")
        return entries[0]

    def _read_entries(self, name: str, kind: FileKind, *, first_only: bool = False) -> tuple[FileHeader, list]:
        fd, header = self._open_file(name, kind)
        path = self._file(name)
        try:
            try:
                payload = _pread_exact(fd, header.payload_length, HEADER_SIZE)
            except OSError as err:
                raise CorruptImage(path, f"cannot read: {err.strerror}") from err
        finally:
            os.close(fd)
        if len(payload) != header.payload_length:
            raise CorruptImage(path, "truncated payload (file shrank while reading)")
        crc = zlib.crc32(payload)
        if crc != header.crc32:
            raise CorruptImage(path, f"checksum mismatch (header {header.crc32:#010x}, data {crc:#010x})")
        if first_only and len(payload) >= ENTRY_HEADER_SIZE:
            payload = payload[:ENTRY_HEADER_SIZE + int.from_bytes(payload[4:8], "little")]
        try:
            entries = decode_entries(payload, version=header.version)
        except EntryDecodeError as err:
            raise CorruptImage(path, str(err)) from err
        allowed = FILE_ENTRY_KINDS[kind]
        for entry in entries:
            if isinstance(entry, RawEntry):
                # Only a newer writer knows more kinds, and a newer image is refused by its
                # version: in an image of a version we read, an unknown kind is damage (and
                # what it held would be lost).
                raise CorruptImage(path, f"an entry of unknown kind {entry.kind}")
            else:
                entry_kind = KIND_OF[type(entry)]
                if entry_kind not in allowed:
                    raise CorruptImage(path, f"{entry_kind.name} entry in a {kind.name} file")
        return header, entries

    def _open_file(self, name: str, kind: FileKind) -> tuple[int, FileHeader]:
        """Open `name` read-only and validate magic, version, kind and length; returns (fd, header)."""
        path = self._file(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CorruptImage(path, "missing") from None
        except OSError as err:
            raise CorruptImage(path, f"cannot open: {err.strerror}") from err
        try:
            header = self._check_header(fd, path, kind)
        except BaseException:
            os.close(fd)
            raise
        return fd, header

    def _check_header(self, fd: int, path: str, kind: FileKind) -> FileHeader:
        try:
            size = os.fstat(fd).st_size
            head = _pread_exact(fd, PAGES_DATA_OFFSET if kind == FileKind.PAGES else HEADER_SIZE, 0)
        except OSError as err:
            raise CorruptImage(path, f"cannot read: {err.strerror}") from err
        if len(head) >= len(MAGIC) and head[:len(MAGIC)] != MAGIC:
            raise BadMagic(path, head[:len(MAGIC)])
        if len(head) < HEADER_SIZE:
            raise CorruptImage(path, f"truncated header ({len(head)} of {HEADER_SIZE} bytes)")
        header = parse_header(head[:HEADER_SIZE])
        if head[20:HEADER_SIZE] != bytes(HEADER_SIZE - 20):
            raise CorruptImage(path, "non-zero reserved header bytes")
        if header.version > FORMAT_VERSION:
            raise UnsupportedVersion(path, header.version, FORMAT_VERSION)
        if header.version < 1:
            raise CorruptImage(path, f"format version {header.version}")
        if header.file_kind != kind:
            found = header.file_kind.name if isinstance(header.file_kind, FileKind) else header.file_kind
            raise CorruptImage(path, f"file kind {found}, expected {kind.name}")
        data_offset = HEADER_SIZE
        if kind == FileKind.PAGES:
            data_offset = PAGES_DATA_OFFSET
            if len(head) < PAGES_DATA_OFFSET:
                raise CorruptImage(path, f"truncated header ({len(head)} of {PAGES_DATA_OFFSET} bytes)")
            if head[HEADER_SIZE:].count(0) != PAGES_DATA_OFFSET - HEADER_SIZE:
                raise CorruptImage(path, "non-zero header padding")
        expected = data_offset + header.payload_length
        if size < expected:
            raise CorruptImage(path, f"truncated: {size} bytes, header says {expected}")
        if size > expected:
            raise CorruptImage(path, f"{size - expected} unexpected bytes after the payload")
        return header


def _kind_of(mode: int) -> str:
    """What a path that is not a directory is, for a message: "a file", "a symbolic link" ..."""
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a directory"

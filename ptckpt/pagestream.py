"""Page data over the network, without the local disk: ``dump --page-server ADDRESS`` sends
the pages to ``ptckpt page-server`` as it reads them, ``restore --page-server ADDRESS``
takes them from there (all before the rebuild, or with ``--lazy`` block by block as the
restored processes touch them).

As with CRIU's ``dump --page-server``, the image directory stays where the dump ran and
holds every record but the page data: each pagemap-PID.img says where its pages went
(a PAGE_SERVER record: the address, the path there, the data's length and crc32).  The
page server keeps each process's data as ``pages/IMAGE_ID/pages-PID.img`` under its
directory, a PAGES file like any image's: copied beside the records, it makes the image
whole again (``restore`` without ``--page-server`` then reads it there).

The requests of the page server's protocol (ptckpt.transfer: a token-authenticated
connection, JSON messages) this module adds, both halves side by side:

* ``{"op": "write", "path": P, "offset": O, "size": N}`` + N bytes: written at offset O of
  file P (no reply: the data streams).  ``{"op": "discard", "path": P}``: P removed.
* ``{"op": "seal"}``: every file this connection wrote fsync'd; answers ``{"ok": true}``.
  A connection that ends before its seal leaves nothing: what it wrote is removed.
* ``{"op": "stat", "path": P}``: ``{"ok": true, "size": S}``.
* ``{"op": "read", "path": P, "offset": O, "size": N}``: ``{"ok": true, "size": n}`` and
  n bytes (fewer only at the end of the file), or ``{"ok": false, "error": ...}``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading

from . import transfer
from .errors import CorruptImage, TransferError
from .formats import pagesums
from .formats.model import PageServerPages
from .formats.records import PAGES_DATA_OFFSET, FileKind, build_header

log = logging.getLogger("ptckpt.pagestream")

FETCH_TIMEOUT = 30.0          # seconds a restore waits for the page server before it gives up
_CHUNK = 8 << 20              # bytes per request of an eager fetch


def server_path(image_id: str, name: str) -> str:
    return f"pages/{image_id}/{name}"


# --- dump side ------------------------------------------------------------------------

class PageServerSink:
    """The ImageWriter's PagesSink: page data written to files of the page server at
    `address`, as pages/IMAGE_ID/NAME.  Connects at once, so that a dump that cannot
    reach the server (or is refused) fails before it touches the process."""

    def __init__(self, address: str, token: bytes):
        self.address = address
        self.chan = transfer.connect(address, token)
        self.image_id = ""                      # the ImageWriter's, set before any page is sent
        self.sent = 0
        self._lock = threading.Lock()

    def _path(self, name: str) -> str:
        return server_path(self.image_id, name)

    def pwrite(self, name: str, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        with self._lock:
            self.chan.send({"op": "write", "path": self._path(name), "offset": offset, "size": len(view)})
            self.chan.sendall(view)
            self.sent += len(view)

    def record(self, name: str, length: int, crc32: int) -> PageServerPages:
        return PageServerPages(self.address, self._path(name), length, crc32)

    def discard(self, name: str) -> None:
        with self._lock:
            self.chan.send({"op": "discard", "path": self._path(name)})

    def seal(self) -> None:
        with self._lock:
            self.chan.send({"op": "seal"})
            reply = self.chan.recv()
            if not reply.get("ok"):
                raise TransferError(f"{self.address}: the page server did not keep the pages: {reply.get('error')}")
            self.chan.send({"op": "bye"})
        self.chan.close()

    def abort(self) -> None:
        """The connection closed without a seal: the server removes what it wrote."""
        self.chan.close()


# --- restore side ---------------------------------------------------------------------

class RemoteSource:
    """The ImageReader's PagesSource: page data read from the page server at `address`.
    Each file becomes a memfd of its size (memory, not disk): filled at open (`lazy`
    False), or left empty for ptckpt.lazypages, which fetches each block as it is first
    needed (:class:`LazyFetch`)."""

    def __init__(self, address: str, token: bytes, *, lazy: bool):
        self.address = address
        self.lazy_mode = lazy
        self.chan = transfer.connect(address, token)
        self.chan.sock.settimeout(FETCH_TIMEOUT)
        self.fetched = 0
        self._lock = threading.Lock()
        self._paths: dict[int, str] = {}        # our memfd -> its path there

    def open(self, record: PageServerPages, here: str) -> int:
        size = self.stat(record.path)
        if size != PAGES_DATA_OFFSET + record.length:
            raise CorruptImage(f"{self.address}:{record.path}", f"{size} bytes there, "
                                                                f"{PAGES_DATA_OFFSET + record.length} expected")
        fd = os.memfd_create(os.path.basename(record.path), os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, build_header(FileKind.PAGES, record.length, record.crc32), 0)
            if not self.lazy_mode and record.length:
                with mmap.mmap(fd, size) as m, memoryview(m) as view:
                    for at in range(PAGES_DATA_OFFSET, size, _CHUNK):
                        self.read_into(record.path, at, view[at:min(at + _CHUNK, size)])
        except BaseException:
            os.close(fd)
            raise
        self._paths[fd] = record.path
        return fd

    def lazy(self, fd: int, check: pagesums.PagesToCheck) -> LazyFetch:
        return LazyFetch(self, self._paths[fd], fd, check)

    def stat(self, path: str) -> int:
        with self._lock:
            self.chan.send({"op": "stat", "path": path})
            reply = self.chan.recv()
        if not reply.get("ok"):
            raise TransferError(f"{self.address}: {reply.get('error')}")
        return int(reply["size"])

    def read_into(self, path: str, offset: int, view: memoryview) -> None:
        """The bytes of `path` there at `offset`, as many as `view` holds."""
        with self._lock:
            self.chan.send({"op": "read", "path": path, "offset": offset, "size": len(view)})
            reply = self.chan.recv()
            if not reply.get("ok"):
                raise TransferError(f"{self.address}: {reply.get('error')}")
            if int(reply["size"]) != len(view):
                raise CorruptImage(f"{self.address}:{path}", f"ends before byte {offset + len(view)}")
            self.chan.recv_into(view)
        self.fetched += len(view)

    def fileno(self) -> int:
        return self.chan.sock.fileno()

    def close(self) -> None:
        """Our end closed (a lazy page server process may hold another: it goes on)."""
        self.chan.close()


class LazyFetch:
    """How ptckpt.lazypages gets one remote file's blocks: each fetched into the memfd
    (mapped by the lazy server at `addr`) the first time it is needed, then checked."""

    def __init__(self, source: RemoteSource, path: str, fd: int, check: pagesums.PagesToCheck):
        self.source, self.path, self.fd, self.check = source, path, fd, check

    @property
    def where(self) -> str:
        return f"{self.source.address}:{self.path}"

    def fetch(self, addr: int, offset: int, length: int) -> None:
        """File bytes [offset, offset+length) into the mapping at `addr` (the file's start)."""
        buf = (ctypes.c_char * length).from_address(addr + offset)
        with memoryview(buf).cast("B") as view:
            self.source.read_into(self.path, offset, view)

    def keep_fds(self) -> set[int]:
        return {self.source.fileno()}

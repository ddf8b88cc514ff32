"""The page server's side of streamed page data (``dump --page-server``, ``restore
--page-server``): a connection's streams, written as they come (O_DIRECT) and kept only once
the dump seals them, and the reads a restore asks for.  ptckpt.transfer.PageServer hands a
connection's stream requests here; the client side is ptckpt.pagestream."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from typing import TYPE_CHECKING

from .errors import TransferError

if TYPE_CHECKING:
    from .transfer import Channel

log = logging.getLogger("ptckpt.pagestore")

OPS = frozenset({"write", "discard", "seal", "stat", "read"})   # what a connection may ask of its streams
_MAX_WRITE = 16 << 20         # the largest piece of page data one write request carries


# --- server side ----------------------------------------------------------------------

class StreamSession:
    """One connection's page streams at the page server (ptckpt.transfer.PageServer):
    the files it writes (removed unless sealed) and the files it reads."""

    def __init__(self, directory: str, path_of, make_dirs):
        self.directory = directory
        self.path_of = path_of                  # the server's check of a relative path
        self.make_dirs = make_dirs              # (top, path): private directories down to path
        self.open: dict[str, int] = {}          # path -> fd, written by this connection
        self.direct: dict[str, int] = {}        # path -> its O_DIRECT fd (page data bypasses the cache)
        self.sealed = False
        self._map = mmap.mmap(-1, _MAX_WRITE)   # page-aligned, as O_DIRECT wants
        self._buffer = memoryview(self._map)

    def _direct(self, path: str, fd: int) -> int:
        """An O_DIRECT fd of `path` (written pages do not fill this host's page cache; a
        restore reads each block once), or `fd` where the file system refuses it."""
        if path not in self.direct:
            try:
                self.direct[path] = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:
                self.direct[path] = fd
        return self.direct[path]

    def _close(self, path: str) -> None:
        fd = self.open.pop(path, -1)
        direct = self.direct.pop(path, -1)
        for f in {fd, direct} - {-1}:
            os.close(f)

    def handle(self, chan: Channel, msg: dict) -> None:
        op = msg["op"]
        if op == "write":
            self._write(chan, msg)
        elif op == "discard":
            path = self.path_of(str(msg.get("path", "")))
            self._close(path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        elif op == "seal":
            chan.send(self._seal())
        elif op == "stat":
            try:
                chan.send({"ok": True, "size": os.stat(self.path_of(str(msg.get("path", "")))).st_size})
            except (OSError, TransferError) as err:
                chan.send({"ok": False, "error": f"no {msg.get('path')!r} there ({_why(err)})"})
        elif op == "read":
            self._read(chan, msg)

    def _write(self, chan: Channel, msg: dict) -> None:
        from . import testhooks
        testhooks.reached("page-server-write")
        path = self.path_of(str(msg["path"]))
        fd = self.open.get(path)
        if fd is None:
            self.make_dirs(self.directory, os.path.dirname(path))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            self.open[path] = fd
        offset, size = int(msg["offset"]), int(msg["size"])
        if size > _MAX_WRITE:
            raise TransferError(f"a write of {size} bytes (at most {_MAX_WRITE})")
        view = self._buffer[:size]
        chan.recv_into(view)
        target = fd
        if size % mmap.PAGESIZE == 0 and offset % mmap.PAGESIZE == 0:
            target = self._direct(path, fd)
        at = 0
        while at < size:
            at += os.pwrite(target, view[at:], offset + at)

    def _seal(self) -> dict:
        try:
            for fd in self.open.values():
                os.fsync(fd)
        except OSError as err:
            return {"ok": False, "error": _why(err)}
        for path in list(self.open):
            self._close(path)
        self.sealed = True
        return {"ok": True}

    def _read(self, chan: Channel, msg: dict) -> None:
        try:
            fd = os.open(self.path_of(str(msg.get("path", ""))), os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, TransferError) as err:
            chan.send({"ok": False, "error": f"cannot read {msg.get('path')!r} there ({_why(err)})"})
            return
        try:
            offset, size = int(msg["offset"]), int(msg["size"])
            size = max(0, min(size, os.fstat(fd).st_size - offset))
            chan.send({"ok": True, "size": size})
            chan.sendfile(fd, offset, size)
        finally:
            os.close(fd)

    def end(self) -> None:
        """The connection is over: what it wrote without sealing goes."""
        self._buffer.release()
        self._map.close()
        if not self.open:
            return
        paths = list(self.open)
        for path in paths:
            self._close(path)
            with contextlib.suppress(OSError):
                os.unlink(path)
            log.warning("page server: %s removed: its dump did not finish", path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(paths[0]))


def _why(err: BaseException) -> str:
    return getattr(err, "strerror", None) or str(err)

"""Page data checked block by block: an xxh3-64 hash of every BLOCK bytes of a
pages-PID.img's data (the last block may be shorter), kept beside the page runs in
pagemap-PID.img (a PAGE_SUMS entry, format 10).

Dump side: :class:`BlockHasher` is fed the page data as it is written.  Restore side:
:func:`verify` reads the data back and names the first block that differs, by its offset
in the file; :class:`PageCheck` runs it in a thread beside the restore (the reads and the
hashing release the GIL), so that the pages are checked while the new process reads them
into its memory, and the restore asks for the verdict before the process runs a single
instruction of its own.  Images older than format 10 have only the whole-file crc32 of
the PAGES header: the same thread checks that instead (and cannot name an offset).
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from ptckpt.errors import CorruptImage

BLOCK = 1 << 20                       # bytes of page data per hash
_SUM = struct.Struct("<Q")
_READ = 8 << 20                       # bytes per read of the check (whole blocks)
MAX_BLOCK = 64 << 20                  # the largest block an image may name


class BlockHasher:
    """xxh3-64 of each BLOCK bytes of a stream of page data, fed in pieces of any size."""

    def __init__(self, block: int = BLOCK):
        self.block = block
        self._hash = xxhash.xxh3_64()
        self._filled = 0                  # bytes of the current block hashed so far
        self._sums = bytearray()

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = min(len(view), self.block - self._filled)
            self._hash.update(view[:n])
            self._filled += n
            view = view[n:]
            if self._filled == self.block:
                self._close_block()

    def _close_block(self) -> None:
        self._sums += _SUM.pack(self._hash.intdigest())
        self._hash.reset()
        self._filled = 0

    def sums(self) -> bytes:
        """The hashes of every block so far, the last (partial) one included: 8 bytes each."""
        if self._filled:
            self._close_block()
        return bytes(self._sums)


def block_count(length: int, block: int) -> int:
    return -(-length // block)


@dataclass(frozen=True)
class PagesToCheck:
    """One pages-PID.img: its fd (the checker's own), where the data starts and how long it
    is, and what it must hash to: block sums (format 10) or the header's crc32."""

    path: str
    fd: int
    start: int
    length: int
    block: int = 0
    sums: bytes = b""
    crc32: int = 0


def verify(pages: PagesToCheck, stop: Callable[[], bool] = lambda: False) -> None:
    """Read the page data and compare it with its sums (or crc32): CorruptImage naming the
    first block that differs, by its byte range in the file."""
    step = pages.block * max(1, _READ // pages.block) if pages.sums else _READ   # whole blocks
    view = memoryview(bytearray(min(step, max(pages.length, 1))))
    crc = 0
    done = 0
    while done < pages.length and not stop():
        want = min(step, pages.length - done)
        got = _read_into(pages.fd, view[:want], pages.start + done)
        if got < want:
            raise CorruptImage(pages.path, f"page data ends at byte {pages.start + done + got}, "
                                           f"{pages.length} bytes expected")
        if pages.sums:
            _compare_blocks(pages, view[:want], done)
        else:
            crc = zlib.crc32(view[:want], crc)
        done += want
    if not pages.sums and not stop() and crc != pages.crc32:
        raise CorruptImage(pages.path, "checksum mismatch in page data")


def _compare_blocks(pages: PagesToCheck, data: memoryview, offset: int) -> None:
    for at in range(0, len(data), pages.block):
        i = (offset + at) // pages.block
        piece = data[at:at + pages.block]
        if xxhash.xxh3_64_intdigest(piece) != _SUM.unpack_from(pages.sums, 8 * i)[0]:
            first = pages.start + offset + at
            raise CorruptImage(pages.path, f"checksum mismatch in page data at bytes "
                                           f"{first}-{first + len(piece) - 1} of the file (block {i})")


def _read_into(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


class PageCheck:
    """:func:`verify` of some page files in a thread of its own, started at once; wait()
    gives the verdict (raises what verify raised).  The fds are the check's: it closes them."""

    def __init__(self, files: Sequence[PagesToCheck]):
        self._files = list(files)
        self._error: BaseException | None = None
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="page-check", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for pages in self._files:
                verify(pages, lambda: self._cancelled)
        except BaseException as err:          # noqa: BLE001 - handed to wait()
            self._error = err
        finally:
            for pages in self._files:
                os.close(pages.fd)

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stop reading (the restore failed anyway) and wait for the thread to end."""
        self._cancelled = True
        self._thread.join()

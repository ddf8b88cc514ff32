"""Compressed page data: independent zstd frames of FRAME raw bytes each (format 12).

Each frame compresses on its own, so the dump compresses on every CPU at once and
a reader finds any raw offset's frame from the PAGE_FRAMES sizes without reading
the frames before it.  Pages that are all zero never reach here: the dump leaves
them out of the image altogether.

Dump side: :class:`FrameCompressor` (PagesWriter's compression thread calls it).
Restore side: :func:`decompress_to_fd` writes the raw page data, decompressed on
every CPU, into a file (a memfd the restore reads like an uncompressed image).
"""

from __future__ import annotations

import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zstandard

from ptckpt import progress
from ptckpt.errors import CorruptImage

FRAME = 1 << 20                         # raw bytes per frame
CODECS = ("zstd",)
DEFAULT_LEVEL = 3
_SIZE = struct.Struct("<II")


def parse_spec(spec: str) -> tuple[str, int]:
    """"zstd" or "zstd:LEVEL" -> (codec, level); ValueError says what is wrong."""
    codec, _, level = spec.partition(":")
    if codec not in CODECS:
        raise ValueError(f"unknown compression {codec!r} (known: {', '.join(CODECS)})")
    try:
        value = int(level) if level else DEFAULT_LEVEL
    except ValueError:
        raise ValueError(f"compression level {level!r} is not a number") from None
    if not zstandard.MAX_COMPRESSION_LEVEL >= value >= -(1 << 17) or value == 0:
        raise ValueError(f"zstd level {value} out of range (negative for speed, 1 to "
                         f"{zstandard.MAX_COMPRESSION_LEVEL})")
    return codec, value


def _workers() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def pack_sizes(frames: list[tuple[int, int]]) -> bytes:
    return b"".join(_SIZE.pack(raw, stored) for raw, stored in frames)


def unpack_sizes(blob: bytes) -> list[tuple[int, int]]:
    if len(blob) % _SIZE.size:
        raise ValueError(f"frame sizes of {len(blob)} bytes")
    return list(_SIZE.iter_unpack(blob))


class FrameCompressor:
    """Compresses whole buffers, FRAME bytes to a frame, on a pool of threads (zstd
    releases the GIL); one compressor per thread, frames with their checksum."""

    def __init__(self, codec: str, level: int):
        self.codec, self.level = codec, level
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(_workers(), thread_name_prefix="zstd")

    def _one(self, raw) -> bytes:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(level=self.level, write_checksum=True)
        return c.compress(raw)

    def compress(self, view: memoryview) -> tuple[list[tuple[int, int]], bytes]:
        frames = [view[i:i + FRAME] for i in range(0, len(view), FRAME)]
        outs = list(self._pool.map(self._one, frames))
        return [(len(f), len(o)) for f, o in zip(frames, outs)], b"".join(outs)

    def close(self) -> None:
        self._pool.shutdown()


@dataclass(frozen=True)
class FrameSpec:
    """Compressed page data to decompress a frame at a time: frames from `data_offset` of
    `src` (the image's fd), their (raw, stored) sizes, and the memfd of the raw size
    they go into at their raw offsets (ptckpt.lazypages.Source does it)."""

    src: int
    data_offset: int
    sizes: list[tuple[int, int]]
    raw_fd: int
    path: str

    def stored_end(self) -> int:
        return self.data_offset + sum(stored for _raw, stored in self.sizes)


def decompressor() -> zstandard.ZstdDecompressor:
    return zstandard.ZstdDecompressor()


def decompress_frame(d: zstandard.ZstdDecompressor, data, raw: int, path: str, at: int) -> bytes:
    """One frame's `raw` bytes; CorruptImage (naming `path` and the frame's offset `at`) when it
    does not decompress, its checksum fails, or it holds another size."""
    try:
        out = d.decompress(data, max_output_size=raw)
    except zstandard.ZstdError as err:
        raise CorruptImage(path, f"compressed frame at offset {at}: {err}") from None
    if len(out) != raw:
        raise CorruptImage(path, f"compressed frame at offset {at} holds {len(out)} bytes, not {raw}")
    return out


def decompress_to_fd(src: int, data_offset: int, sizes: list[tuple[int, int]], dst: int, path: str) -> None:
    """Decompress every frame of `src` (frames from `data_offset` on) into `dst` at the raw
    offsets, on every CPU.  A frame that does not decompress to its size is CorruptImage."""
    local = threading.local()
    jobs = []
    raw_pos = stored_pos = 0
    for raw, stored in sizes:
        jobs.append((raw_pos, stored_pos, raw, stored))
        raw_pos += raw
        stored_pos += stored
    os.ftruncate(dst, raw_pos)
    progress.expect(raw_pos)

    def one(job) -> None:
        raw_at, stored_at, raw, stored = job
        d = getattr(local, "d", None)
        if d is None:
            d = local.d = zstandard.ZstdDecompressor()
        data = os.pread(src, stored, data_offset + stored_at)
        view = memoryview(decompress_frame(d, data, raw, path, data_offset + stored_at))
        done = 0
        while done < raw:
            done += os.pwrite(dst, view[done:], raw_at + done)
        progress.moved(raw)

    with ThreadPoolExecutor(_workers(), thread_name_prefix="unzstd") as pool:
        for _ in pool.map(one, jobs):
            pass

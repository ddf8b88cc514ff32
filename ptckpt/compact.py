"""``ptckpt compact``: fold an incremental chain into one image that stands alone.

The new image holds every page the chain holds for each process (read through the
chain, PAGE_PARENT resolved), the top image's processes and image-wide records, and
no parent.  In place (no destination), it replaces the top image and keeps its image
id: it holds the same instant, so images made on it (their --prev) still find it,
and its own parents may then be removed.  That is how ``ptckpt run --keep`` drops
the oldest checkpoint of a chain.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from .formats.image import ImageReader, ImageWriter
from .formats.model import PAGE_SIZE

_PIECE = 4 << 20                 # bytes copied at a time


def compact(source: str, destination: str | None = None, *,
            compress: tuple[str, int] | None = None) -> str:
    """Write `source`'s chain as one image at `destination` (None: in place, same id);
    returns the image's directory.  Compression: as `compress`, else as the source's."""
    source = os.path.abspath(source)
    in_place = destination is None
    target = os.path.join(os.path.dirname(source), f".{os.path.basename(source)}.compact") if in_place \
        else os.path.abspath(destination)
    if in_place and os.path.exists(target):
        shutil.rmtree(target)
    with ImageReader(source) as image:
        if compress is None:
            how = next((image.compression(p) for p in image.pids if image.compression(p)), "")
            if how:
                codec, _, level = how.partition(":")
                compress = (codec, int(level))
        writer = ImageWriter(target, compress=compress)
        writer.create()
        try:
            inv = image.inventory
            if in_place:
                writer.image_id = inv.image_id
            writer.write_inventory(dataclasses.replace(inv, parent="", parent_id="", image_id=writer.image_id),
                                   image.shared_records())
            for pid in image.pids:
                writer.write_process(image.process(pid))
                with writer.pages_writer(pid) as pages:
                    for run in sorted(image.page_runs(pid), key=lambda r: r.vaddr):
                        _copy_run(image, pid, run, pages)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
    if in_place:
        old = f"{target}.old"
        os.rename(source, old)
        os.rename(target, source)
        shutil.rmtree(old, ignore_errors=True)
        return source
    return target


def _copy_run(image: ImageReader, pid: int, run, pages) -> None:
    fd, offset = image.pages_location(pid, run)
    done, size = 0, run.npages * PAGE_SIZE
    while done < size:
        n = min(_PIECE, size - done)
        data = os.pread(fd, n, offset + done)
        if len(data) != n:
            from .errors import CorruptImage
            raise CorruptImage(image.path, f"page data of process {pid} ends early")
        pages.add_run(run.vaddr + done, n // PAGE_SIZE, pages.write(data))
        done += n

"""File handles and ptckpt's mounts: an inode an fdinfo mark names, found again by path.

A watch or mark holds an inode, not a path: its path is found by opening its file handle
with open_by_handle_at(2) (needs CAP_DAC_READ_SEARCH) relative to a mount of its device
found in ptckpt's /proc/self/mountinfo, and reading the link of the fd obtained; it is
accepted only when that path, looked up again, is the very inode.  Used by
resources.inotify, resources.fanotify and resources.files.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct

from .. import procfs
from .fdstate import DELETED, O_CLOEXEC, O_PATH, Target, check, proto

_c_int = ctypes.c_int
_open_by_handle_at = proto("open_by_handle_at", _c_int, _c_int, ctypes.c_char_p, _c_int)
_name_to_handle_at = proto("name_to_handle_at", _c_int, _c_int, ctypes.c_char_p, ctypes.c_char_p,
                           ctypes.POINTER(_c_int), _c_int)
AT_EMPTY_PATH = 0x1000
MAX_HANDLE_SZ = 128


def kernel_dev(sdev: int) -> int:
    """A dev_t from the kernel's internal form (major << 20 | minor), as fdinfo shows it."""
    return os.makedev(sdev >> 20, sdev & 0xFFFFF)


def path_of_mark(t: Target, fields: dict, dev: int, ino: int, mounts: Mounts, where: str,
                  line: str) -> str:
    """The path of the inode an fdinfo mark line names by file handle (" (deleted)" at the end
    for a deleted file)."""
    if "f_handle" not in fields:
        raise t.unsupported(f"{where}: its file system gives no file handle, so its path "
                            f"cannot be found")
    try:
        handle = (struct.pack("Ii", int(fields["fhandle-bytes"], 16),
                              ctypes.c_int(int(fields["fhandle-type"], 16)).value)
                  + bytes.fromhex(fields["f_handle"]))
    except (KeyError, ValueError, struct.error):
        raise t.unsupported(f"{where}: a file handle not understood: {line!r}") from None
    path, why = mounts.resolve(dev, ino, handle)
    if path is None:
        raise t.unsupported(f"{where}: its path cannot be resolved ({why})")
    return path


class Mounts:
    """ptckpt's mounts by device, opened lazily, to open file handles against."""

    def __init__(self) -> None:
        found: dict[int, list[tuple[bool, str]]] = {}
        self._by_id: dict[int, str] = {}
        for line in _read_mountinfo():
            left = line.partition(b" - ")[0].split(b" ")
            major, minor = (int(x) for x in left[2].split(b":"))
            root, point = _unescape(left[3]), _unescape(left[4])
            found.setdefault(os.makedev(major, minor), []).append((root != "/", point))
            self._by_id[int(left[0])] = point
        # Mounts of the whole file system first: every inode is below their root.
        self._by_dev = {dev: [point for _, point in sorted(points, key=lambda p: p[0])]
                        for dev, points in found.items()}
        self._open: dict[str, int] = {}

    def point_of(self, mnt_id: int) -> str | None:
        """The mount point of mount `mnt_id`, None if ptckpt does not see it."""
        return self._by_id.get(mnt_id)

    def root_of(self, dev: int) -> str | None:
        """A mount point of the whole file system of `dev` (or of a part of it)."""
        points = self._by_dev.get(dev)
        return points[0] if points else None

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()

    def resolve(self, dev: int, ino: int, handle: bytes) -> tuple[str | None, str]:
        """(path of the inode, "") or (None, why not), trying each mount of `dev`."""
        points = self._by_dev.get(dev)
        if not points:
            return None, "no mount of its device is visible to ptckpt"
        why = ""
        for point in points:
            try:
                mount_fd = self._mount_fd(point)
                path = _path_of_handle(mount_fd, handle, ino)
            except OSError as err:
                why = f"open_by_handle_at through {point}: {err.strerror or err}"
                continue
            if path is not None:
                return path, ""
            why = f"no path through {point} leads to the inode (deleted or disconnected)"
        return None, why

    def _mount_fd(self, point: str) -> int:
        fd = self._open.get(point)
        if fd is None:
            # open_by_handle_at refuses an O_PATH fd (EBADF); the mount point is a
            # directory, or a bind-mounted file at most.
            fd = self._open[point] = os.open(point, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
                                             | O_CLOEXEC)
        return fd

    def open_handle(self, dev: int, handle: bytes, flags: int) -> int:
        """An fd of the inode of `handle` on device `dev` (open_by_handle_at through one of
        its mounts), opened with `flags`; OSError if none works (ESTALE: it is gone)."""
        failed: OSError = FileNotFoundError(f"no mount of device {os.major(dev)}:{os.minor(dev)} "
                                            f"is visible to ptckpt")
        for point in self._by_dev.get(dev, []):
            try:
                return check(_open_by_handle_at(self._mount_fd(point), handle, flags), "open_by_handle_at")
            except OSError as err:
                failed = err
        raise failed


def file_handle(fd: int) -> bytes:
    """name_to_handle_at(2) of an open file: struct file_handle (handle_bytes, handle_type,
    f_handle), the way open_by_handle_at takes it; b"" if its file system gives none."""
    buf = ctypes.create_string_buffer(struct.pack("Ii", MAX_HANDLE_SZ, 0) + bytes(MAX_HANDLE_SZ))
    mount_id = _c_int()
    if _name_to_handle_at(fd, b"", buf, ctypes.byref(mount_id), AT_EMPTY_PATH) < 0:
        return b""
    size = struct.unpack_from("I", buf.raw)[0]
    return buf.raw[:8 + size]


def open_file_handle(dev: int, handle: bytes, flags: int) -> int:
    """An fd of the file of `handle` (file_handle) on device `dev`, opened with `flags`."""
    mounts = Mounts()
    try:
        fd = mounts.open_handle(dev, handle, flags)
    finally:
        mounts.close()
    return fd


def _path_of_handle(mount_fd: int, handle: bytes, ino: int) -> str | None:
    """The path of the inode of `handle`, checked by looking it up again; None if none leads there."""
    fd = check(_open_by_handle_at(mount_fd, handle, O_PATH | O_CLOEXEC), "open_by_handle_at")
    try:
        st = os.fstat(fd)
        path = procfs.readlink_fd(os.getpid(), fd)
    finally:
        os.close(fd)
    if st.st_ino != ino or not path.startswith("/"):
        return None
    if path.endswith(DELETED):
        return path if st.st_nlink == 0 else None     # deleted, not merely disconnected
    try:
        again = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return path if (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino) else None


def _read_mountinfo() -> list[bytes]:
    return procfs.read_mountinfo("self")


def _unescape(field: bytes) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as \\ooo."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field))

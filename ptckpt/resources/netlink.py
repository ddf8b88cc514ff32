"""Netlink sockets held inside a tree, as programs keep them: bound (a port id, multicast
groups), idle, nothing queued.

Dump half: :func:`dump_netlink_sockets` reads each AF_NETLINK socket through a copy of
its fd: protocol and type, the bound port id and groups (getsockname), a connected
destination (getpeername), the groups joined past the first 32 (NETLINK_LIST_MEMBERSHIPS)
and the options (:mod:`.sockopts`).  A socket with messages waiting to be read is
refused: a reply or notification that the kernel made for it cannot be made again.

Restore half: :func:`create_netlink_sockets` makes them in ptckpt, bound to the same
port id (a port id taken by another socket is refused: the original still runs, or
use a network namespace of its own) and groups.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
from collections.abc import Mapping, Sequence

from ..errors import RestoreFailed, UnsupportedResource
from ..formats.model import Fd, FdKind, NetlinkSocket
from ..tracee import pidfd_getfd
from . import sockopts

SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NETLINK_LIST_MEMBERSHIPS = 270, 1, 9
O_ACCMODE = 0o3
PROTOCOLS = {0: "NETLINK_ROUTE", 4: "NETLINK_SOCK_DIAG", 9: "NETLINK_AUDIT", 15: "NETLINK_KOBJECT_UEVENT",
             16: "NETLINK_GENERIC", 12: "NETLINK_NETFILTER"}


def is_netlink(f: Fd) -> bool:
    return f.kind is FdKind.SOCKET and ("family", "AF_NETLINK") in f.details


def describe(r: NetlinkSocket) -> str:
    proto = PROTOCOLS.get(r.protocol, f"protocol {r.protocol}")
    bound = f"port {r.portid}" if r.portid else "unbound"
    return f"netlink {proto} {bound}" + (f" groups {r.groups:#x}" if r.groups else "")


def dump_netlink_sockets(fds: Mapping[int, Sequence[Fd]]) -> list[NetlinkSocket]:
    seen: dict[int, NetlinkSocket] = {}
    for pid, flist in fds.items():
        for f in flist:
            if is_netlink(f) and not f.external and f.ino not in seen:
                seen[f.ino] = _dump_one(pid, f)
    return list(seen.values())


def _dump_one(pid: int, f: Fd) -> NetlinkSocket:
    copy = pidfd_getfd(pid, f.fd)
    with socket.socket(fileno=copy) as sock:
        portid, groups = sock.getsockname()
        dst_portid = dst_group = 0
        with contextlib.suppress(OSError):
            dst_portid, dst_group = sock.getpeername()
        members = _memberships(sock)
        if any(g > 32 for g in members):
            raise UnsupportedResource(pid, f"fd {f.fd} (netlink socket): multicast groups above 32 "
                                           f"({', '.join(str(g) for g in members if g > 32)})")
        try:
            waiting = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT | socket.MSG_TRUNC)
        except BlockingIOError:
            waiting = None
        if waiting is not None:
            raise UnsupportedResource(pid, f"fd {f.fd} (netlink socket, {PROTOCOLS.get(sock.proto, sock.proto)}): "
                                           f"messages not read yet (a netlink socket is dumped when it is idle)")
        return NetlinkSocket(ino=f.ino, type=sock.type, protocol=sock.proto, portid=portid,
                             groups=groups, dst_portid=dst_portid, dst_group=dst_group,
                             options=sockopts.read_options(sock))


def _memberships(sock: socket.socket) -> list[int]:
    try:
        raw = sock.getsockopt(SOL_NETLINK, NETLINK_LIST_MEMBERSHIPS, 64)
    except OSError:
        return []
    words = struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4])
    return [i * 32 + b + 1 for i, w in enumerate(words) for b in range(32) if w >> b & 1]


def create_netlink_sockets(records: Sequence[NetlinkSocket], descs: Mapping[int, Fd]) -> dict[int, int]:
    """{desc: fd} for the netlink sockets of `descs` (Fd.ino names the record)."""
    by_ino = {r.ino: r for r in records}
    out: dict[int, int] = {}
    try:
        for d, f in descs.items():
            r = by_ino[f.ino]
            with socket.socket(socket.AF_NETLINK, r.type, r.protocol) as sock:
                try:
                    sockopts.apply_options(sock, r.options)
                    if r.portid or r.groups:
                        sock.bind((r.portid, r.groups))
                    if r.dst_portid or r.dst_group:
                        sock.connect((r.dst_portid, r.dst_group))
                except OSError as err:
                    raise RestoreFailed(f"{describe(r)}: {err.strerror or err}"
                                        + ("; the port id is taken (is the original still running? "
                                           "--netns gives the tree a network namespace of its own)"
                                           if err.errno == 98 else "")) from None
                out[d] = os.dup(sock.fileno())
                fcntl.fcntl(out[d], fcntl.F_SETFL, f.flags & ~O_ACCMODE)
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    return out

"""Socket options: the ones a program set are read at dump and set again at restore.

Dump half: :func:`read_options` reads every option of :data:`OPTIONS` that applies to
the socket (by family and protocol, a raw socket's rows by RAW whatever its protocol)
with getsockopt(2) on a copy of its fd, and keeps
those whose value differs from what a new socket of the same kind has: what the
program (or the kernel on its behalf) changed.  :func:`read_filter` and
:func:`multicast_groups` read what getsockopt cannot list by itself: a classic BPF
socket filter (SO_GET_FILTER; an eBPF one is refused) and multicast memberships
(MCAST_MSFILTER asked per group the host has joined, /proc/net/igmp and igmp6).

Restore half: :func:`apply_options` sets them again, in table order, on a socket
ptckpt made; buffer sizes with SO_SNDBUFFORCE / SO_RCVBUFFORCE (the kernel doubles
what it is given: the recorded value is halved); :func:`attach_filter`,
:func:`join_groups`.

SO_REUSEADDR is special for TCP connections rebuilt with TCP_REPAIR: repair mode
overwrites it, so ptckpt.resources.tcp puts it back when repair mode ends.  A buffer
size the kernel grew by itself (TCP autotuning) is set again, then unlocked (SO_BUF_LOCK
0), so that the kernel goes on tuning it; the locks a program set come back as they were.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as _errno
import ipaddress
import socket
import struct
from collections.abc import Iterable, Sequence

from .. import procfs as _procfs
from ..errors import PtckptError

SOL_SOCKET, SOL_IP, SOL_TCP, SOL_IPV6, SOL_UDP, SOL_NETLINK = socket.SOL_SOCKET, 0, 6, 41, 17, 270
AF_NETLINK = socket.AF_NETLINK
SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE = 7, 8, 32, 33
SO_REUSEADDR, SO_ATTACH_FILTER, SO_GET_FILTER, SO_LOCK_FILTER = 2, 26, 26, 44
SO_BUF_LOCK = 72                 # SOCK_SNDBUF_LOCK 1 | SOCK_RCVBUF_LOCK 2 (Linux 5.14)
IPV6_V6ONLY = 26
MCAST_JOIN_GROUP, MCAST_MSFILTER = 42, 48
MCAST_EXCLUDE, MCAST_INCLUDE = 0, 1
_INT = struct.Struct("i")

# (level, name, optname, size or 0 for an int, families or None for any, protocols or None)
# Order matters at restore: what bind() and listen() depend on comes first.
_TCP, _UDP, _UDPLITE = socket.IPPROTO_TCP, socket.IPPROTO_UDP, 136
_DGRAM = (_UDP, _UDPLITE)                   # UDP's options hold for UDP-Lite too
_PING = (socket.IPPROTO_ICMP, socket.IPPROTO_ICMPV6)
RAW = -1                                    # a raw socket (SOCK_RAW, any protocol): its rows name it so
SOL_UDPLITE, SOL_RAW, SOL_ICMPV6 = 136, 255, 58
OPTIONS: tuple[tuple[int, str, int, int, tuple | None, tuple | None], ...] = (
    (SOL_IPV6, "IPV6_V6ONLY", IPV6_V6ONLY, 0, (socket.AF_INET6,), None),
    (SOL_SOCKET, "SO_REUSEADDR", SO_REUSEADDR, 0, None, None),
    (SOL_SOCKET, "SO_REUSEPORT", 15, 0, None, None),
    (SOL_SOCKET, "SO_BROADCAST", 6, 0, None, _DGRAM + _PING + (RAW,)),
    (SOL_SOCKET, "SO_DONTROUTE", 5, 0, None, None),
    (SOL_SOCKET, "SO_NO_CHECK", 11, 0, None, None),
    (SOL_SOCKET, "SO_PASSCRED", 16, 0, None, None),
    (SOL_SOCKET, "SO_PASSSEC", 34, 0, None, None),
    (SOL_SOCKET, "SO_KEEPALIVE", 9, 0, None, (_TCP,)),
    (SOL_SOCKET, "SO_OOBINLINE", 10, 0, None, (_TCP,)),
    (SOL_SOCKET, "SO_PRIORITY", 12, 0, None, None),
    (SOL_SOCKET, "SO_LINGER", 13, 8, None, (_TCP,)),
    (SOL_SOCKET, "SO_RCVLOWAT", 18, 0, None, None),
    (SOL_SOCKET, "SO_RCVTIMEO", 20, 16, None, None),
    (SOL_SOCKET, "SO_SNDTIMEO", 21, 16, None, None),
    (SOL_SOCKET, "SO_BINDTODEVICE", 25, 16, None, None),
    (SOL_SOCKET, "SO_TIMESTAMP", 29, 0, None, None),
    (SOL_SOCKET, "SO_MARK", 36, 0, None, None),
    (SOL_SOCKET, "SO_RXQ_OVFL", 40, 0, None, None),
    (SOL_SOCKET, "SO_BUSY_POLL", 46, 0, None, None),
    (SOL_SOCKET, "SO_ZEROCOPY", 60, 0, None, None),
    (SOL_SOCKET, "SO_SNDBUF", SO_SNDBUF, 0, None, None),
    (SOL_SOCKET, "SO_RCVBUF", SO_RCVBUF, 0, None, None),
    (SOL_SOCKET, "SO_BUF_LOCK", SO_BUF_LOCK, 0, None, None),   # after the sizes, which set it
    (SOL_IP, "IP_HDRINCL", 3, 0, (socket.AF_INET,), (RAW,)),
    (SOL_IP, "IP_TOS", 1, 0, None, None),
    (SOL_IP, "IP_TTL", 2, 0, None, None),
    (SOL_IP, "IP_PKTINFO", 8, 0, None, None),
    (SOL_IP, "IP_MTU_DISCOVER", 10, 0, None, None),
    (SOL_IP, "IP_RECVERR", 11, 0, None, None),
    (SOL_IP, "IP_RECVTTL", 12, 0, None, None),
    (SOL_IP, "IP_RECVTOS", 13, 0, None, None),
    (SOL_IP, "IP_FREEBIND", 15, 0, None, None),
    (SOL_IP, "IP_TRANSPARENT", 19, 0, None, None),
    (SOL_IP, "IP_NODEFRAG", 22, 0, (socket.AF_INET,), (RAW,)),
    (SOL_IP, "IP_BIND_ADDRESS_NO_PORT", 24, 0, None, None),
    (SOL_IP, "IP_MULTICAST_IF", 32, 4, (socket.AF_INET,), _DGRAM + (RAW,)),
    (SOL_IP, "IP_MULTICAST_TTL", 33, 0, None, _DGRAM + (RAW,)),
    (SOL_IP, "IP_MULTICAST_LOOP", 34, 0, None, _DGRAM + (RAW,)),
    (SOL_IP, "IP_MULTICAST_ALL", 49, 0, (socket.AF_INET,), _DGRAM + (RAW,)),
    (SOL_IPV6, "IPV6_UNICAST_HOPS", 16, 0, (socket.AF_INET6,), None),
    (SOL_IPV6, "IPV6_MULTICAST_IF", 17, 0, (socket.AF_INET6,), _DGRAM + (RAW,)),
    (SOL_IPV6, "IPV6_MULTICAST_HOPS", 18, 0, (socket.AF_INET6,), _DGRAM + (RAW,)),
    (SOL_IPV6, "IPV6_MULTICAST_LOOP", 19, 0, (socket.AF_INET6,), _DGRAM + (RAW,)),
    (SOL_IPV6, "IPV6_RECVERR", 25, 0, (socket.AF_INET6,), None),
    (SOL_IPV6, "IPV6_RECVPKTINFO", 49, 0, (socket.AF_INET6,), None),
    (SOL_IPV6, "IPV6_TCLASS", 67, 0, (socket.AF_INET6,), None),
    (SOL_IPV6, "IPV6_FREEBIND", 78, 0, (socket.AF_INET6,), None),
    (SOL_IPV6, "IPV6_CHECKSUM", 7, 0, (socket.AF_INET6,), (RAW,)),
    (SOL_IPV6, "IPV6_HDRINCL", 36, 0, (socket.AF_INET6,), (RAW,)),
    (SOL_RAW, "ICMP_FILTER", 1, 4, (socket.AF_INET,), (RAW,)),          # IPPROTO_ICMP only
    (SOL_ICMPV6, "ICMPV6_FILTER", 1, 32, (socket.AF_INET6,), (RAW,)),   # IPPROTO_ICMPV6 only
    (SOL_TCP, "TCP_NODELAY", 1, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_MAXSEG", 2, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_CORK", 3, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_KEEPIDLE", 4, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_KEEPINTVL", 5, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_KEEPCNT", 6, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_SYNCNT", 7, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_LINGER2", 8, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_DEFER_ACCEPT", 9, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_WINDOW_CLAMP", 10, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_CONGESTION", 13, 16, None, (_TCP,)),
    (SOL_TCP, "TCP_USER_TIMEOUT", 18, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_FASTOPEN", 23, 0, None, (_TCP,)),
    (SOL_TCP, "TCP_NOTSENT_LOWAT", 25, 0, None, (_TCP,)),
    (SOL_UDP, "UDP_CORK", 1, 0, None, _DGRAM),
    (SOL_UDP, "UDP_SEGMENT", 103, 0, None, (_UDP,)),
    (SOL_UDP, "UDP_GRO", 104, 0, None, (_UDP,)),
    (SOL_UDPLITE, "UDPLITE_SEND_CSCOV", 10, 0, None, (_UDPLITE,)),
    (SOL_UDPLITE, "UDPLITE_RECV_CSCOV", 11, 0, None, (_UDPLITE,)),
    (SOL_NETLINK, "NETLINK_PKTINFO", 3, 0, (AF_NETLINK,), None),
    (SOL_NETLINK, "NETLINK_BROADCAST_ERROR", 4, 0, (AF_NETLINK,), None),
    (SOL_NETLINK, "NETLINK_NO_ENOBUFS", 5, 0, (AF_NETLINK,), None),
    (SOL_NETLINK, "NETLINK_LISTEN_ALL_NSID", 8, 0, (AF_NETLINK,), None),
    (SOL_NETLINK, "NETLINK_CAP_ACK", 10, 0, (AF_NETLINK,), None),
    (SOL_NETLINK, "NETLINK_EXT_ACK", 11, 0, (AF_NETLINK,), None),
    (SOL_NETLINK, "NETLINK_GET_STRICT_CHK", 12, 0, (AF_NETLINK,), None),
)
OPTION_NAMES = {(level, opt): name for level, name, opt, _size, _f, _p in OPTIONS}


def option_name(level: int, opt: int) -> str:
    return OPTION_NAMES.get((level, opt), f"option {level}/{opt}")


def _applies(family: int, proto: int, fams, protos) -> bool:
    return (fams is None or family in fams) and (protos is None or proto in protos)


def _read(sock: socket.socket, level: int, opt: int, size: int) -> bytes | None:
    try:
        if size:
            return sock.getsockopt(level, opt, size)
        return _INT.pack(sock.getsockopt(level, opt))
    except OSError:
        return None          # not readable on this socket (state, kernel): nothing to keep


_APPLICABLE: dict[tuple[int, int], tuple[tuple[int, int, int], ...]] = {}


def _applicable(family: int, proto: int) -> tuple[tuple[int, int, int], ...]:
    """(level, optname, size) of the table's options for this family and protocol, once."""
    key = (family, proto)
    if key not in _APPLICABLE:
        _APPLICABLE[key] = tuple((level, opt, size) for level, _name, opt, size, fams, protos in OPTIONS
                                 if _applies(family, proto, fams, protos))
    return _APPLICABLE[key]


def _read_all(sock: socket.socket) -> dict[tuple[int, int], bytes]:
    out = {}
    for level, opt, size in _applicable(int(sock.family), RAW if sock.type == socket.SOCK_RAW else sock.proto):
        value = _read(sock, level, opt, size)
        if value is not None:
            out[(level, opt)] = value
    return out


_DEFAULTS: dict[tuple[int, int, int], dict] = {}


def defaults(family: int, type_: int, proto: int) -> dict[tuple[int, int], bytes]:
    """What a new socket of this kind answers (once per kind and process)."""
    key = (family, type_, proto)
    if key not in _DEFAULTS:
        with socket.socket(family, type_, proto) as fresh:
            _DEFAULTS[key] = _read_all(fresh)
    return _DEFAULTS[key]


def read_options(sock: socket.socket) -> tuple[tuple[int, int, bytes], ...]:
    """(level, optname, value) of every option whose value differs from a new socket's."""
    base = defaults(int(sock.family), int(sock.type), sock.proto)
    return tuple((level, opt, value) for (level, opt), value in _read_all(sock).items()
                 if base.get((level, opt)) != value)


def option_value(options: Iterable[tuple[int, int, bytes]], level: int, opt: int, default: int = 0) -> int:
    for lv, o, value in options:
        if (lv, o) == (level, opt) and len(value) == _INT.size:
            return _INT.unpack(value)[0]
    return default


def apply_options(sock: socket.socket, options: Sequence[tuple[int, int, bytes]], *,
                  skip: frozenset = frozenset()) -> None:
    """Set each option again (those in `skip`, (level, optname), are the caller's).

    Setting a buffer size also locks it (SO_BUF_LOCK: the kernel no longer tunes it):
    the locks are put back as they were after the sizes, cleared where none was recorded
    (a size the kernel had grown by itself, or one the program unlocked again)."""
    forced = False
    for level, opt, value in options:
        if (level, opt) in skip:
            continue
        if level == SOL_SOCKET and opt in (SO_SNDBUF, SO_RCVBUF) and len(value) == _INT.size:
            # getsockopt answers twice what setsockopt was given (the kernel's bookkeeping)
            force = SO_SNDBUFFORCE if opt == SO_SNDBUF else SO_RCVBUFFORCE
            sock.setsockopt(level, force, max(_INT.unpack(value)[0] // 2, 1))
            forced = True
            continue
        if level == SOL_SOCKET and opt == 25:          # SO_BINDTODEVICE: the name, NUL-trimmed
            value = value.split(b"\0", 1)[0]
        elif level == SOL_TCP and opt == 13:           # TCP_CONGESTION
            value = value.split(b"\0", 1)[0]
        try:
            sock.setsockopt(level, opt, value)
        except OSError as err:
            raise OSError(err.errno, f"setsockopt {option_name(level, opt)}: {err.strerror}") from None
    if forced and not any((lv, o) == (SOL_SOCKET, SO_BUF_LOCK) for lv, o, _v in options):
        with contextlib.suppress(OSError):       # ENOPROTOOPT: a kernel without SO_BUF_LOCK
            sock.setsockopt(SOL_SOCKET, SO_BUF_LOCK, 0)


# --- socket filters ----------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.getsockopt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                             ctypes.POINTER(ctypes.c_uint32)]
_SOCK_FILTER_SIZE = 8      # struct sock_filter { u16 code; u8 jt, jf; u32 k; }


def _getsockopt_into(fd: int, level: int, opt: int, buf: ctypes.Array, length: int) -> int:
    """getsockopt with an input buffer (Python's getsockopt cannot pass one): the optlen back."""
    optlen = ctypes.c_uint32(length)
    if _libc.getsockopt(fd, level, opt, buf, ctypes.byref(optlen)) < 0:
        err = ctypes.get_errno()
        raise OSError(err, _errno.errorcode.get(err, str(err)))
    return optlen.value


class EbpfFilter(Exception):
    """The socket carries an eBPF filter, which no getsockopt can read back."""


def read_filter(sock: socket.socket) -> tuple[bytes, bool]:
    """(the classic BPF program attached, as struct sock_filter[] bytes, b"" for none; locked)."""
    try:
        count = _getsockopt_into(sock.fileno(), SOL_SOCKET, SO_GET_FILTER, ctypes.create_string_buffer(1), 0)
    except OSError as err:
        if err.errno == _errno.EACCES:
            raise EbpfFilter() from None
        raise
    if not count:
        return b"", False
    buf = ctypes.create_string_buffer(count * _SOCK_FILTER_SIZE)
    _getsockopt_into(sock.fileno(), SOL_SOCKET, SO_GET_FILTER, buf, count)
    return buf.raw, bool(sock.getsockopt(SOL_SOCKET, SO_LOCK_FILTER))


def attach_filter(sock: socket.socket, program: bytes, locked: bool = False) -> None:
    if not program:
        return
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HxxxxxxQ", len(program) // _SOCK_FILTER_SIZE, ctypes.addressof(buf))
    sock.setsockopt(SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    if locked:
        sock.setsockopt(SOL_SOCKET, SO_LOCK_FILTER, 1)


# --- multicast memberships ------------------------------------------------------------

_GROUP_FILTER = struct.Struct("I4x128sII128s")     # struct group_filter with one source slot
_GROUP_REQ = struct.Struct("I4x128s")              # struct group_req


def host_groups(procfs: str = "/proc") -> list[tuple[int, int, str]]:
    """(family, ifindex, group) of every multicast group some socket of this network
    namespace may have joined (/proc/net/igmp and igmp6), the all-nodes groups left out."""
    out = []
    with contextlib.suppress(OSError, PtckptError):
        ifindex = 0
        for line in _procfs.read_net_table("self", "igmp", procfs=procfs)[1:]:
            if not line.startswith("\t"):
                ifindex = int(line.split()[0])
                continue
            group = str(ipaddress.IPv4Address(struct.pack("<I", int(line.split()[0], 16))))
            if group != "224.0.0.1":
                out.append((socket.AF_INET, ifindex, group))
    with contextlib.suppress(OSError, PtckptError):
        for line in _procfs.read_net_table("self", "igmp6", procfs=procfs):
            fields = line.split()
            group = ipaddress.IPv6Address(bytes.fromhex(fields[2]))
            if group.exploded.startswith(("ff02:0000:0000:0000:0000:0001:ff", "ff01:", "ff02:0000:0000:0000:0000:0000:0000:0001")):
                continue                 # solicited-node, node-local, all-nodes: the kernel's own
            out.append((socket.AF_INET6, int(fields[0]), str(group)))
    return out


def _sockaddr_storage(family: int, group: str) -> bytes:
    if family == socket.AF_INET:
        raw = struct.pack("=H", socket.AF_INET) + bytes(2) + socket.inet_pton(socket.AF_INET, group)
    else:
        raw = struct.pack("=H", socket.AF_INET6) + bytes(6) + socket.inet_pton(socket.AF_INET6, group)
    return raw.ljust(128, b"\0")


class SourceFilter(Exception):
    """A membership with a source filter (SSM or excluded sources): not restorable."""


def multicast_groups(sock: socket.socket, groups: Sequence[tuple[int, int, str]]) -> tuple[tuple[int, str], ...]:
    """The (ifindex, group) memberships of `sock` among the host's `groups`."""
    level = SOL_IPV6 if sock.family == socket.AF_INET6 else SOL_IP
    out = []
    for family, ifindex, group in groups:
        if family != sock.family and not (sock.family == socket.AF_INET6 and family == socket.AF_INET):
            continue
        buf = ctypes.create_string_buffer(_GROUP_FILTER.pack(ifindex, _sockaddr_storage(family, group),
                                                             0, 0, bytes(128)), _GROUP_FILTER.size)
        try:
            _getsockopt_into(sock.fileno(), level if family == sock.family else SOL_IP, MCAST_MSFILTER,
                             buf, _GROUP_FILTER.size)
        except OSError as err:
            if err.errno in (_errno.EADDRNOTAVAIL, _errno.EINVAL, _errno.ENODEV, _errno.ENOPROTOOPT):
                continue                        # not a member (or not this family)
            raise
        _ifindex, _group, fmode, numsrc, _src = _GROUP_FILTER.unpack(buf.raw)
        if fmode != MCAST_EXCLUDE or numsrc:
            raise SourceFilter(f"{group} on interface {ifindex}")
        out.append((ifindex, group))
    return tuple(out)


def join_groups(sock: socket.socket, groups: Iterable[tuple[int, str]]) -> None:
    for ifindex, group in groups:
        family = socket.AF_INET6 if ":" in group else socket.AF_INET
        level = SOL_IPV6 if family == socket.AF_INET6 else SOL_IP
        sock.setsockopt(level, MCAST_JOIN_GROUP, _GROUP_REQ.pack(ifindex, _sockaddr_storage(family, group)))

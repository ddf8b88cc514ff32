"""Crafted TCP segments and UDP datagrams, sent from raw sockets (restore helper).

A restore uses these to put into a socket what no ordinary send can: a FIN
in a repaired TCP socket's receive queue (the peer had half-closed), and the
datagrams of a UDP socket's receive queue, each with its original sender
address and port (a plain sendto() would show ptckpt's own address).

Grammar of what goes on the wire (all fields big-endian, built with struct)::

    packet   = ip-header, l4-header, payload
    ip4      = ver/ihl 0x45, tos 0, total len, id, DF, ttl 64, proto, csum, src, dst
               (RFC 791 3.1; no IP options)
    ip6      = ver 6 / tc 0 / flow 0, payload len, next header, hop limit 64, src, dst
               (RFC 8200 section 3; no extension headers)
    udp      = sport, dport, len, csum                                  (RFC 768)
    udplite  = sport, dport, coverage 0 (the whole datagram), csum      (RFC 3828 3.1)
    tcp      = sport, dport, seq, ack, doff/flags, window, csum, urg 0, options
               (RFC 9293 3.1); options = NOP NOP TS(kind 8, len 10, tsval, tsecr)
               when a timestamp is asked for (RFC 7323 3.2, the layout of
               Appendix A), otherwise none
    checksum = one's complement of the one's complement sum of the pseudo-header
               (src, dst, zero, proto, l4 length: RFC 9293 3.1 for IPv4;
               src, dst, u32 length, 3 zero bytes, next header: RFC 8200 8.1)
               and the L4 header + payload; a computed UDP checksum of 0 is
               sent as 0xffff (RFC 768; mandatory for IPv6)

Sending: IPv4 through socket(AF_INET, SOCK_RAW, IPPROTO_RAW) with IP_HDRINCL,
IPv6 through socket(AF_INET6, SOCK_RAW, IPPROTO_RAW) with IPV6_HDRINCL (36,
include/uapi/linux/in6.h; Python 3.11's socket module lacks the name).  The
kernel takes such a header as given: it only fills in the IPv4 header
checksum and an id of 0 (net/ipv4/raw.c raw_send_hdrinc); for IPv6 nothing.
It never fragments a header-included packet: more than the route's MTU is
EMSGSIZE.  Local destinations route through lo (MTU 65536), so a UDP
payload of up to 65507 bytes (IPv4: the total length field) / 65488 (IPv6:
65536 - 48) goes through.  Loopback does not skip checksum verification for
these packets: a segment or datagram with a wrong checksum is dropped
(tests/test_rawpkt.py).  Receivers take a forged source as it is (no rp_filter
on lo).

An IPv4-mapped IPv6 address ("::ffff:127.0.0.1") is what a dual-stack socket
reports for an IPv4 peer; on the wire that traffic is IPv4, so a pair of
mapped (or mapped + IPv4) addresses is sent as IPv4.

Errors: bad arguments raise :class:`ptckpt.errors.UsageError`; an OSError
becomes :class:`RawPacketError` (exit code IO_ERROR), or
:class:`RawSocketUnavailable` (MISSING_FEATURE) when raw sockets or SO_MARK
are not allowed here (no CAP_NET_RAW / CAP_NET_ADMIN) or not built.  No bare
OSError leaves this module.
"""

from __future__ import annotations

import errno as _errno
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

from .errors import ExitCode, PtckptError, UsageError

__all__ = [
    "TCP_FIN", "TCP_SYN", "TCP_RST", "TCP_PSH", "TCP_ACK", "TCP_URG",
    "RawPacketError", "RawSocketUnavailable", "RawSender", "send_tcp", "send_udp",
]

# TCP flag bits (RFC 9293 3.1; the low byte of the data-offset/flags word)
TCP_FIN = 0x01
TCP_SYN = 0x02
TCP_RST = 0x04
TCP_PSH = 0x08
TCP_ACK = 0x10
TCP_URG = 0x20

IPV6_HDRINCL = getattr(socket, "IPV6_HDRINCL", 36)     # include/uapi/linux/in6.h
SO_MARK = getattr(socket, "SO_MARK", 36)                # asm-generic/socket.h

UDPLITE = 136                                           # IPPROTO_UDPLITE
_TTL = 64
_IP_DF = 0x4000
_IPV4_MAX_TOTAL = 0xFFFF           # the total length field
_IPV6_MAX_PAYLOAD = 0xFFFF         # the payload length field (no jumbograms)

_IP4 = struct.Struct("!BBHHHBBH4s4s")     # 20 bytes, RFC 791 3.1
_IP6 = struct.Struct("!IHBB16s16s")       # 40 bytes, RFC 8200 3
_UDP = struct.Struct("!HHHH")             # 8 bytes, RFC 768
_TCP = struct.Struct("!HHIIHHHH")         # 20 bytes without options, RFC 9293 3.1
_TCP_TS = struct.Struct("!BBBBII")        # NOP NOP kind=8 len=10 tsval tsecr (12 bytes)
_PSEUDO4 = struct.Struct("!4s4sBBH")
_PSEUDO6 = struct.Struct("!16s16sI3xB")


# --- errors of this layer -----------------------------------------------------------

class RawPacketError(PtckptError):
    """A crafted packet could not be sent (what was being done, the reason, the errno)."""

    exit_code = ExitCode.IO_ERROR

    def __init__(self, what: str, reason: str, err: int | None = None):
        super().__init__(f"{what}: {reason}")
        self.what = what
        self.reason = reason
        self.errno = err


class RawSocketUnavailable(RawPacketError):
    """Raw sockets (or SO_MARK) are not permitted or not supported here."""

    exit_code = ExitCode.MISSING_FEATURE


# errnos of socket()/setsockopt() that mean "cannot be done on this system"
_UNAVAILABLE = frozenset({_errno.EPERM, _errno.EACCES, _errno.EAFNOSUPPORT,
                          _errno.EPROTONOSUPPORT, _errno.ENOPROTOOPT})


def _translate(err: OSError, what: str, setup: bool) -> RawPacketError:
    reason = err.strerror or str(err) or type(err).__name__
    if setup and err.errno in _UNAVAILABLE:
        hint = " (raw sockets need CAP_NET_RAW, SO_MARK CAP_NET_ADMIN)" \
            if err.errno in (_errno.EPERM, _errno.EACCES) else ""
        return RawSocketUnavailable(what, reason + hint, err.errno)
    return RawPacketError(what, reason, err.errno)


# --- addresses -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Endpoints:
    """A resolved (src, dst) pair: the family the packet is sent in and packed addresses."""

    family: int           # AF_INET or AF_INET6
    src: bytes            # 4 or 16 bytes
    dst: bytes
    scope_id: int         # IPv6 link-local destination scope (0 otherwise)
    dst_text: str         # for sendto() and messages


def _parse_addr(text: str, role: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise UsageError(f"bad {role} address {text!r}: not an IPv4 or IPv6 address") from None


def _endpoints(src: str, dst: str) -> _Endpoints:
    """Parse both addresses; a pair of IPv4 / IPv4-mapped addresses is IPv4."""
    s, d = _parse_addr(src, "source"), _parse_addr(dst, "destination")
    if isinstance(s, ipaddress.IPv6Address) and s.ipv4_mapped is not None:
        s = s.ipv4_mapped
    if isinstance(d, ipaddress.IPv6Address) and d.ipv4_mapped is not None:
        d = d.ipv4_mapped
    if s.version != d.version:
        raise UsageError(f"source {src} and destination {dst} are of different IP versions")
    if d.version == 4:
        return _Endpoints(socket.AF_INET, s.packed, d.packed, 0, str(d))
    scope = 0
    if d.scope_id:
        try:
            scope = int(d.scope_id) if d.scope_id.isdigit() else socket.if_nametoindex(d.scope_id)
        except OSError:
            raise UsageError(f"destination {dst}: no such interface {d.scope_id!r}") from None
    return _Endpoints(socket.AF_INET6, s.packed, d.packed, scope, str(d).split("%")[0])


def _check_port(port: int, role: str) -> None:
    if not 0 <= port <= 0xFFFF:
        raise UsageError(f"{role} port {port} is not in 0..65535")


def _check_u32(value: int, name: str) -> None:
    if not 0 <= value <= 0xFFFFFFFF:
        raise UsageError(f"{name} {value} is not a 32-bit unsigned value")


# --- building -------------------------------------------------------------------------------

def _csum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of data: ~(one's complement sum of 16-bit words)."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _pseudo_header(ep: _Endpoints, proto: int, length: int) -> bytes:
    if ep.family == socket.AF_INET:
        return _PSEUDO4.pack(ep.src, ep.dst, 0, proto, length)
    return _PSEUDO6.pack(ep.src, ep.dst, length, proto)


def _ip_packet(ep: _Endpoints, proto: int, l4: bytes) -> bytes:
    """Prefix l4 (header + payload, checksum filled in) with the IP header."""
    if ep.family == socket.AF_INET:
        total = _IP4.size + len(l4)
        if total > _IPV4_MAX_TOTAL:
            raise UsageError(f"an IPv4 packet of {total} bytes is larger than 65535")
        ident = int.from_bytes(os.urandom(2), "big") or 1
        header = _IP4.pack(0x45, 0, total, ident, _IP_DF, _TTL, proto, 0, ep.src, ep.dst)
        header = header[:10] + struct.pack("!H", _csum(header)) + header[12:]
        return header + l4
    if len(l4) > _IPV6_MAX_PAYLOAD:
        raise UsageError(f"an IPv6 payload of {len(l4)} bytes is larger than 65535")
    return _IP6.pack(6 << 28, len(l4), proto, _TTL, ep.src, ep.dst) + l4


def _build_udp(ep: _Endpoints, sport: int, dport: int, payload: bytes,
               proto: int = socket.IPPROTO_UDP) -> bytes:
    """A UDP datagram, or a UDP-Lite one (proto 136): the same header with the checksum
    coverage where the length was (0: the whole datagram, its length taken from IP's)."""
    length = _UDP.size + len(payload)
    if length > 0xFFFF:
        raise UsageError(f"a UDP datagram of {len(payload)} bytes does not fit the length field")
    third = length if proto == socket.IPPROTO_UDP else 0
    header = _UDP.pack(sport, dport, third, 0)
    csum = _csum(_pseudo_header(ep, proto, length) + header + payload) or 0xFFFF
    return _ip_packet(ep, proto, _UDP.pack(sport, dport, third, csum) + payload)


def _build_tcp(ep: _Endpoints, sport: int, dport: int, seq: int, ack: int, flags: int,
               window: int, tsval: int | None, tsecr: int | None, payload: bytes) -> bytes:
    options = b""
    if tsval is not None:
        options = _TCP_TS.pack(1, 1, 8, 10, tsval, tsecr or 0)
    doff = (_TCP.size + len(options)) // 4
    word = (doff << 12) | (flags & 0x1FF)
    header = _TCP.pack(sport, dport, seq, ack, word, window, 0, 0) + options
    length = len(header) + len(payload)
    csum = _csum(_pseudo_header(ep, socket.IPPROTO_TCP, length) + header + payload)
    header = header[:16] + struct.pack("!H", csum) + header[18:]
    return _ip_packet(ep, socket.IPPROTO_TCP, header + payload)


# --- sending ----------------------------------------------------------------------------------

class RawSender:
    """Raw sockets for crafted packets, opened on first use per family, closed on exit.

        with RawSender(mark=0) as raw:
            for sender, data in datagrams:
                raw.udp(sender.addr, sender.port, "127.0.0.1", 5353, data)

    send_tcp() / send_udp() are the one-packet forms.
    """

    def __init__(self, *, mark: int = 0):
        _check_u32(mark, "mark")
        self.mark = mark
        self._socks: dict[int, socket.socket] = {}

    def __enter__(self) -> RawSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()

    def _sock(self, family: int) -> socket.socket:
        sock = self._socks.get(family)
        if sock is not None:
            return sock
        name = "IPv4" if family == socket.AF_INET else "IPv6"
        try:
            sock = socket.socket(family, socket.SOCK_RAW, socket.IPPROTO_RAW)
        except OSError as err:
            raise _translate(err, f"cannot create a raw {name} socket", setup=True) from err
        try:
            try:
                if family == socket.AF_INET:
                    sock.setsockopt(socket.IPPROTO_IP, socket.IP_HDRINCL, 1)
                else:
                    sock.setsockopt(socket.IPPROTO_IPV6, IPV6_HDRINCL, 1)
            except OSError as err:
                raise _translate(err, f"cannot set {name} header inclusion on a raw socket",
                                 setup=True) from err
            if self.mark:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, SO_MARK, self.mark)
                except OSError as err:
                    raise _translate(err, f"cannot set SO_MARK {self.mark:#x} on a raw socket",
                                     setup=True) from err
        except BaseException:
            sock.close()
            raise
        self._socks[family] = sock
        return sock

    def _send(self, ep: _Endpoints, packet: bytes, what: str) -> None:
        sock = self._sock(ep.family)
        dest = (ep.dst_text, 0) if ep.family == socket.AF_INET else (ep.dst_text, 0, 0, ep.scope_id)
        try:
            sent = sock.sendto(packet, dest)
        except OSError as err:
            raise _translate(err, f"cannot send {what} ({len(packet)} bytes)", setup=False) from err
        if sent != len(packet):
            raise RawPacketError(f"cannot send {what}", f"short send: {sent} of {len(packet)} bytes")

    def tcp(self, src: str, sport: int, dst: str, dport: int, *, seq: int, ack: int, flags: int,
            window: int, tsval: int | None = None, tsecr: int | None = None,
            payload: bytes = b"") -> None:
        """Send one TCP segment src:sport -> dst:dport (see :func:`send_tcp`)."""
        ep = _endpoints(src, dst)
        _check_port(sport, "source")
        _check_port(dport, "destination")
        _check_u32(seq, "seq")
        _check_u32(ack, "ack")
        if not 0 <= flags <= 0x1FF:
            raise UsageError(f"TCP flags {flags:#x} do not fit 9 bits")
        if not 0 <= window <= 0xFFFF:
            raise UsageError(f"TCP window {window} is not in 0..65535 (it is sent unscaled)")
        if tsval is None and tsecr is not None:
            raise UsageError("tsecr without tsval: the timestamp option carries both")
        if tsval is not None:
            _check_u32(tsval, "tsval")
            _check_u32(tsecr or 0, "tsecr")
        packet = _build_tcp(ep, sport, dport, seq, ack, flags, window, tsval, tsecr, payload)
        self._send(ep, packet, f"TCP segment {_hostport(src, sport)} -> {_hostport(dst, dport)} "
                               f"flags {_flag_names(flags)} seq {seq}")

    def udp(self, src: str, sport: int, dst: str, dport: int, payload: bytes, *,
            protocol: int = socket.IPPROTO_UDP) -> None:
        """Send one UDP datagram src:sport -> dst:dport (see :func:`send_udp`); protocol
        UDPLITE (136): a UDP-Lite one, checksummed whole."""
        ep = _endpoints(src, dst)
        _check_port(sport, "source")
        _check_port(dport, "destination")
        if protocol not in (socket.IPPROTO_UDP, UDPLITE):
            raise UsageError(f"protocol {protocol} is not UDP or UDP-Lite")
        packet = _build_udp(ep, sport, dport, bytes(payload), protocol)
        name = "UDP" if protocol == socket.IPPROTO_UDP else "UDP-Lite"
        self._send(ep, packet, f"{name} datagram {_hostport(src, sport)} -> {_hostport(dst, dport)}")


def _hostport(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _flag_names(flags: int) -> str:
    names = [n for bit, n in ((TCP_SYN, "SYN"), (TCP_FIN, "FIN"), (TCP_RST, "RST"),
                              (TCP_PSH, "PSH"), (TCP_ACK, "ACK"), (TCP_URG, "URG"))
             if flags & bit]
    return "|".join(names) or "none"


def send_tcp(src: str, sport: int, dst: str, dport: int, *, seq: int, ack: int, flags: int,
             window: int, mark: int = 0, tsval: int | None = None, tsecr: int | None = None,
             payload: bytes = b"") -> None:
    """Send one TCP segment with any source address and port.

    flags: TCP_FIN | TCP_ACK ...; window: the raw 16-bit field (the receiver
    scales it by the peer's window scale); tsval/tsecr: add the timestamp
    option (NOP, NOP, TS), tsecr defaults to 0; mark: SO_MARK of the raw
    socket (routing, netfilter).  Example, the FIN a half-closed peer had sent::

        send_tcp("127.0.0.1", 40000, "127.0.0.1", 8080, seq=peer_seq, ack=our_seq,
                 flags=TCP_FIN | TCP_ACK, window=512)
    """
    with RawSender(mark=mark) as raw:
        raw.tcp(src, sport, dst, dport, seq=seq, ack=ack, flags=flags, window=window,
                tsval=tsval, tsecr=tsecr, payload=payload)


def send_udp(src: str, sport: int, dst: str, dport: int, payload: bytes, *,
             mark: int = 0) -> None:
    """Send one UDP datagram with any source address and port; the receiver's
    recvfrom() reports (src, sport).  Example::

        send_udp("10.1.2.3", 5353, "127.0.0.1", 9999, b"hello")
    """
    with RawSender(mark=mark) as raw:
        raw.udp(src, sport, dst, dport, payload)

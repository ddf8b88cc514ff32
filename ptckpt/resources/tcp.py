"""Established TCP connections through TCP_REPAIR: both halves of one connection's state.

Dump half: :func:`read_stream_frozen` reads a connection whose socket is in repair
mode (the target frozen, the connection locked by :mod:`ptckpt.netlock`): sequence
numbers of both queues (TCP_REPAIR_QUEUE + TCP_QUEUE_SEQ), both queues read with
MSG_PEEK in repair mode (the send queue holds what the peer has not acknowledged;
SIOCOUTQNSD tells how much of it was never sent), the options the handshake agreed
(mss, window scale, SACK, timestamps: tcp_info.tcpi_options), TCP_TIMESTAMP and
TCP_REPAIR_WINDOW.

Restore half: :func:`make_stream` builds, in ptckpt, a socket in repair mode bound to
the connection's local address and "connected" to its peer without a packet on the
wire, with the same sequence numbers, options, window and queues; a half-closed
connection gets its FINs back (our own by shutdown(); the peer's by a FIN packet
crafted from the peer's address, :mod:`ptckpt.rawpkt`, carrying ptckpt's mark so
that the network lock lets it through).  :func:`leave_repair` ends repair mode
(a window probe tells the peer to go on) and puts SO_REUSEADDR back, which repair
mode overwrites.

The states (include/net/tcp_states.h) and where the FINs are::

    ESTABLISHED  no FIN                    CLOSE_WAIT  peer's FIN received
    FIN_WAIT1    our FIN sent, not acked   LAST_ACK    peer's FIN received, ours sent, not acked
    FIN_WAIT2    our FIN acked             CLOSING     both sent, ours not acked

write_seq (snd_seq) and rcv_nxt (rcv_seq) count a FIN as one sequence number: the
dump takes it off, the restore puts it back when it makes the FIN again.

Measured on Linux 6.18 (loopback): a receive queue of several MiB goes back in one
pass of TCP_RECV_QUEUE sends even on a socket with the default receive buffer; the
getsockopt of TCP_QUEUE_SEQ is an unsigned 32-bit number.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import fcntl
import socket
import struct

from ..errors import RestoreFailed
from ..rawpkt import TCP_ACK, TCP_FIN

TCP_REPAIR, TCP_REPAIR_QUEUE, TCP_QUEUE_SEQ, TCP_REPAIR_OPTIONS = 19, 20, 21, 22
TCP_TIMESTAMP, TCP_REPAIR_WINDOW = 24, 29
REPAIR_ON, REPAIR_OFF, REPAIR_OFF_NO_WP = 1, 0, -1
NO_QUEUE, RECV_QUEUE, SEND_QUEUE = 0, 1, 2
SIOCINQ, SIOCOUTQ, SIOCOUTQNSD, SIOCATMARK = 0x541B, 0x5411, 0x894B, 0x8905
TCPI_OPT_TIMESTAMPS, TCPI_OPT_SACK, TCPI_OPT_WSCALE = 1, 2, 4
TCPOPT_MAXSEG, TCPOPT_WINDOW, TCPOPT_SACK_PERM, TCPOPT_TIMESTAMP = 2, 3, 4, 8
SO_SNDBUFFORCE = 32
_WINDOW = struct.Struct("5I")          # struct tcp_repair_window
_REPAIR_OPT = struct.Struct("II")      # struct tcp_repair_opt

# include/net/tcp_states.h
ESTABLISHED, SYN_SENT, SYN_RECV, FIN_WAIT1, FIN_WAIT2, TIME_WAIT = 1, 2, 3, 4, 5, 6
CLOSE, CLOSE_WAIT, LAST_ACK, LISTEN, CLOSING, NEW_SYN_RECV = 7, 8, 9, 10, 11, 12
STATE_NAMES = {ESTABLISHED: "ESTABLISHED", SYN_SENT: "SYN_SENT", SYN_RECV: "SYN_RECV",
               FIN_WAIT1: "FIN_WAIT1", FIN_WAIT2: "FIN_WAIT2", TIME_WAIT: "TIME_WAIT", CLOSE: "CLOSE",
               CLOSE_WAIT: "CLOSE_WAIT", LAST_ACK: "LAST_ACK", LISTEN: "LISTEN", CLOSING: "CLOSING",
               NEW_SYN_RECV: "NEW_SYN_RECV"}
# the states this module restores (a connection, possibly half closed)
REPAIRABLE = frozenset({ESTABLISHED, FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING})
_OUR_FIN = frozenset({FIN_WAIT1, FIN_WAIT2, LAST_ACK, CLOSING})     # in write_seq
_OUR_FIN_ACKED = frozenset({FIN_WAIT2})
_PEER_FIN = frozenset({CLOSE_WAIT, LAST_ACK, CLOSING})              # in rcv_nxt
CRAFTED_INTO = _OUR_FIN_ACKED | _PEER_FIN    # states a restore reaches with a crafted FIN or ACK
_U32 = 0xFFFFFFFF


def state_name(state: int) -> str:
    return STATE_NAMES.get(state, f"state {state}")


def tcp_info_head(sock: socket.socket) -> tuple[int, int, int, int]:
    """(state, tcpi_options, snd_wscale, rcv_wscale) from TCP_INFO (struct tcp_info's first bytes)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
    state, options, wscale = info[0], info[5], info[6]
    return state, options, wscale & 0xF, wscale >> 4


def ioctl_int(sock: socket.socket, request: int) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, bytes(4)))[0]


# --- repair mode ----------------------------------------------------------------------

def repair_on(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, REPAIR_ON)


def in_repair(sock: socket.socket) -> bool:
    """Whether the socket is in repair mode: TCP_REPAIR_WINDOW answers only then (EPERM otherwise)."""
    try:
        sock.getsockopt(socket.IPPROTO_TCP, TCP_REPAIR_WINDOW, _WINDOW.size)
    except OSError as err:
        if err.errno == _errno.EPERM:
            return False
        raise
    return True


def leave_repair(sock: socket.socket, reuseaddr: int, *, probe: bool = True) -> None:
    """End repair mode (with a window probe: the peer learns where we are) and put back
    SO_REUSEADDR, which entering and leaving repair mode overwrite."""
    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, REPAIR_OFF if probe else REPAIR_OFF_NO_WP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuseaddr)


def _set_u32(sock: socket.socket, option: int, value: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, option, struct.pack("I", value & _U32))


def _queue_seq(sock: socket.socket, queue: int) -> int:
    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, queue)
    return sock.getsockopt(socket.IPPROTO_TCP, TCP_QUEUE_SEQ) & _U32


def _peek(sock: socket.socket, length: int, what: str) -> bytes:
    """Exactly `length` bytes of the selected repair queue (one more asked for: a longer
    queue than the ioctl said is an inconsistency, not a truncation to keep quiet)."""
    if not length:
        return b""
    data = sock.recv(length + 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    if len(data) != length:
        raise OSError(_errno.EIO, f"the {what} queue holds {len(data)} bytes, the kernel said {length}")
    return data


# --- dump half ------------------------------------------------------------------------

def urgent_pending(sock: socket.socket) -> bool:
    """Urgent (out-of-band) data not yet read, or the read position at the urgent mark.
    Checked before repair mode (a MSG_OOB peek does not consume)."""
    try:
        sock.recv(1, socket.MSG_OOB | socket.MSG_PEEK | socket.MSG_DONTWAIT)
        return True
    except BlockingIOError:
        return True                      # the urgent pointer is set, its byte not here yet
    except OSError as err:
        if err.errno != _errno.EINVAL:   # EINVAL: none (or read already, or SO_OOBINLINE)
            raise
    return bool(ioctl_int(sock, SIOCATMARK))


def read_stream_frozen(sock: socket.socket) -> dict:
    """The repair state of a connection whose socket is in repair mode: InetSocket fields."""
    state, options, snd_wscale, rcv_wscale = tcp_info_head(sock)
    outq, unsent, inq = ioctl_int(sock, SIOCOUTQ), ioctl_int(sock, SIOCOUTQNSD), ioctl_int(sock, SIOCINQ)
    if state in _OUR_FIN:                # the FIN is in the write queue, not data
        outq = max(outq - 1, 0)
        unsent = max(unsent - 1, 0)
    window = _WINDOW.unpack(sock.getsockopt(socket.IPPROTO_TCP, TCP_REPAIR_WINDOW, _WINDOW.size))
    rcv_seq = _queue_seq(sock, RECV_QUEUE)
    recv_queue = _peek(sock, inq, "receive")
    snd_seq = _queue_seq(sock, SEND_QUEUE)
    send_queue = _peek(sock, outq, "send")
    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, NO_QUEUE)
    return dict(
        state=state,
        rcv_seq=(rcv_seq - (1 if state in _PEER_FIN else 0)) & _U32,
        snd_seq=(snd_seq - (1 if state in _OUR_FIN else 0)) & _U32,
        recv_queue=recv_queue, send_queue=send_queue, unsent=min(unsent, outq),
        mss=sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG),
        tcp_options=options, snd_wscale=snd_wscale, rcv_wscale=rcv_wscale,
        timestamp=(sock.getsockopt(socket.IPPROTO_TCP, TCP_TIMESTAMP) & _U32
                   if options & TCPI_OPT_TIMESTAMPS else 0),
        window=window,
    )


# --- restore half ---------------------------------------------------------------------

def make_stream(rec, family: int, send_packet, prepare=None) -> socket.socket:
    """A socket, in repair mode, holding connection `rec` (an InetSocket of mode REPAIRED).

    `send_packet(src, sport, dst, dport, seq=, ack=, flags=, window=)` sends a crafted TCP
    segment (ptckpt.rawpkt.send_tcp with ptckpt's mark); it is needed only for a
    connection whose peer had closed its side, or whose own FIN was acknowledged.
    `prepare(sock)` runs first, in repair mode (the caller's socket options).
    The caller turns repair off (leave_repair) once the process holding it is rebuilt.
    """
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        repair_on(sock)
        if prepare is not None:
            prepare(sock)
        _rebuild(sock, rec, family, send_packet)
    except OSError as err:
        sock.close()
        raise RestoreFailed(f"TCP connection {rec.src}:{rec.sport} -> {rec.dst}:{rec.dport} "
                            f"({state_name(rec.state)}): {err.strerror or err}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def _rebuild(sock: socket.socket, rec, family: int, send_packet) -> None:
    sock.bind(_sockaddr(family, rec.src, rec.sport))
    queued = len(rec.recv_queue)
    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, RECV_QUEUE)
    _set_u32(sock, TCP_QUEUE_SEQ, rec.rcv_seq - queued)
    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, SEND_QUEUE)
    _set_u32(sock, TCP_QUEUE_SEQ, rec.snd_seq - len(rec.send_queue))
    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, NO_QUEUE)
    sock.connect(_sockaddr(family, rec.dst, rec.dport))          # no packet: repair mode
    opts = [(TCPOPT_MAXSEG, rec.mss)]
    if rec.tcp_options & TCPI_OPT_SACK:
        opts.append((TCPOPT_SACK_PERM, 0))
    if rec.tcp_options & TCPI_OPT_WSCALE:
        opts.append((TCPOPT_WINDOW, rec.snd_wscale | rec.rcv_wscale << 16))
    if rec.tcp_options & TCPI_OPT_TIMESTAMPS:
        opts.append((TCPOPT_TIMESTAMP, 0))
    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_OPTIONS, b"".join(_REPAIR_OPT.pack(*o) for o in opts))
    if rec.tcp_options & TCPI_OPT_TIMESTAMPS:
        _set_u32(sock, TCP_TIMESTAMP, rec.timestamp)
    _fill(sock, RECV_QUEUE, rec.recv_queue)
    sent = len(rec.send_queue) - rec.unsent
    _fill(sock, SEND_QUEUE, rec.send_queue[:sent])
    if rec.window:
        wnd = list(rec.window)
        if rec.state in _PEER_FIN:       # the FIN packet below advances rcv_nxt by one
            wnd[4] = (wnd[4] - 1) & _U32
            wnd[3] += 1
        sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_WINDOW, _WINDOW.pack(*wnd))
    if rec.unsent:
        # never sent: queued as new data (repair off for the while; the lock holds it back).
        # The send buffer held all of it at the dump: it must here too.
        need = 2 * len(rec.send_queue) + 65536
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < need:
            sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, need // 2)
        sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, REPAIR_OFF_NO_WP)
        view = memoryview(rec.send_queue)[sent:]
        while view:
            try:
                view = view[sock.send(view, socket.MSG_DONTWAIT):]
            except BlockingIOError:
                raise OSError(_errno.ENOBUFS, f"the send buffer took {rec.unsent - len(view)} of "
                                              f"{rec.unsent} unsent bytes") from None
        repair_on(sock)
    peer_ack = (rec.snd_seq - len(rec.send_queue)) & _U32       # what the peer acknowledged
    # the window the peer advertised (snd_wnd), in the peer's scaled units
    peer_window = min((rec.window[1] if rec.window else 65535) >> (rec.snd_wscale if rec.tcp_options
                                                                  & TCPI_OPT_WSCALE else 0), 65535)
    if rec.state in (FIN_WAIT1, FIN_WAIT2, CLOSING):
        _our_fin(sock, acked=rec.state in _OUR_FIN_ACKED)
    if rec.state in _PEER_FIN:
        send_packet(rec.dst, rec.dport, rec.src, rec.sport, seq=rec.rcv_seq, ack=peer_ack,
                    flags=TCP_FIN | TCP_ACK, window=peer_window)
    if rec.state == LAST_ACK:
        _our_fin(sock, acked=False)
    if rec.state in _OUR_FIN_ACKED:
        # the peer's ACK of our FIN moves FIN_WAIT1 on to FIN_WAIT2
        send_packet(rec.dst, rec.dport, rec.src, rec.sport, seq=rec.rcv_seq,
                    ack=(rec.snd_seq + 1) & _U32, flags=TCP_ACK, window=peer_window)


def _our_fin(sock: socket.socket, *, acked: bool) -> None:
    """Our FIN, after the send queue; queued as already sent when the peer had acknowledged it."""
    if acked:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, SEND_QUEUE)
    sock.shutdown(socket.SHUT_WR)
    if acked:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, NO_QUEUE)


def _fill(sock: socket.socket, queue: int, data: bytes) -> None:
    """Queue `data` in repair mode; a chunk the kernel cannot take whole (it allocates a
    linear buffer per send in repair mode) is split in halves."""
    if not data:
        return
    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, queue)
    view, chunk = memoryview(data), len(data)
    while view:
        try:
            n = sock.send(view[:chunk])
        except OSError as err:
            if err.errno in (_errno.ENOMEM, _errno.ENOBUFS, _errno.EAGAIN) and chunk > 1024:
                chunk //= 2
                continue
            raise
        view = view[n:]
    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, NO_QUEUE)


def _sockaddr(family: int, host: str, port: int):
    return (host, port) if family == socket.AF_INET else (host, port, 0, 0)


@contextlib.contextmanager
def repaired(sock: socket.socket):
    """Repair mode for the duration (the dump side's read); off again with SO_REUSEADDR put back."""
    reuse = sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
    repair_on(sock)
    try:
        yield reuse
    finally:
        leave_repair(sock, reuse, probe=False)

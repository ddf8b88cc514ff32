"""Terminals: a process's tty (termios, window size, job control), and a tty again at restore.

Two cases are served:

* a shell job -- a process whose stdio is the terminal it was started from.
  It is restored onto the terminal that runs ``ptckpt restore``: ptckpt puts
  the recorded termios on its own terminal (:func:`apply_terminal_state`) and
  makes the restored process group the foreground one.
* a process living on a pty (under ``script``, tmux, a terminal emulator).
  ``ptckpt restore --new-pty`` gives it a new pty pair with the recorded
  termios and window size (:func:`open_new_pty`); the restored session leader
  makes the slave its controlling terminal (:func:`make_controlling_tty_frozen`)
  and sets its foreground group (:func:`set_foreground_frozen`), both by
  injection.  The master side is then either relayed to ptckpt's own terminal
  until the process exits (:func:`relay`) or handed to a program the user
  names (:func:`spawn_on_master`, see there for the interface).

Dump half: :func:`dump_terminal` reads everything through a pidfd_getfd copy
of the target's fd, which is the target's own open file description, so it
works on a frozen target and changes nothing.  Two of the ioctls are special:
TIOCGPGRP and TIOCGSID on a pty *slave* (or any non-master tty) answer only to
a process whose controlling terminal it is; from ptckpt they fail with ENOTTY
unless the terminal is also ptckpt's own (the shell-job case, when dump runs
on the same terminal).  For a terminal that is the target's controlling tty
the same two numbers are in /proc/PID/stat (tpgid, session), which is used
instead; for any other terminal they are recorded as unknown (None).

ABI (x86_64, include/uapi/asm-generic/termbits.h and ioctls.h): struct
termios2 is four u32 flag words, the line discipline byte, NCCS=19 control
characters, then c_ispeed and c_ospeed (44 bytes, no padding).  TCGETS2 and
TCSETS2 move it whole, speeds included (plain TCGETS has no speed fields:
the kernel's struct termios is the first 36 bytes, the speed lives in CBAUD).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import select
import signal
import stat as _stat
import struct
import termios
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .. import procfs
from ..formats.model import Fd, FdKind, Pty, Terminal
from ..errors import PtckptError, RestoreFailed, UnsupportedResource
from ..tracee import RemoteSyscalls, compat_openat, pidfd_getfd

# --- ioctls (include/uapi/asm-generic/ioctls.h) ---------------------------------
TCGETS = 0x5401
TCSETS = 0x5402
TCGETS2 = 0x802C542A           # _IOR('T', 0x2A, struct termios2)
TCSETS2 = 0x402C542B           # _IOW('T', 0x2B, struct termios2)
TIOCSCTTY = 0x540E
TIOCGPGRP = 0x540F
TIOCSPGRP = 0x5410
TIOCGWINSZ = 0x5413
TIOCSWINSZ = 0x5414
TIOCGSID = 0x5429
TIOCGPTN = 0x80045430          # _IOR('T', 0x30, unsigned int): index of a master's slave
TIOCSPTLCK = 0x40045431        # _IOW('T', 0x31, int): (un)lock the slave
TIOCGPTPEER = 0x5441           # _IO('T', 0x41): open the slave from the master

NCCS = 19
TERMIOS2 = struct.Struct("<IIIIB19sII")    # struct termios2, 44 bytes
WINSIZE = struct.Struct("<HHHH")           # struct winsize: rows, cols, xpixel, ypixel
PID_T = struct.Struct("<i")

UNIX98_PTY_SLAVE_MAJOR = 136               # 136..143 (devpts slaves all use 136 now)
PTMX_DEV = (5, 2)                          # every master is an open of a ptmx inode

O_NOCTTY = 0o400
O_CLOEXEC = 0o2000000
O_LARGEFILE = 0o100000          # what open(2) adds by itself on 64-bit

# relay(): the exit status when until_pid was not our child and had been reaped
# by its own parent before its status could be read.
STATUS_UNKNOWN = -1

_CHUNK = 65536
_SIGTTOU_MASK = 1 << (signal.SIGTTOU - 1)


# --- the state -------------------------------------------------------------------

@dataclass(frozen=True)
class Termios:
    """struct termios2 by field.  `cc` is the kernel's 19 control characters (c_cc[VINTR] ...)."""

    iflag: int
    oflag: int
    cflag: int
    lflag: int
    line: int
    cc: bytes
    ispeed: int
    ospeed: int

    def pack(self) -> bytes:
        return TERMIOS2.pack(self.iflag, self.oflag, self.cflag, self.lflag, self.line,
                             self.cc.ljust(NCCS, b"\0")[:NCCS], self.ispeed, self.ospeed)

    @classmethod
    def unpack(cls, raw: bytes) -> "Termios":
        iflag, oflag, cflag, lflag, line, cc, ispeed, ospeed = TERMIOS2.unpack(raw[:TERMIOS2.size])
        return cls(iflag, oflag, cflag, lflag, line, cc, ispeed, ospeed)

    @property
    def raw(self) -> bytes:
        """The 36-byte struct termios of TCGETS/TCSETS (no speed fields)."""
        return self.pack()[:36]


@dataclass(frozen=True)
class WinSize:
    rows: int
    cols: int
    xpixel: int = 0
    ypixel: int = 0

    def pack(self) -> bytes:
        return WINSIZE.pack(self.rows, self.cols, self.xpixel, self.ypixel)

    @classmethod
    def unpack(cls, raw: bytes) -> "WinSize":
        return cls(*WINSIZE.unpack(raw[:WINSIZE.size]))


@dataclass(frozen=True)
class TerminalState:
    """One terminal as a process saw it at dump time.

    fg_pgrp and sid are pids in ptckpt's pid namespace, None when the terminal
    has none or they could not be learned (see the module docstring).
    pty_index is N of /dev/pts/N for a slave, or of the master's slave.
    """

    termios: Termios
    winsize: WinSize
    fg_pgrp: int | None
    sid: int | None
    controlling: bool          # it is the process's controlling terminal
    pty_slave: bool
    pty_master: bool
    pty_index: int | None
    rdev: int                  # st_rdev of the terminal
    path: str                  # /proc/PID/fd/N link text


# --- small helpers ---------------------------------------------------------------

def _get_termios(fd: int) -> Termios:
    return Termios.unpack(fcntl.ioctl(fd, TCGETS2, bytes(TERMIOS2.size)))


def _set_termios(fd: int, t: Termios) -> None:
    fcntl.ioctl(fd, TCSETS2, t.pack())


def _get_winsize(fd: int) -> WinSize:
    return WinSize.unpack(fcntl.ioctl(fd, TIOCGWINSZ, bytes(WINSIZE.size)))


def _set_winsize(fd: int, w: WinSize) -> None:
    fcntl.ioctl(fd, TIOCSWINSZ, w.pack())


def _ioctl_pid(fd: int, request: int) -> int | None:
    """TIOCGPGRP / TIOCGSID; None when the kernel will not tell us (ENOTTY)."""
    try:
        value = PID_T.unpack(fcntl.ioctl(fd, request, bytes(PID_T.size)))[0]
    except OSError as err:
        if err.errno in (errno.ENOTTY, errno.EIO):
            return None
        raise
    return value if value > 0 else None


def decode_tty_nr(tty_nr: int) -> tuple[int, int]:
    """(major, minor) of the tty_nr field of /proc/PID/stat (new_encode_dev form)."""
    major = (tty_nr >> 8) & 0xFFF
    minor = (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00)
    return major, minor


def _pty_index_from(path: str, rdev: int) -> int:
    m = re.fullmatch(r"/dev/pts/(\d+)", path)
    if m:
        return int(m.group(1))
    return (os.major(rdev) - UNIX98_PTY_SLAVE_MAJOR) * 256 + os.minor(rdev)


@contextlib.contextmanager
def _sigttou_blocked():
    """SIGTTOU blocked in this thread: a background process may then change the
    terminal (tty_check_change lets it through instead of stopping its group)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# --- dump half -------------------------------------------------------------------

def dump_terminal(pid: int, fd: int) -> TerminalState:
    """The terminal that fd `fd` of process `pid` is (the target may be frozen)."""
    try:
        path = procfs.readlink_fd(pid, fd)
    except PtckptError:
        path = ""
    copy = pidfd_getfd(pid, fd)
    try:
        st = os.fstat(copy)
        if not _stat.S_ISCHR(st.st_mode) or not os.isatty(copy):
            raise PtckptError(f"process {pid} fd {fd} ({path}) is not a terminal")
        try:
            tio = _get_termios(copy)
            win = _get_winsize(copy)
        except OSError as err:
            raise PtckptError(f"cannot read the terminal of process {pid} fd {fd} ({path}): "
                              f"{err.strerror}") from None
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        pty_master = (major, minor) == PTMX_DEV
        pty_slave = UNIX98_PTY_SLAVE_MAJOR <= major < UNIX98_PTY_SLAVE_MAJOR + 8
        index = None
        if pty_master:
            with contextlib.suppress(OSError):
                index = struct.unpack("<I", fcntl.ioctl(copy, TIOCGPTN, bytes(4)))[0]
        elif pty_slave:
            index = _pty_index_from(path, st.st_rdev)
        try:
            fg = _ioctl_pid(copy, TIOCGPGRP)
            sid = _ioctl_pid(copy, TIOCGSID)
        except OSError as err:
            raise PtckptError(f"cannot read the job control of process {pid} fd {fd} ({path}): "
                              f"{err.strerror}") from None
    finally:
        os.close(copy)
    pst = procfs.read_stat(pid)
    controlling = pst.tty_nr != 0 and decode_tty_nr(pst.tty_nr) == (major, minor)
    if controlling:
        # From ptckpt the ioctls answer only for a master or ptckpt's own terminal;
        # for the target's controlling terminal /proc says the same.
        if fg is None and pst.tpgid > 0:
            fg = pst.tpgid
        if sid is None:
            sid = pst.session
    return TerminalState(termios=tio, winsize=win, fg_pgrp=fg, sid=sid,
                         controlling=controlling, pty_slave=pty_slave, pty_master=pty_master,
                         pty_index=index, rdev=st.st_rdev, path=path)


def to_record(state: TerminalState, desc: int) -> Terminal:
    w = state.winsize
    return Terminal(termios=state.termios.pack(), rows=w.rows, cols=w.cols, xpixel=w.xpixel, ypixel=w.ypixel,
                    fg_pgrp=-1 if state.fg_pgrp is None else state.fg_pgrp,
                    sid=-1 if state.sid is None else state.sid, controlling=state.controlling, desc=desc)


def from_record(rec: Terminal) -> TerminalState:
    return TerminalState(termios=Termios.unpack(rec.termios), winsize=WinSize(rec.rows, rec.cols, rec.xpixel,
                                                                             rec.ypixel),
                         fg_pgrp=None if rec.fg_pgrp < 0 else rec.fg_pgrp, sid=None if rec.sid < 0 else rec.sid,
                         controlling=rec.controlling, pty_slave=True, pty_master=False, pty_index=None,
                         rdev=0, path="")


# --- pty pairs whose master the tree holds -------------------------------------------

TIOCGPTLCK = 0x80045439        # _IOR('T', 0x39, int)
TIOCGPKT = 0x80045438          # _IOR('T', 0x38, int)
TIOCPKT = 0x5420
TIOCINQ = 0x541B               # FIONREAD


def slave_index(rdev: int) -> int:
    """N of /dev/pts/N from a slave's st_rdev."""
    return (os.major(rdev) - UNIX98_PTY_SLAVE_MAJOR) * 256 + os.minor(rdev)


def master_index(pid: int, fd: int) -> int:
    """N of /dev/pts/N of the slave of master fd `fd` of `pid`."""
    copy = pidfd_getfd(pid, fd)
    try:
        return struct.unpack("<I", fcntl.ioctl(copy, TIOCGPTN, bytes(4)))[0]
    finally:
        os.close(copy)


def _int_ioctl(fd: int, request: int) -> int:
    return PID_T.unpack(fcntl.ioctl(fd, request, bytes(PID_T.size)))[0]


TIOCSTI = 0x5412               # one byte into the tty's input, as if typed (CAP_SYS_ADMIN)
EXTPROC = 0o200000
CAP_SYS_ADMIN = 21
_LINE_MAX = 4096               # n_tty's read buffer: a canonical line is shorter


def dump_pty_frozen(pid: int, fd: int, desc: int) -> Pty:
    """The pty pair of master fd `fd` of frozen `pid`: settings, job control, the bytes the
    slave side wrote that the master has not read, and those typed into the master that
    the program on the slave has not read.

    Nothing else reads either side while the tree is frozen.  The output is read from the
    master and written back at once on the slave with output processing off; the input
    is read from the slave (a line per canonical read, then the unfinished line with
    ICANON off) and typed back at once (:func:`type_in`), so a tree left running reads
    both again.  Packet mode is off meanwhile (turning it on again clears the status byte,
    which must be empty: a status not read yet is refused), so that neither our reads nor
    our termios changes leave a status behind.  Typing back needs TIOCSTI, so CAP_SYS_ADMIN:
    without it a pty with complete lines typed and unread is refused, and a line not
    ended yet (which TIOCINQ does not count, and which cannot be seen without taking it)
    stays for a tree left running but is not in the image.
    """
    copy = pidfd_getfd(pid, fd)
    slave = -1
    paused = False                              # packet mode turned off, to turn on again
    try:
        index = struct.unpack("<I", fcntl.ioctl(copy, TIOCGPTN, bytes(4)))[0]
        tio = _get_termios(copy)
        win = _get_winsize(copy)
        sid = _ioctl_pid(copy, TIOCGSID)
        fg = _ioctl_pid(copy, TIOCGPGRP)
        locked = bool(_int_ioctl(copy, TIOCGPTLCK))
        packet = bool(_int_ioctl(copy, TIOCGPKT))
        what = f"fd {fd} -> /dev/ptmx (the master of /dev/pts/{index})"
        if packet:
            poller = select.poll()
            poller.register(copy, select.POLLPRI)
            if poller.poll(0):
                raise UnsupportedResource(pid, f"{what} in packet mode with a status byte (TIOCPKT_*) "
                                               f"its program has not read yet (dump again once it has)")
        slave = fcntl.ioctl(copy, TIOCGPTPEER, os.O_RDWR | O_NOCTTY | O_CLOEXEC | os.O_NONBLOCK)
        owner = os.fstat(slave)                 # /dev/pts/N: chown'd, chmod'd (grantpt, mesg n)
        typing = can_type_in()
        if not typing:
            # (an unfinished canonical line is not counted, and cannot be seen without taking it)
            typed = _int_ioctl(slave, TIOCINQ)
            if typed:
                raise UnsupportedResource(pid, f"{what} with {typed} bytes typed into the pty that the "
                                               f"program on it has not read yet", why="putting them back "
                                               "needs CAP_SYS_ADMIN (TIOCSTI)",
                                          way_out="dump as root, or once it has read them")
        if packet:
            fcntl.ioctl(copy, TIOCPKT, PID_T.pack(0))
            paused = True
        output = _read_pending(copy)
        typed, lines = take_typed(slave, tio) if typing else (b"", ())
        try:
            type_in(slave, tio, typed, lines)
        except OSError as err:
            raise PtckptError(f"cannot type the {len(typed)} bytes waiting in /dev/pts/{index} back into "
                              f"it (process {pid} fd {fd}): {err.strerror}; the program on it lost "
                              f"them") from None
        if output:
            _write_raw(slave, tio, output)
    except OSError as err:
        raise PtckptError(f"cannot read the pty of process {pid} fd {fd}: {err.strerror}") from None
    finally:
        if paused:
            with contextlib.suppress(OSError):
                fcntl.ioctl(copy, TIOCPKT, PID_T.pack(1))
        os.close(copy)
        if slave >= 0:
            os.close(slave)
    return Pty(desc=desc, index=index, termios=tio.pack(), rows=win.rows, cols=win.cols, xpixel=win.xpixel,
               ypixel=win.ypixel, sid=-1 if sid is None else sid, fg_pgrp=-1 if fg is None else fg,
               locked=locked, packet=packet, output=output, input=typed, input_lines=lines,
               slave_uid=owner.st_uid, slave_gid=owner.st_gid, slave_mode=_stat.S_IMODE(owner.st_mode))


def dump_ptys_frozen(masters: dict[int, tuple[int, int, Fd]], members: set[int]) -> list[Pty]:
    """The PTY records of the tree's pty masters ({index: (desc, a pid holding it, its fd)});
    a pty that is the controlling terminal of a session whose leader is not in the tree is
    refused (no process could take it again)."""
    out = []
    for n, (d, p, f) in masters.items():
        rec = dump_pty_frozen(p, f.fd, d)
        if rec.sid > 0 and rec.sid not in members:
            raise UnsupportedResource(p, f"fd {f.fd} -> /dev/ptmx (the master of /dev/pts/{n}), the "
                                         f"controlling terminal of session {rec.sid}, whose leader is "
                                         f"not in the tree (dump the session's leader too)")
        out.append(rec)
    return out


def dump_stdio_terminals(root: int, fds: Sequence[Fd]) -> list[Terminal]:
    """The terminal the root's stdio is on (termios, window size, job control), once per
    description: a restore puts it on its own terminal, or on a new pty (--new-pty)."""
    out, seen = [], set()
    for f in fds:
        if f.fd <= 2 and f.kind in (FdKind.TTY, FdKind.PTY_SLAVE) and f.desc not in seen:
            seen.add(f.desc)
            try:
                out.append(to_record(dump_terminal(root, f.fd), f.desc))
            except PtckptError:
                pass
    return out


def ctty_key(rec: Pty) -> tuple[str, int]:
    """The hand-off's key of the slave ptckpt opens for the session whose controlling
    terminal pty `rec` is (closed in every stub at fix-up: no fd of the image)."""
    return ("ctty", rec.index)


def is_hung_up(pid: int, fd: int) -> bool:
    """Fd `fd` of `pid` is a tty that was hung up (a pty slave whose master was closed:
    tty_vhangup gave its open files hung_up_tty_fops, whose ioctls fail with EIO)."""
    copy = pidfd_getfd(pid, fd)
    try:
        _get_termios(copy)
    except OSError as err:
        return err.errno == errno.EIO
    finally:
        os.close(copy)
    return False


def hung_up_record(index: int) -> Pty:
    """The PTY record of pty `index`, whose master the tree closed (its slaves are hung up)."""
    return Pty(desc=0, index=index, termios=b"", rows=0, cols=0, xpixel=0, ypixel=0, sid=-1, fg_pgrp=-1,
               locked=False, packet=False, hung_up=True)


def can_type_in() -> bool:
    """TIOCSTI on a tty that is not ours needs CAP_SYS_ADMIN in the initial user namespace."""
    return procfs.capable_in_initial_ns(CAP_SYS_ADMIN)


def _read_pending(master: int) -> bytes:
    """What the master can read now, without waiting (not in packet mode)."""
    flags = fcntl.fcntl(master, fcntl.F_GETFL)
    fcntl.fcntl(master, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    out = b""
    try:
        while True:
            try:
                data = os.read(master, _CHUNK)
            except (BlockingIOError, OSError):
                break
            if not data:
                break
            out += data
    finally:
        fcntl.fcntl(master, fcntl.F_SETFL, flags)
    return out


def _with(tio: Termios, *, iflag: int | None = None, lflag: int | None = None,
          cc: Mapping[int, int] = {}) -> Termios:
    chars = bytearray(tio.cc)
    for i, v in cc.items():
        chars[i] = v
    return Termios(tio.iflag if iflag is None else iflag, tio.oflag, tio.cflag,
                   tio.lflag if lflag is None else lflag, tio.line, bytes(chars), tio.ispeed, tio.ospeed)


def _canonical(tio: Termios) -> bool:
    return bool(tio.lflag & termios.ICANON) and not tio.lflag & EXTPROC


def take_typed(slave: int, tio: Termios) -> tuple[bytes, tuple[int, ...]]:
    """What was typed into the pty that its program has not read, read from `slave` (a
    non-blocking open of it, `tio` its termios): (the bytes, the lengths of the complete
    lines among them, first).  In canonical mode each read gives one line (a 0-byte read:
    an empty line ended by VEOF); the unfinished line is read with ICANON off.  The slave
    is left with ICANON off and VMIN 1: type_in puts `tio` back."""
    data = bytearray()
    lines: list[int] = []
    if _canonical(tio):
        while len(lines) <= _LINE_MAX:
            try:
                chunk = os.read(slave, _LINE_MAX)
            except BlockingIOError:
                break
            lines.append(len(chunk))
            data += chunk
    _set_termios(slave, _with(tio, lflag=tio.lflag & ~termios.ICANON, cc={termios.VMIN: 1, termios.VTIME: 0}))
    while True:
        try:
            chunk = os.read(slave, _CHUNK)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return bytes(data), tuple(lines)


def type_in(slave: int, tio: Termios, data: bytes, lines: Sequence[int]) -> None:
    """`data` into the pty's input again, as take_typed read it, then `tio` on the slave.

    Each byte goes in by TIOCSTI (synchronous, unlike a write on the master, whose bytes
    the line discipline takes later, with whatever termios it has then), under termios
    that take the bytes as they are: no input translation, echo or signals; in canonical
    mode the complete lines end as they did (their last byte, or VEOF for a line that
    had none) and a line end, VEOL or VEOL2 inside a line is quoted with VLNEXT.  The
    editing characters are set to bytes the data does not hold.  ICANON is as in `tio`,
    so putting `tio` back keeps the line boundaries (n_tty resets them on an ICANON change).
    """
    try:
        if data or lines:
            if _canonical(tio):
                seq, replay = _canonical_keys(tio, data, lines)
            else:
                seq, replay = data, _with(tio, iflag=0, lflag=tio.lflag & EXTPROC)
            _set_termios(slave, replay)
            for b in seq:
                fcntl.ioctl(slave, TIOCSTI, bytes((b,)))
    finally:
        _set_termios(slave, tio)


def _canonical_keys(tio: Termios, data: bytes, lines: Sequence[int]) -> tuple[bytes, Termios]:
    ends = {ord("\n"), tio.cc[termios.VEOL], tio.cc[termios.VEOL2]}
    free = [b for b in range(1, 256) if b not in ends and b not in data]
    if len(free) < 6:
        raise OSError(errno.EINVAL, "typed input using every byte value: no free byte for the editing keys")
    erase, kill, eof, werase, reprint, lnext = free[:6]
    replay = _with(tio, iflag=0, lflag=termios.ICANON | termios.IEXTEN,
                   cc={termios.VERASE: erase, termios.VKILL: kill, termios.VEOF: eof, termios.VWERASE: werase,
                       termios.VREPRINT: reprint, termios.VLNEXT: lnext, termios.VMIN: 1, termios.VTIME: 0})
    seq = bytearray()

    def literal(chunk: bytes) -> None:
        for b in chunk:
            seq.extend((lnext, b) if b in ends else (b,))

    pos = 0
    for n in lines:
        line = data[pos:pos + n]
        pos += n
        if line and line[-1] in ends:
            literal(line[:-1])
            seq.append(line[-1])
        else:
            literal(line)
            seq.append(eof)
    literal(data[pos:])
    return bytes(seq), replay


def _write_raw(slave: int, tio: Termios, data: bytes) -> None:
    """`data` written on the slave as it is (OPOST off meanwhile): the master reads it back."""
    raw = Termios(tio.iflag, tio.oflag & ~termios.OPOST, tio.cflag, tio.lflag, tio.line, tio.cc,
                  tio.ispeed, tio.ospeed)
    _set_termios(slave, raw)
    try:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(slave, view):]
            except BlockingIOError:
                select.select([], [slave], [], 1.0)
    finally:
        _set_termios(slave, tio)


def create_pty(rec: Pty, slaves: Sequence[int], master_flags: int = os.O_RDWR | O_LARGEFILE) -> tuple[int, list[int]]:
    """A new pty pair for image record `rec`: (its master, an open of its slave for each of
    the open flags `slaves`), all O_NOCTTY and close-on-exec (FD_CLOEXEC: TIOCGPTPEER would
    keep an O_CLOEXEC among the file's own flags), with the recorded termios, window size, packet mode and lock,
    the recorded output waiting in the master and the recorded input in the slave side.
    The same index when it is free (devpts gives the lowest free one: lower free ones are
    held meanwhile).  A hung-up pty (the tree had closed its master): its slaves are
    opened, then the master is closed, which hangs them up; the master returned is -1.
    Each slave has O_LARGEFILE as its recorded flags say, the master as `master_flags` say
    (a 32-bit program's opens are without it: the master is then opened by the i386 call)."""
    held: list[int] = []
    master = -1
    opened: list[int] = []
    step = "set it up"
    try:
        while True:
            if master_flags & O_LARGEFILE:
                fd = os.open("/dev/ptmx", os.O_RDWR | O_NOCTTY | O_CLOEXEC)
            else:
                fd = compat_openat("/dev/ptmx", os.O_RDWR | O_NOCTTY | O_CLOEXEC)
            index = struct.unpack("<I", fcntl.ioctl(fd, TIOCGPTN, bytes(4)))[0]
            if index == rec.index or index > rec.index or len(held) > 4096:
                master = fd
                break
            held.append(fd)
        fcntl.ioctl(master, TIOCSPTLCK, PID_T.pack(0))
        for flags in slaves or [os.O_RDWR]:
            flags = flags & ~(O_CLOEXEC | os.O_NONBLOCK) | O_NOCTTY
            opened.append(fcntl.ioctl(master, TIOCGPTPEER, flags))
            fcntl.fcntl(opened[-1], fcntl.F_SETFD, fcntl.FD_CLOEXEC)
        if rec.hung_up:
            os.close(master)                    # tty_vhangup of the slaves
            master = -1
            if not slaves:
                os.close(opened.pop())
            return master, opened
        step = "give it its owner and mode"
        _set_owner(opened[0], rec)
        step = "set it up"
        tio = Termios.unpack(rec.termios)
        _set_termios(opened[0], tio)
        _set_winsize(opened[0], WinSize(rec.rows, rec.cols, rec.xpixel, rec.ypixel))
        if rec.output:
            flags = fcntl.fcntl(opened[0], fcntl.F_GETFL)
            fcntl.fcntl(opened[0], fcntl.F_SETFL, flags | os.O_NONBLOCK)
            _write_raw(opened[0], tio, rec.output)
            fcntl.fcntl(opened[0], fcntl.F_SETFL, flags)
        if rec.input or rec.input_lines:
            step = (f"type the {len(rec.input)} bytes waiting in it again (TIOCSTI: it needs "
                    f"CAP_SYS_ADMIN; restore as root)")
            type_in(opened[0], tio, rec.input, rec.input_lines)
            step = "set it up"
        if rec.packet:
            fcntl.ioctl(master, TIOCPKT, PID_T.pack(1))
        if rec.locked:
            fcntl.ioctl(master, TIOCSPTLCK, PID_T.pack(1))
    except OSError as err:
        for fd in opened + ([master] if master >= 0 else []):
            os.close(fd)
        raise RestoreFailed(f"cannot make the pty /dev/pts/{rec.index} again: {step}: {err.strerror}") from None
    finally:
        for fd in held:
            os.close(fd)
    if not slaves:
        os.close(opened.pop())
    return master, opened


def _set_owner(slave: int, rec: Pty) -> None:
    """The slave's recorded owner, group and mode (an image before format 17 has none: a
    new pty's stay).  Changed only where they differ, so that a restore by the user who
    owned it needs no privilege."""
    if rec.slave_uid < 0:
        return
    st = os.fstat(slave)
    if (st.st_uid, st.st_gid) != (rec.slave_uid, rec.slave_gid):
        os.fchown(slave, rec.slave_uid, rec.slave_gid)
    if _stat.S_IMODE(st.st_mode) != rec.slave_mode:
        os.fchmod(slave, rec.slave_mode)


# --- restore half: in ptckpt -----------------------------------------------------

def open_new_pty(state: TerminalState | None = None) -> tuple[int, int, str]:
    """A new pty pair with the recorded termios and window size: (master, slave, slave path).

    /dev/ptmx, unlocked (TIOCSPTLCK 0: what unlockpt does; grantpt has nothing
    to do on devpts), the slave opened from the master (TIOCGPTPEER, so it is
    the slave of this devpts instance whatever is mounted at /dev/pts).  Both
    are O_NOCTTY (ptckpt never acquires it) and close-on-exec: the stubs get
    them by inheritance, not exec.  The caller owns both fds; it must close its
    own slave once the restored processes hold theirs, or the master never sees
    the hang-up when they exit.
    """
    try:
        master = os.open("/dev/ptmx", os.O_RDWR | O_NOCTTY | O_CLOEXEC)
    except OSError as err:
        raise RestoreFailed(f"cannot open /dev/ptmx for a new pty: {err.strerror}") from None
    slave = -1
    try:
        fcntl.ioctl(master, TIOCSPTLCK, PID_T.pack(0))
        index = struct.unpack("<I", fcntl.ioctl(master, TIOCGPTN, bytes(4)))[0]
        slave = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | O_NOCTTY | O_CLOEXEC)
        try:
            path = procfs.readlink_fd(os.getpid(), slave)
        except (OSError, PtckptError):
            path = f"/dev/pts/{index}"
        if state is not None:
            _set_termios(slave, state.termios)
            _set_winsize(slave, state.winsize)
    except OSError as err:
        os.close(master)
        if slave >= 0:
            os.close(slave)
        raise RestoreFailed(f"cannot set up a new pty: {err.strerror}") from None
    return master, slave, path


def apply_terminal_state(fd: int, state: TerminalState, *, foreground_pgrp: int | None,
                         winsize: bool = True) -> None:
    """Put the recorded termios (and window size) on terminal `fd` of ptckpt, then
    make `foreground_pgrp` its foreground process group (None: leave it).

    For the shell-job case `fd` is ptckpt's own terminal.  TIOCSPGRP needs it to
    be ptckpt's controlling terminal and the group to be in ptckpt's session
    (EPERM otherwise): restored jobs are children of ptckpt, so they are, unless
    the image made them session leaders.  SIGTTOU is blocked meanwhile, so a
    ptckpt that is (or, after the TIOCSPGRP, becomes) a background process is
    not stopped by the terminal.

    winsize=False leaves the window size alone: on a real terminal emulator the
    size is the window's, and writing the recorded one would make the kernel's
    idea of it wrong until the next resize.
    """
    with _sigttou_blocked():
        try:
            _set_termios(fd, state.termios)
            if winsize:
                _set_winsize(fd, state.winsize)
        except OSError as err:
            raise RestoreFailed(f"cannot set the termios of terminal fd {fd}: "
                                f"{err.strerror}") from None
        if foreground_pgrp is not None:
            try:
                fcntl.ioctl(fd, TIOCSPGRP, PID_T.pack(foreground_pgrp))
            except OSError as err:
                raise RestoreFailed(f"cannot make process group {foreground_pgrp} the "
                                    f"foreground group of terminal fd {fd}: {err.strerror}") from None


def session_of(fd: int) -> int | None:
    """The session terminal `fd` is the controlling terminal of (None: none, or not ours to ask)."""
    try:
        return _ioctl_pid(fd, TIOCGSID)
    except OSError:
        return None


@dataclass(frozen=True)
class Saved:
    """A terminal of ptckpt's as it was before a restore changed it."""

    fd: int
    termios: Termios
    fg_pgrp: int | None


def save(fd: int) -> Saved | None:
    """What put_back needs to leave terminal `fd` as it is now (None if it is no terminal)."""
    try:
        tio = _get_termios(fd)
    except OSError:
        return None
    return Saved(fd, tio, _ioctl_pid(fd, TIOCGPGRP) if _is_controlling(fd) else None)


def _is_controlling(fd: int) -> bool:
    with contextlib.suppress(OSError):
        return os.tcgetpgrp(fd) > 0
    return False


def put_back(saved: Saved | None) -> None:
    """The terminal's termios and foreground group as save() found them (a restore failed or
    was interrupted after it put the image's settings there); errors are ignored."""
    if saved is None:
        return
    with _sigttou_blocked():
        with contextlib.suppress(OSError):
            _set_termios(saved.fd, saved.termios)
        if saved.fg_pgrp is not None:
            with contextlib.suppress(OSError):
                fcntl.ioctl(saved.fd, TIOCSPGRP, PID_T.pack(saved.fg_pgrp))


def redraw(pgrp: int) -> None:
    """SIGWINCH to a job restored onto ptckpt's terminal: the screen is not the one it drew
    on, and a full-screen program redraws on a window change (learning this terminal's size)."""
    with contextlib.suppress(OSError):
        os.killpg(pgrp, signal.SIGWINCH)


def give_back(fd: int, pgrp: int) -> None:
    """The terminal's foreground group back to `pgrp` (ptckpt's, after a shell job ended)."""
    with _sigttou_blocked(), contextlib.suppress(OSError):
        fcntl.ioctl(fd, TIOCSPGRP, PID_T.pack(pgrp))


# --- restore half: by injection --------------------------------------------------

def make_controlling_tty_frozen(remote: RemoteSyscalls, fd: int, *, steal: bool = False) -> None:
    """ioctl(fd, TIOCSCTTY, steal) inside a restored process: `fd` becomes its controlling tty.

    The process must be a session leader without a controlling terminal (it
    called setsid before), and `fd` must be open for reading; it also becomes
    the terminal's foreground group.  If the terminal is already the
    controlling tty of another session the kernel says EPERM; with steal=True
    (arg 1) it takes it away from that session, but only if the process has
    CAP_SYS_ADMIN.  Calling it again for its own terminal is a no-op.

    Order matters at restore: only the caller gets the terminal; the other
    members of the session have it only if they are forked from the leader
    after this call (a process's controlling tty is copied at fork and never
    given to existing processes).  So: leader setsid, this, then its children.
    """
    remote.checked("ioctl", fd, TIOCSCTTY, 1 if steal else 0,
                   step=f"make fd {fd} the controlling terminal")


def set_foreground_frozen(remote: RemoteSyscalls, fd: int, pgrp: int) -> None:
    """ioctl(fd, TIOCSPGRP, &pgrp) inside a restored process of the terminal's session.

    `fd` must be the process's controlling terminal and `pgrp` a group of its
    session.  A caller in a background group would get SIGTTOU (its whole
    group stopped, the ioctl failing with ERESTARTSYS); so SIGTTOU is blocked
    in the injected thread around the call with PTRACE_SETSIGMASK, and its mask
    is put back after, whatever happens.  Nothing is left pending: with the
    signal blocked the kernel does not send it at all.
    """
    task = remote.task
    old = task.get_sigmask()
    task.set_sigmask(old | _SIGTTOU_MASK)
    try:
        with remote.scratch(PID_T.pack(pgrp)) as p:
            remote.checked("ioctl", fd, TIOCSPGRP, int(p),
                           step=f"make process group {pgrp} the foreground group of fd {fd}")
    finally:
        task.set_sigmask(old)


# --- the master side: relay to ptckpt's terminal ----------------------------------

def _make_raw(t: list) -> list:
    """cfmakeraw(3) on a termios.tcgetattr list."""
    t = list(t)
    t[0] &= ~(termios.IGNBRK | termios.BRKINT | termios.PARMRK | termios.ISTRIP
              | termios.INLCR | termios.IGNCR | termios.ICRNL | termios.IXON)
    t[1] &= ~termios.OPOST
    t[3] &= ~(termios.ECHO | termios.ECHONL | termios.ICANON | termios.ISIG | termios.IEXTEN)
    t[2] &= ~(termios.CSIZE | termios.PARENB)
    t[2] |= termios.CS8
    cc = list(t[6])
    cc[termios.VMIN] = 1
    cc[termios.VTIME] = 0
    t[6] = cc
    return t


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _eof_bytes(master_fd: int) -> bytes:
    """What tells the program on the slave that its input ended: VEOF in canonical mode
    (it ends a pending partial line first; only at a line start is it a 0-byte read)."""
    try:
        t = _get_termios(master_fd)       # a master's termios ioctls act on its slave
    except OSError:
        return b""
    if t.lflag & termios.ICANON:
        return t.cc[termios.VEOF:termios.VEOF + 1]
    return b""


def _read_master(master_fd: int) -> bytes | None:
    """Bytes from the (non-blocking) master; b"" if none now, None once it hung up.

    A non-blocking read of a pty master first flushes the kernel's pending
    flip buffer (n_tty_read), so bytes the slave side wrote before now are
    never missed.
    """
    try:
        data = os.read(master_fd, _CHUNK)
    except BlockingIOError:
        return b""
    except OSError as err:
        if err.errno == errno.EIO:        # every slave fd is closed
            return None
        raise
    return data if data else None


def _exit_status(status: int) -> int:
    """Shell convention: the exit code, or 128 + the signal that killed it."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class _Waiter:
    """Tells when `pid` has ended and how: waitpid for our child, /proc for another's."""

    def __init__(self, pid: int):
        self.pid = pid
        self.status: int | None = None
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
            self.ours = True
            if got:
                self.status = _exit_status(status)
        except ChildProcessError:
            self.ours = False
        self.pidfd = -1
        if self.status is None:
            try:
                self.pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                self.status = self._collect()

    def _collect(self) -> int:
        if self.ours:
            return _exit_status(os.waitpid(self.pid, 0)[1])
        try:
            st = procfs.read_stat(self.pid)
        except PtckptError:
            return STATUS_UNKNOWN
        return _exit_status(st.exit_code) if st.state in ("Z", "X") else STATUS_UNKNOWN

    def ended(self) -> int:
        """Called once the pidfd is readable (the process exited)."""
        if self.status is None:
            self.status = self._collect()
        return self.status

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def relay(master_fd: int, *, stdin_fd: int = 0, stdout_fd: int = 1,
          until_pid: int | None = None) -> int:
    """Copy bytes between ptckpt's terminal (stdin_fd, stdout_fd) and a pty master.

    Ends when the master hangs up (every slave fd closed: EIO) or, with
    `until_pid`, when that process exits (its last output is still copied).
    Returns the exit status of until_pid (shell convention: code, or 128+signal;
    STATUS_UNKNOWN if it was not ptckpt's child and its parent reaped it before
    /proc showed it), waiting for its end if it outlives its terminal; 0
    without until_pid.

    When stdin_fd is a terminal it is put in raw mode for the duration (and put
    back in the end, whatever happens), so every key, ^C and ^Z included, goes
    to the program on the pty; its window size is copied to the pty at the
    start and again at each SIGWINCH (the kernel then signals the pty's
    foreground group).  SIGWINCH is caught only in the main thread.  When
    stdin_fd reaches end of file, VEOF is sent if the pty is in canonical mode
    (as script(1) does) and stdin is no longer read.  The master is made
    non-blocking while relaying; stdin and stdout, which ptckpt shares with its
    shell, keep their flags.
    """
    waiter = _Waiter(until_pid) if until_pid is not None else None
    try:
        _relay_loop(master_fd, stdin_fd, stdout_fd, waiter)
        if waiter is None:
            return 0
        if waiter.status is None:
            # The terminal hung up first: the process may outlive it; wait for its end.
            select.select([waiter.pidfd], [], [])
            waiter.ended()
        return waiter.status
    finally:
        if waiter is not None:
            waiter.close()


def _relay_loop(master_fd: int, stdin_fd: int, stdout_fd: int, waiter: _Waiter | None) -> None:
    """Relay with stdin raw (when a terminal) and the window size followed (SIGWINCH, in the
    main thread); the master's flags, stdin's termios and the SIGWINCH handler put back."""
    tty_in = os.isatty(stdin_fd)
    size_src = stdin_fd if tty_in else (stdout_fd if os.isatty(stdout_fd) else None)
    saved_tio = None
    wake_r = wake_w = -1
    old_winch = None
    old_flags = fcntl.fcntl(master_fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(master_fd, fcntl.F_SETFL, old_flags | os.O_NONBLOCK)
        if tty_in:
            saved_tio = termios.tcgetattr(stdin_fd)
            with _sigttou_blocked():
                termios.tcsetattr(stdin_fd, termios.TCSADRAIN, _make_raw(saved_tio))

        def copy_size() -> None:
            with contextlib.suppress(OSError):
                _set_winsize(master_fd, _get_winsize(size_src))

        if size_src is not None:
            copy_size()
            if threading.current_thread() is threading.main_thread():
                wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

                def on_winch(_signo, _frame) -> None:
                    with contextlib.suppress(OSError):
                        os.write(wake_w, b"w")
                old_winch = signal.signal(signal.SIGWINCH, on_winch)

        _relay_copy(master_fd, stdin_fd, stdout_fd, waiter, wake_r, copy_size)
    finally:
        if old_winch is not None:
            signal.signal(signal.SIGWINCH, old_winch)
        for end in (wake_r, wake_w):
            if end >= 0:
                os.close(end)
        if saved_tio is not None:
            with _sigttou_blocked(), contextlib.suppress(termios.error):
                termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved_tio)
        with contextlib.suppress(OSError):
            fcntl.fcntl(master_fd, fcntl.F_SETFL, old_flags)


def _relay_copy(master_fd: int, stdin_fd: int, stdout_fd: int, waiter: _Waiter | None, wake_r: int,
                copy_size) -> None:
    """Copy between the master and stdin/stdout until the master hangs up or the process
    ends (what the master still holds drained then); a byte on `wake_r` (SIGWINCH) copies
    the window size again."""
    to_master = b""
    stdin_open = True
    while True:
        if waiter is not None and waiter.status is not None:
            _drain(master_fd, stdout_fd)
            return
        rlist = [master_fd]
        if stdin_open and len(to_master) < _CHUNK:
            rlist.append(stdin_fd)
        if waiter is not None:
            rlist.append(waiter.pidfd)
        if wake_r >= 0:
            rlist.append(wake_r)
        r, w, _ = select.select(rlist, [master_fd] if to_master else [], [])
        if wake_r in r:
            with contextlib.suppress(OSError):
                os.read(wake_r, 64)
            copy_size()
        if master_fd in r:
            data = _read_master(master_fd)
            if data is None:
                return
            _write_all(stdout_fd, data)
        if stdin_fd in r:
            data = os.read(stdin_fd, _CHUNK)
            if data:
                to_master += data
            else:
                stdin_open = False
                to_master += _eof_bytes(master_fd)
        if master_fd in w and to_master:
            left = _write_master(master_fd, to_master)
            if left is None:
                return
            to_master = left
        if waiter is not None and waiter.pidfd in r:
            waiter.ended()


def _write_master(master_fd: int, data: bytes) -> bytes | None:
    """Write what the (non-blocking) master takes of `data`; what is left, or None when the
    master hung up (EIO)."""
    try:
        n = os.write(master_fd, data)
        return data[n:]
    except BlockingIOError:
        return data
    except OSError as err:
        if err.errno == errno.EIO:
            return None
        raise


def _drain(master_fd: int, stdout_fd: int) -> None:
    """Copy what the master still holds, without waiting for more."""
    while True:
        data = _read_master(master_fd)
        if not data:
            return
        _write_all(stdout_fd, data)


# --- the master side: handed to a program -----------------------------------------

def spawn_on_master(master_fd: int, argv: Sequence[str], *,
                    env: Mapping[str, str] | None = None) -> int:
    """Run `argv` (searched in PATH) with the pty master as its stdin and stdout; its pid.

    The interface (``ptckpt restore --new-pty-program CMD``): the program reads
    what the restored process writes to its terminal from fd 0 and writes what
    should be typed into it to fd 1.  Its stderr and every other fd it gets are
    ptckpt's own (ptckpt's fds are close-on-exec, so neither the slave nor the
    restored processes' fds leak into it).  The environment is ptckpt's plus
    `env`; the CLI should put PTCKPT_PTS (the slave path) and PTCKPT_PID (the
    restored process) there.  When the program exits and ptckpt has closed its
    own copy of the master, the restored session gets a hang-up (SIGHUP), as
    when a terminal window is closed.  The master is made blocking first.

    Programs that fit are byte relays, e.g.
      ``socat - UNIX-LISTEN:/tmp/job.sock`` and later, from any terminal or a
      tmux window, ``socat -,raw,echo=0 UNIX-CONNECT:/tmp/job.sock``;
      ``tmux new-session -d 'socat ...CONNECT...'`` through such a socket (tmux
      itself runs panes on ptys of its own, so it cannot adopt the master directly);
      ``socat - TCP-LISTEN:7000,reuseaddr`` to reach it over the network;
      ``tee -a /tmp/job.log`` just to record the output.
    """
    if not argv:
        raise PtckptError("no program given to hand the new pty to")
    child_env = dict(os.environ)
    if env:
        child_env.update(env)
    flags = fcntl.fcntl(master_fd, fcntl.F_GETFL)
    fcntl.fcntl(master_fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    # A copy above 2, so that dup2 onto 0 and 1 always makes new fds without
    # close-on-exec, whatever number the master has.
    tmp = fcntl.fcntl(master_fd, fcntl.F_DUPFD_CLOEXEC, 3)
    try:
        return os.posix_spawnp(argv[0], list(argv), child_env, file_actions=[
            (os.POSIX_SPAWN_DUP2, tmp, 0),
            (os.POSIX_SPAWN_DUP2, tmp, 1),
        ])
    except OSError as err:
        raise PtckptError(f"cannot run {argv[0]!r} on the new pty: {err.strerror}") from None
    finally:
        os.close(tmp)

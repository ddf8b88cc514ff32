"""Images over the network: ``ptckpt page-server`` receives images (and restores them on
request), ``ptckpt push`` and ``ptckpt migrate`` send them.

Transport: TCP (``HOST:PORT``) or a unix socket (``unix:PATH``, which also reaches
another network namespace of the same host).  The server listens on exactly the address
it is given, nothing else.

Authentication: a shared token (a file, or $PTCKPT_TOKEN).  The server opens with a
random challenge; the client answers with HMAC-SHA256(token, challenge); the server
compares in constant time and says OK or DENIED (and closes).  The token itself never
crosses the wire.  (The traffic is not encrypted: use it on a trusted network, or through
an SSH tunnel to a unix socket.)

Messages: a 4-byte big-endian length and a JSON object; a file's bytes follow its
``file`` message raw.  Requests and replies:

* ``{"op": "file", "path": "BUNDLE/IMAGE/NAME", "size": N, "mode": M}`` + N bytes:
  written under the server's directory (0700 directories, the file's mode at most 0600;
  no absolute paths, no ``..``).  ``{"op": "commit", "image": "BUNDLE/IMAGE"}`` answers
  ``{"ok": true}`` once every file of the image is in (fsync'd), or the reason.
* ``{"op": "restore", "image": "BUNDLE/IMAGE", "args": [...]}``: the server runs
  ``ptckpt restore -D DIR --detach --json ARGS`` and answers ``{"ok": true, "result":
  {...}}`` with restore's JSON, or ``{"ok": false, "error": "..."}`` with its error line.
  Only restore's own options are passed (an allow-list).
* ``{"op": "bye"}``.
* Page data streamed by ``dump --page-server`` and read back by ``restore --page-server``:
  ``write``, ``discard``, ``seal``, ``stat`` and ``read`` (ptckpt.pagestream, which
  handles them here too).

An image with parents (pre-dumps, incremental dumps) is sent with them, each as a
sibling directory of the bundle, as its ``inventory.img`` names them (``../NAME``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence

from .errors import PtckptError, TransferError, UsageError

log = logging.getLogger("ptckpt.transfer")

GREETING = b"PTCKPT-IMAGES 1"
BLOCK = 1 << 20
RESTORE_FLAGS = {"--pidns", "--netns", "--lazy", "--inherit-stdio"}
RESTORE_VALUED = {"--file-policy", "--plugin", "--remap-path", "--set-env", "--unset-env", "--remap-addr"}


def read_token(token_file: str | None) -> bytes:
    """The shared token: the file's contents (stripped), else $PTCKPT_TOKEN."""
    if token_file:
        try:
            with open(token_file, "rb") as f:
                token = f.read().strip()
        except OSError as err:
            raise UsageError(f"--token-file {token_file}: {err.strerror}") from None
    else:
        token = os.environ.get("PTCKPT_TOKEN", "").encode()
    if len(token) < 16:
        raise UsageError("a page server needs a shared token of 16 bytes or more: --token-file FILE "
                         "or $PTCKPT_TOKEN")
    return token


def parse_address(address: str) -> tuple[int, object]:
    """(family, sockaddr) of HOST:PORT or unix:PATH."""
    if address.startswith("unix:"):
        return socket.AF_UNIX, address[5:]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UsageError(f"{address!r}: give HOST:PORT or unix:PATH")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return family, (host, int(port))


# --- framing ------------------------------------------------------------------------

class Channel:
    """One authenticated connection: JSON messages and raw file bytes."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer

    def send(self, msg: dict, data: bytes = b"") -> None:
        body = json.dumps(msg).encode()
        self.sendall(struct.pack(">I", len(body)) + body + data)

    def sendall(self, data) -> None:
        try:
            self.sock.sendall(data)
        except OSError as err:
            raise TransferError(f"{self.peer}: the connection broke ({err.strerror or err})") from None

    def recv(self, eof_ok: bool = False) -> dict | None:
        """The next message; with `eof_ok`, None when the peer closed between messages."""
        if eof_ok:
            first = self._recv(1)
            if not first:
                return None
            head = first + self._exact(3)
        else:
            head = self._exact(4)
        (n,) = struct.unpack(">I", head)
        if n > 1 << 20:
            raise TransferError(f"{self.peer}: a message of {n} bytes: not a ptckpt page server or client")
        try:
            return json.loads(self._exact(n))
        except ValueError:
            raise TransferError(f"{self.peer}: a message that is not JSON") from None

    def _recv(self, n: int) -> bytes:
        try:
            return self.sock.recv(n)
        except OSError as err:
            raise TransferError(f"{self.peer}: the connection broke ({err.strerror or err})") from None

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._recv(min(n - len(buf), BLOCK))
            if not chunk:
                raise TransferError(f"{self.peer}: the connection broke")
            buf += chunk
        return bytes(buf)

    def recv_some(self, most: int) -> bytes:
        """Up to `most` bytes (at least one) as they come."""
        chunk = self._recv(min(most, BLOCK))
        if not chunk:
            raise TransferError(f"{self.peer}: the connection broke")
        return chunk

    def recv_into(self, view: memoryview) -> None:
        """Exactly len(view) bytes, straight into `view`."""
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except OSError as err:
                raise TransferError(f"{self.peer}: the connection broke ({err.strerror or err})") from None
            if not n:
                raise TransferError(f"{self.peer}: the connection broke")
            got += n

    def sendfile(self, fd: int, offset: int, size: int) -> None:
        """`size` bytes of file `fd` from `offset`, raw."""
        try:
            while size:
                n = os.sendfile(self.sock.fileno(), fd, offset, size)
                if not n:
                    raise TransferError(f"{self.peer}: the file ended early")
                offset += n
                size -= n
        except OSError as err:
            raise TransferError(f"{self.peer}: the connection broke ({err.strerror or err})") from None

    def recv_into_file(self, fd: int, size: int) -> None:
        left = size
        while left:
            chunk = self._recv(min(left, BLOCK))
            if not chunk:
                raise TransferError(f"{self.peer}: the connection broke")
            os.write(fd, chunk)
            left -= len(chunk)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _mac(token: bytes, challenge: bytes) -> bytes:
    return hmac.new(token, challenge, hashlib.sha256).hexdigest().encode()


# --- the client side ------------------------------------------------------------------

def connect(address: str, token: bytes, timeout: float = 30.0) -> Channel:
    family, where = parse_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(where)
        greeting = _line(sock)
        if not greeting.startswith(GREETING + b" "):
            raise TransferError(f"{address}: not a ptckpt page server")
        sock.sendall(_mac(token, greeting.split()[-1]) + b"\n")
        answer = _line(sock)
    except OSError as err:
        sock.close()
        raise TransferError(f"no page server at {address}: {err.strerror or err}") from None
    except TransferError:
        sock.close()
        raise
    if answer != b"OK":
        sock.close()
        raise TransferError(f"{address}: the page server refused the token")
    sock.settimeout(None)
    return Channel(sock, address)


def _line(sock: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise TransferError("the connection closed during the greeting")
        buf += chunk
        if len(buf) > 256:
            raise TransferError("not a ptckpt page server")
    return buf.strip()


def image_chain(directory: str) -> list[str]:
    """The image and its parents, oldest first; each parent must be a sibling (../NAME)."""
    from .formats.image import ImageReader
    chain = [os.path.abspath(directory)]
    while True:
        with ImageReader(chain[0], verify_pages=False) as reader:
            parent = reader.inventory.parent
        if not parent:
            return chain
        where = os.path.normpath(os.path.join(chain[0], parent))
        if os.path.dirname(where) != os.path.dirname(chain[-1]):
            raise UsageError(f"{chain[0]}: its parent {parent} is not beside it; fold the chain first "
                             f"(ptckpt compact -D {directory} -o NEW)")
        chain.insert(0, where)


def send_image(chan: Channel, directory: str, bundle: str) -> int:
    """Send one image directory (not its parents) as BUNDLE/NAME; returns bytes sent."""
    name = os.path.basename(os.path.abspath(directory))
    sent = 0
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if not os.path.isfile(path) or entry.startswith("."):
            continue
        st = os.stat(path)
        chan.send({"op": "file", "path": f"{bundle}/{name}/{entry}", "size": st.st_size, "mode": st.st_mode & 0o777})
        with open(path, "rb") as f:
            while chunk := f.read(BLOCK):
                chan.sendall(chunk)
        sent += st.st_size
    chan.send({"op": "commit", "image": f"{bundle}/{name}"})
    reply = chan.recv()
    if not reply.get("ok"):
        raise TransferError(f"{chan.peer}: the page server did not take {name}: {reply.get('error')}")
    return sent


def restore_args(args: Sequence[str]) -> list[str]:
    """Check options meant for the other side's restore against the allow-list."""
    out, it = [], iter(args)
    for a in it:
        if a in RESTORE_FLAGS:
            out.append(a)
        elif a in RESTORE_VALUED:
            value = next(it, None)
            if value is None:
                raise UsageError(f"{a} needs a value")
            out += [a, value]
        else:
            raise UsageError(f"{a}: not a restore option a page server takes "
                             f"({', '.join(sorted(RESTORE_FLAGS | RESTORE_VALUED))})")
    return out


def remote_restore(chan: Channel, image: str, args: Sequence[str]) -> dict:
    chan.send({"op": "restore", "image": image, "args": list(args)})
    reply = chan.recv()
    if not reply.get("ok"):
        raise TransferError(f"{chan.peer}: the restore there failed: {reply.get('error')}")
    return reply["result"]


def push(directory: str, address: str, token: bytes, bundle: str | None = None) -> tuple[str, int]:
    """Send an image (with its parents) to a page server; (its path there, bytes sent)."""
    chain = image_chain(directory)
    bundle = bundle or secrets.token_hex(6)
    chan = connect(address, token)
    try:
        sent = sum(send_image(chan, d, bundle) for d in chain)
        chan.send({"op": "bye"})
    finally:
        chan.close()
    return f"{bundle}/{os.path.basename(chain[-1])}", sent


# --- the server side ------------------------------------------------------------------

def _private_dirs(top: str, path: str) -> None:
    """mkdir -p `path` under `top`, every level made 0700 (images hold memory secrets)."""
    os.makedirs(top, mode=0o700, exist_ok=True)          # removed meanwhile: made again
    rel = os.path.relpath(path, top)
    at = top
    for part in rel.split(os.sep) if rel != "." else ():
        at = os.path.join(at, part)
        try:
            os.mkdir(at, 0o700)
        except FileExistsError:
            continue
        os.chmod(at, 0o700)


class PageServer:
    """Receives images into `directory` and restores them on request."""

    def __init__(self, address: str, directory: str, token: bytes, once: bool = False):
        self.address = address
        self.directory = os.path.abspath(directory)
        self.token = token
        self.once = once
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        os.chmod(self.directory, 0o700)
        family, where = parse_address(address)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_UNIX:
            with contextlib.suppress(FileNotFoundError):
                if os.path.exists(where) and not os.path.isdir(where):
                    os.unlink(where)
        else:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind(where)
        except OSError as err:
            self.sock.close()
            raise UsageError(f"cannot listen on {address}: {err.strerror}") from None
        if family == socket.AF_UNIX:
            os.chmod(where, 0o600)
        self.sock.listen(8)

    def serve(self) -> None:
        """Accept connections (one thread each) until `once` is done or the process ends."""
        while True:
            conn, _ = self.sock.accept()
            t = threading.Thread(target=self._session, args=(conn,), daemon=True)
            t.start()
            if self.once:
                t.join()
                return

    def _session(self, conn: socket.socket) -> None:
        from . import pagestore
        peer = self.address
        chan = Channel(conn, peer)
        streams = pagestore.StreamSession(self.directory, self._path, _private_dirs)
        try:
            challenge = secrets.token_hex(32).encode()
            conn.sendall(GREETING + b" " + challenge + b"\n")
            conn.settimeout(30)
            answer = _line(conn)
            if not hmac.compare_digest(answer, _mac(self.token, challenge)):
                conn.sendall(b"DENIED\n")
                log.warning("page server: a connection with a wrong token was refused")
                return
            conn.sendall(b"OK\n")
            conn.settimeout(None)
            while True:
                msg = chan.recv(eof_ok=True)
                if msg is None:                  # closed between requests (a restore reading pages)
                    return
                op = msg.get("op")
                if op in pagestore.OPS:
                    streams.handle(chan, msg)
                elif op == "file":
                    self._receive_file(chan, msg)
                elif op == "commit":
                    chan.send(self._commit(msg.get("image", "")))
                elif op == "restore":
                    chan.send(self._restore(msg.get("image", ""), msg.get("args", [])))
                elif op == "bye":
                    return
                else:
                    chan.send({"ok": False, "error": f"unknown request {op!r}"})
                    return
        except (PtckptError, OSError, KeyError, ValueError) as err:
            log.warning("page server: %s", err)
        finally:
            streams.end()
            chan.close()

    def _path(self, rel: str) -> str:
        parts = rel.split("/")
        if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise TransferError(f"refused path {rel!r}")
        return os.path.join(self.directory, *parts)

    def _receive_file(self, chan: Channel, msg: dict) -> None:
        from . import testhooks
        path = self._path(str(msg["path"]))
        _private_dirs(self.directory, os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            testhooks.reached("page-server-file")
            chan.recv_into_file(fd, int(msg["size"]))
            os.fchmod(fd, int(msg.get("mode", 0o600)) & 0o600)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _commit(self, image: str) -> dict:
        from .formats.image import ImageReader
        try:
            with ImageReader(self._path(image), verify_pages=False):
                pass
        except PtckptError as err:
            return {"ok": False, "error": str(err)}
        return {"ok": True}

    def _restore(self, image: str, args: Sequence[str]) -> dict:
        try:
            argv = [sys.executable, "-m", "ptckpt", "restore", "-D", self._path(image), "--detach", "--json",
                    *restore_args(args)]
        except PtckptError as err:
            return {"ok": False, "error": str(err)}
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if res.returncode != 0:
            lines = [line for line in res.stderr.splitlines() if line.startswith("ptckpt: error:")]
            return {"ok": False, "error": (lines or res.stderr.strip().splitlines() or ["no output"])[-1]}
        try:
            return {"ok": True, "result": json.loads(res.stdout)}
        except ValueError:
            return {"ok": False, "error": f"restore printed {res.stdout[:200]!r}"}

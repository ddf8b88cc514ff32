"""The table of kinds (ptckpt.kinds): every kind the kernel shows has a row, the dump looks
kinds up there (an unknown one is refused), and the table is walked against the fixtures:
what a fixture's dump holds is a kind the table says is restored, and every kind the table
says is restored is held by a fixture here (or by the test named beside it)."""

from __future__ import annotations

import pytest

from ptckpt import kinds
from ptckpt.check import kinds_table
from ptckpt.errors import UnsupportedResource
from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import Fd, FdKind, Vma, VmaKind
from ptckpt.resources import files, memory

# (fixture, its arguments; "DIR": an empty directory of the test's)
FIXTURES = [("fdkinds", "DIR"), ("files", "DIR"), ("notify", "fanotify", "DIR"), ("deleted", "DIR"),
            ("pidfds",), ("ptypair", "queues"), ("nsfds.py", "own"), ("pingkinds.py", "ping-connected", "4"),
            ("pingkinds.py", "udplite", "6"), ("unixkinds.py", "scm", "dgram"), ("netkinds.py", "netlink-bound"), ("rawkinds.py", "raw"),
            ("netkinds.py", "tcp-bound"), ("udpserver",), ("shmobjects",), ("threads",), ("forkserver",)]
# restored kinds no fixture above holds, and the tests that hold them
ELSEWHERE = {
    FdKind.TTY: "tests/test_tty.py (a real terminal, through tmux)",
    VmaKind.DEVICE: "no fixture maps a device; refused nowhere, mapped again by path",
    VmaKind.VSYSCALL: "the kernel's own, in every process where the kernel has it",
    VmaKind.VVAR_VCLOCK: "with the vdso, where the kernel has it",
}


def test_every_kind_the_model_knows_has_a_row():
    assert set(kinds.FD) == set(FdKind)
    assert set(kinds.MAPPINGS) == set(VmaKind)
    for name, kind in kinds.ANON_INODES.items():
        assert kind in kinds.FD, name
    for row in kinds_table():
        assert row.restored != bool(row.refusal), row          # one or the other, never neither


def test_a_kind_the_table_does_not_know_is_refused():
    assert kinds.anon_inode_kind("[a-new-thing]") is FdKind.ANON_INODE
    assert not kinds.socket_kind("AF_BLUETOOTH", "SOCK_STREAM", "3").restored
    assert not kinds.socket_kind("AF_INET", "SOCK_SEQPACKET", "132").restored      # SCTP
    assert kinds.socket_kind("AF_UNIX", "SOCK_SEQPACKET", "0").restored
    odd = _fd(9, FdKind.ANON_INODE, "anon_inode:[a-new-thing]")
    sctp = _fd(10, FdKind.SOCKET, "socket:[7]", ("family", "AF_INET"), ("type", "SOCK_SEQPACKET"), ("protocol", "132"))
    said = files.unsupported_fds([odd, sctp])
    assert said[0] == "fd 9 -> anon_inode:[a-new-thing] (anon_inode: an anonymous-inode kind this ptckpt does not know)"
    assert said[1].startswith("fd 10 -> socket:[7] (a socket of this family and type: AF_INET SOCK_SEQPACKET")
    with pytest.raises(UnsupportedResource, match="a kind of mapping ptckpt cannot make again"):
        memory.check_vmas(7, [Vma(0x1000, 0x2000, 1, False, VmaKind.OTHER, 0, 0, 0, 0, "[uprobes]", "rd mr")])


def _fd(n: int, kind: FdKind, path: str, *details) -> Fd:
    return Fd(n, kind, path, 2, 0, False, 0, 0, 0, 0, 0, 0, 0, details=tuple(details))


def _holdings(image_dir) -> tuple[set, set, set]:
    """(fd kinds, (family, type, protocol) of sockets, mapping kinds) an image holds."""
    fds, socks, maps = set(), set(), set()
    with ImageReader(image_dir) as image:
        held = [f for p in image.pids for f in image.process(p).fds] + list(image.in_flight)
        for p in image.pids:
            maps |= {v.kind for v in image.process(p).vmas}
    for f in held:
        fds.add(f.kind)
        if f.kind is FdKind.SOCKET:
            d = dict(f.details)
            socks.add(kinds.socket_kind(d.get("family", ""), d.get("type", ""), d.get("protocol", "")))
    return fds, socks, maps


def test_the_table_walked_against_the_fixtures(spawn, ptckpt, tmp_path):
    fds, socks, maps = set(), set(), set()
    for n, (name, *args) in enumerate(FIXTURES):
        where = tmp_path / f"dir{n}"
        where.mkdir()
        target = spawn(name, *[str(where) if a == "DIR" else a for a in args])
        res = ptckpt("dump", target.pid, "-D", tmp_path / f"img{n}")
        assert res.returncode == 0, (name, res.stderr)
        f, s, m = _holdings(tmp_path / f"img{n}")
        fds, socks, maps = fds | f, socks | s, maps | m
    # what a dump accepted, the table says is restored
    assert all(kinds.FD[k].restored for k in fds), fds
    assert all(row.restored for row in socks), socks
    assert all(kinds.MAPPINGS[k].restored for k in maps), maps
    # what the table says is restored, a fixture holds (or a test named in ELSEWHERE)
    unheld = {k for k, row in kinds.FD.items() if row.restored} - fds - set(ELSEWHERE)
    assert not unheld, f"restored fd kinds no fixture holds: {sorted(k.name for k in unheld)}"
    unheld = {k for k, row in kinds.MAPPINGS.items() if row.restored} - maps - set(ELSEWHERE)
    assert not unheld, f"restored mapping kinds no fixture holds: {sorted(k.name for k in unheld)}"
    restored_sockets = {row for row in kinds.SOCKETS.values() if row.restored}
    families = {row.name.split()[0] for row in socks}
    assert {row.name.split()[0] for row in restored_sockets} <= families, families


def test_the_table_of_kinds_and_the_registry_agree():
    """Every fd kind and socket family the table says is restored is answered for by one row
    of resources.registry, whose module (or one of its parts) is the one the table names;
    a row answers only for what the table says is restored."""
    from ptckpt.resources import registry
    answering: dict = {}                   # by (type, key): FdKind and VmaKind are IntEnums
    for row in registry.ROWS:
        for key in row.answers:
            assert (type(key), key) not in answering, f"{key} answered twice, the second time by {row.name}"
            answering[(type(key), key)] = row
    for kind, row in kinds.FD.items():
        if kind is FdKind.SOCKET:
            continue
        assert row.restored == ((FdKind, kind) in answering), kind
        if row.restored:
            by = answering[(FdKind, kind)]
            assert row.by.split()[0].removeprefix("resources.").rstrip(",") in {by.module, *by.parts}, (kind, row.by)
    for key, row in kinds.SOCKETS.items():
        if row.restored:
            assert (str, key[0]) in answering, key
            assert row.by.startswith(f"resources.{answering[(str, key[0])].module} "), (key, row.by)
    for key, row in kinds.MAPPINGS.items():
        assert (VmaKind, key) not in answering or row.restored, key

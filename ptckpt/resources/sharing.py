"""What the fd descriptions of a frozen tree share with processes outside it (dump half only).

A dump refuses, by name, what no restore could make again before it captures anything
shared: an fd, a mapping or an fd owner of a kind no restore makes; an fd in flight in a
unix socket that could not be passed again; a pipe, a socket or a pty that a process
outside the tree holds too (naming both ends), unless it is the root's stdio (fds 0-2:
the shell job's terminal or pipe, which a restore takes from ptckpt restore) or a named
FIFO (the restore reopens it by path and meets the outside end there).

What it finds on the way is what the captures after it need: the tree's pty masters,
its hung-up pty slaves, and the pipes only the tree holds (:class:`Scan`).  The restore
has no half here: its plan (ptckpt.plan) finds the same descriptions in the image.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .. import procfs
from ..errors import SharedOutside, UnsupportedResource
from ..formats.model import Fd, FdKind, ProcessImage
from . import files, memory, pipes, sockets, terminals


@dataclass(frozen=True)
class Scan:
    """What :func:`scan_frozen` found for the captures after it."""

    masters: dict[int, tuple[int, int, Fd]]    # pty index -> (desc, a pid holding it, its fd)
    hung: dict[int, tuple[int, Fd]]            # pty index -> (a pid holding a hung-up slave, its fd)
    internal_pipes: list[int]                  # inodes of the pipes only the tree holds


def scan_frozen(root: int, images: dict[int, ProcessImage], fds: dict[int, list[Fd]],
                held: dict[int, list[Fd]], stdio: set, flight: sockets.InFlight) -> Scan:
    """Refuse what the tree shares with the outside and no restore can make again (see the
    module's docstring); the owners of the shell job's stdio are dropped from `images`
    (its owner is left alone).  `fds`: each member's fds but those a plugin claimed;
    `held`: those and the fds in flight (held by `flight.holder`); `stdio`: the
    descriptions of the root's stdio."""
    sockets.refuse_in_flight(flight)
    masters = pty_masters(fds)
    hung = hung_up_ptys(fds, masters)
    inside = {d for d, _p, _f in masters.values()} | {
        f.desc for flist in fds.values() for f in flist
        if f.kind is FdKind.PTY_SLAVE and terminals.slave_index(f.rdev) in masters.keys() | hung.keys()}
    objects: dict[str, list[tuple[int, Fd]]] = {}
    for p, flist in held.items():
        for f in flist:
            if f.kind in (FdKind.PIPE, FdKind.FIFO, FdKind.SOCKET):
                objects.setdefault(f.path, []).append((p, f))
    refuse_unsupported(images, fds, stdio, inside)
    outside = procfs.fd_holders(set(objects) | {f"/dev/pts/{n}" for n in masters}
                                | {f.path for _p, f in hung.values()}, set(images) | {os.getpid()})
    refuse_ptys_held_outside(masters, hung, outside)
    return Scan(masters, hung, internal_pipes(root, objects, stdio, outside))


def refuse_unsupported(images: dict[int, ProcessImage], fds: dict[int, list[Fd]], stdio: set,
                       inside: set) -> None:
    """Refuse, by name, an fd, a mapping or an fd owner no restore can make again (the
    shell job's stdio and the tree's own ptys aside); the owners of the shell job's stdio
    are dropped from `images` (its owner is left alone)."""
    tree = {p: list(im.task.tids) for p, im in images.items()}
    shell_ttys = {f.rdev for flist in fds.values() for f in flist if f.desc in stdio and f.kind in files.TTY_KINDS}
    for p, flist in fds.items():
        for f in flist:
            # A restore reopens the controlling terminal as /dev/tty: the shell job's (ptckpt
            # restore's own), or a pty of the tree's; no other terminal becomes one again.
            if f.kind is FdKind.TTY and files.is_controlling_tty(f) and f.rdev not in shell_ttys:
                raise UnsupportedResource(p, f"fd {f.fd} -> {f.path} (the terminal {os.major(f.rdev)}:"
                                             f"{os.minor(f.rdev)}, its session's controlling terminal, "
                                             f"which is not the terminal of a shell job: a restore "
                                             f"cannot make it a controlling terminal again; open it "
                                             f"with O_NOCTTY, or run the job on it as a shell job)")
        # the shell job's stdio is ptckpt restore's own at restore: its owner is left alone
        shell = {f.fd for f in flist if f.desc in stdio}
        images[p] = dataclasses.replace(images[p], owners=tuple(o for o in images[p].owners if o.fd not in shell))
        bad = (files.unsupported_fds(flist, stdio | inside) + memory.unsupported_vmas(images[p].vmas)
               + files.owners_outside(p, list(images[p].owners), tree, {im.task.pgid for im in images.values()}))
        if bad:
            raise UnsupportedResource(p, bad[0])


def refuse_ptys_held_outside(masters: dict, hung: dict, outside: dict) -> None:
    """A pty of the tree whose slave (or, hung up, itself) a process outside holds is refused."""
    for n, (_d, p, f) in masters.items():
        if f"/dev/pts/{n}" in outside:
            q, m = outside[f"/dev/pts/{n}"][0]
            raise SharedOutside(p, f.fd, f"/dev/ptmx (the master of /dev/pts/{n})",
                                f"pid {q} fd {m} ({procfs.comm_or_unknown(q)}) holds its slave")
    for n, (p, f) in hung.items():
        if f.path in outside:
            q, m = outside[f.path][0]
            raise SharedOutside(p, f.fd, f"{f.path} (a hung-up pty slave: its master was closed)",
                                f"pid {q} fd {m} ({procfs.comm_or_unknown(q)}) holds it too")


def internal_pipes(root: int, objects: dict[str, list[tuple[int, Fd]]], stdio: set, outside: dict) -> list[int]:
    """The inodes of the pipes only the tree holds; a pipe or socket held outside too is
    refused, naming both ends, unless it is the shell job's stdio or a named FIFO."""
    out = []
    for link, holders in objects.items():
        if all(f.desc in stdio for _p, f in holders):
            continue                      # the shell job's stdio: ptckpt restore gives its own
        if link in outside:
            if holders[0][1].kind is FdKind.FIFO and not link.endswith(files.DELETED):
                continue                  # named: the restore reopens it and meets the outside end
            p, f = next((p, f) for p, f in holders if f.desc not in stdio)
            q, n = outside[link][0]
            raise SharedOutside(p, f.fd, link, f"pid {q} fd {n} ({procfs.comm_or_unknown(q)}) holds it too",
                                *way_out_of_an_ancestors_fd(root, q, f.fd))
        if holders[0][1].kind in pipes.PIPE_KINDS:
            out.append(holders[0][1].ino)
    return out


def way_out_of_an_ancestors_fd(root: int, holder: int, fd: int) -> tuple[str, ...]:
    """The way out when the outside holder of a pipe is an ancestor of the tree (the shell
    or CI runner that started it, which hands its pipes to its children): that ancestor
    cannot be dumped with it (its tree holds ptckpt, or things it never meant to share);
    start the target without it.  () keeps SharedOutside's default way out."""
    if holder not in procfs.ancestors(root):
        return ()
    closed = f" {fd}>&-" if fd > 2 else ""
    return (f"{holder} is an ancestor of the tree (what started it), which passed it this fd: start "
            f"the program with its own stdin/stdout and without that fd, e.g. "
            f"`setsid PROG </dev/null >LOG 2>&1{closed}`",)


def pty_masters(fds: dict[int, list[Fd]]) -> dict[int, tuple[int, int, Fd]]:
    """{pty index: (desc, a pid holding it, its fd)} for each pty master description of the tree."""
    out: dict[int, tuple[int, int, Fd]] = {}
    seen: set[int] = set()
    for p, flist in fds.items():
        for f in flist:
            if f.kind is FdKind.PTY_MASTER and f.desc not in seen:
                seen.add(f.desc)
                out[terminals.master_index(p, f.fd)] = (f.desc, p, f)
    return out


def hung_up_ptys(fds: dict[int, list[Fd]], masters) -> dict[int, tuple[int, Fd]]:
    """{pty index: (a pid holding it, its fd)} for each pty whose slaves the tree holds and
    whose master was closed (the slaves are hung up: /dev/pts/N (deleted), EIO)."""
    out: dict[int, tuple[int, Fd]] = {}
    for p, flist in fds.items():
        for f in flist:
            if f.kind is FdKind.PTY_SLAVE and not files.is_controlling_tty(f):
                n = terminals.slave_index(f.rdev)
                if n not in masters and n not in out and terminals.is_hung_up(p, f.fd):
                    out[n] = (p, f)
    return out

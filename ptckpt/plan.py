"""Restore's plan, the part no host changes: what a restore of an image would refuse
whatever machine it runs on, and which open file descriptions ptckpt makes itself.

The restore runs it before it builds anything (with the host's own checks beside it:
ptckpt.restore.plan_problems); the dump runs it on the image it has just written,
before the image is renamed into place, so that a dump never says yes to an image the
restore would refuse (:func:`check_restorable`).
"""

from __future__ import annotations

import os

from .errors import UnsupportedResource
from .formats.image import ImageReader
from .formats.model import Fd, FdKind, ProcessImage, ShmImage, VmaKind
from .resources import aio, files, memory, nsfs, pipes, sockets, terminals


def memory_objects(procs: dict[int, ProcessImage]) -> set[tuple[int, int, int]]:
    """The memory objects a restore of `procs` makes (memory.object_key): those mapped
    shared, whose pages are in the image, and the memfds the tree holds as fds."""
    out = {k for proc in procs.values() for v in proc.vmas if (k := memory.shared_object_key(v))}
    return out | {(os.major(f.dev), os.minor(f.dev), f.ino) for proc in procs.values() for f in proc.fds
                  if f.kind is FdKind.MEMFD and not f.skipped}


def image_problems(image: ImageReader, proc: ProcessImage, handed: dict[int, Fd],
                   objects: set[tuple[int, int, int]]) -> list[str]:
    """What of `proc` no restore can make, whatever the host: fds of kinds with no maker,
    mappings with no source (a deleted file the image does not hold, a memfd mapped
    privately whose object is not in it, a SysV segment that is not in it); `handed` are
    the descriptions ptckpt makes itself (plan_handoff), `objects` the memory objects
    (memory_objects)."""
    ghosts = {("ghost", g.dev, g.ino) for g in image.ghost_files}
    segments = {o.shmid for o in image.sysv if isinstance(o, ShmImage)}
    bad = files.restore_plan_problems(list(proc.fds), handed)
    for v in proc.vmas:
        if (v.file_deleted and memory.object_key(v) not in objects and not memory.is_sysv(v)
                and v.kind is not VmaKind.ANON_SHARED and files.ghost_key(v) not in ghosts
                and not (aio.is_aio_ring(v) and any(r.start == v.start for r in proc.aio_rings))):
            bad.append(f"mapping {v.start:#x}-{v.end:#x} of deleted file {v.path}")
        if memory.is_sysv(v) and v.inode not in segments:
            bad.append(f"SysV shared memory mapping {v.start:#x}-{v.end:#x} (its segment is not in the image)")
    return bad


def init_root_refused(root: int) -> UnsupportedResource:
    """The root of a tree restored in a pid namespace of its own may not be its init."""
    return UnsupportedResource(root, "the root was the init (pid 1) of its pid namespace: "
                                     "restoring a namespace's init is not supported yet")


def queue_refusal(image: ImageReader, procs: dict[int, ProcessImage]) -> UnsupportedResource | None:
    """Queued unix messages no restore could send again (sockets.unsendable_queues), named
    for a process holding their socket."""
    unsent = sockets.unsendable_queues(image.unix_sockets)
    if not unsent:
        return None
    inos = {r.ino for r in unsent}
    holder = next((p for p, proc in procs.items() for f in proc.fds
                   if f.kind is FdKind.SOCKET and f.ino in inos), image.inventory.root_pid)
    return UnsupportedResource(holder, "; ".join(f"socket:[{r.ino}] with {len(r.queue)} queued message(s) "
                                                 f"and no end to send them from" for r in unsent))


def tree_problems(image: ImageReader, procs: dict[int, ProcessImage]) -> UnsupportedResource | None:
    """The first refusal restore's plan would meet on this image on any host, or None."""
    root = image.inventory.root_pid
    if image.inventory.pid_level and root == 1:
        return init_root_refused(root)
    handed = plan_handoff(image, procs)
    objects = memory_objects(procs)
    for p, proc in procs.items():
        bad = image_problems(image, proc, handed, objects)
        if bad:
            return UnsupportedResource(proc.task.pid, "; ".join(bad))
    return queue_refusal(image, procs)


def check_restorable(directory: str) -> None:
    """Raise what a restore of image `directory` would refuse on any host (the dump's last
    check before it commits: its own image, written but not yet renamed into place)."""
    with ImageReader(directory, verify_pages=False, memory=False) as image:    # its page runs are its own
        procs = {p: image.process(p) for p in image.inventory.pids}
        why = tree_problems(image, procs)
    if why is not None:
        raise UnsupportedResource(why.pid, f"{why.what} (a restore of this image would refuse it)")


def plan_handoff(image: ImageReader, procs: dict[int, ProcessImage]) -> dict[int, Fd]:
    """The open file descriptions ptckpt makes itself and hands to the stubs ({desc: an fd of it}):

    * the pipes and FIFOs of the tree (from their PIPE records, with their bytes);
    * its unix sockets (from their UNIX_SOCKET records: names, connections, queues);
    * the root's stdio (fds 0-2 on a terminal, pipe or socket): ptckpt restore's own,
      also for the members that share them;
    * files whose description several fds share (after dup or fork);
    * fds of namespaces their process is not in, by the mount point the dump found them at.
    * the fds whose state the image holds (eventfd ... epoll, pidfd): pidfds are made once
      the tree exists, and passed to the stubs then (restore.py, resources.pidfds).
    """
    root = procs[image.inventory.root_pid]
    uses: dict[int, int] = {}
    # A stdio description is represented by its lowest fd: build_handoff dups ptckpt
    # restore's fd of that number, which must be one of its own fds 0-2 (top's fd 3,
    # a dup of its fd 0, once made fds 0, 1 and 3 a copy of ptckpt's fd 3: its pages file).
    rep: dict[int, Fd] = {}
    for f in sorted(root.fds, key=lambda f: f.fd):
        if f.desc:
            rep.setdefault(f.desc, f)
    for proc in procs.values():
        for f in proc.fds:
            if f.desc:
                uses[f.desc] = uses.get(f.desc, 0) + 1
                rep.setdefault(f.desc, f)
    for f in image.in_flight:                 # held by no process, maybe: in flight in a socket
        rep.setdefault(f.desc, f)
    flying = {f.desc for f in image.in_flight}
    stdio = root_stdio(root)
    pipe_inos = {b.ino for b in image.pipes}
    socket_inos = ({u.ino for u in image.unix_sockets} | {r.ino for r in image.inet_sockets}
                   | {r.ino for r in image.netlink_sockets})
    ghosts = {("ghost", g.dev, g.ino) for g in image.ghost_files}
    states = {s.desc for s in image.fd_states}
    ptys = {p.desc for p in image.ptys} | set(pty_slaves(image, procs))
    out = {}
    for d, f in rep.items():
        if f.skipped or f.external:
            continue
        if d in ptys:
            out[d] = f
            continue
        if f.kind in pipes.PIPE_KINDS and f.ino in pipe_inos:
            out[d] = f
        elif f.kind is FdKind.SOCKET and f.ino in socket_inos:
            out[d] = f
        elif d in stdio:
            out[d] = f
        elif files.ghost_key(f) in ghosts or d in states or nsfs.bound_path(f):
            out[d] = f
        elif (uses.get(d, 0) > 1 or d in flying) and (f.kind in files.BY_PATH_KINDS or f.kind is FdKind.TTY):
            out[d] = f
    return out


def pty_slaves(image: ImageReader, procs: dict[int, ProcessImage]) -> dict[int, int]:
    """{slave description: pty index} of the slaves of the ptys whose master the tree holds."""
    indices = {p.index for p in image.ptys}
    return {f.desc: terminals.slave_index(f.rdev) for proc in procs.values() for f in proc.fds
            if f.kind is FdKind.PTY_SLAVE and f.desc and terminals.slave_index(f.rdev) in indices}


def root_stdio(root: ProcessImage) -> set[int]:
    return {f.desc for f in root.fds if f.desc and f.fd <= 2 and f.kind in files.STDIO_KINDS}

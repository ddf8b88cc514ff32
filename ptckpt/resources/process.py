"""The process itself: identity and relations, credentials, rlimits, mm fields.

Dump half: :func:`dump_task`, :func:`dump_rlimits`, :func:`dump_mm_frozen` (brk, dumpable
and the prctl state come from inside, by injection).  Credentials: :mod:`.creds`.

The prctl state kept: dumpable, parent-death signal, child subreaper, name, timer slack,
THP disable, MDWE (memory-deny-write-execute), KSM merging of all memory, and the
speculation controls (store bypass, indirect branch, L1D flush).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import resource
import struct
import time
from collections.abc import Mapping

from .. import procfs
from ..errors import PtckptError, UnsupportedResource, UsageError
from ..formats.model import Mm, ProcessImage, Rlimit, Task
from ..tracee import KCMP_FILES, KCMP_FS, RemoteSyscalls, same_kernel_object
from . import membarrier
from .files import ghost_dir_key

PR_GET_DUMPABLE = 3
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
PR_GET_TIMERSLACK = 30           # the calling thread's; /proc/PID/timerslack_ns needs CAP_SYS_NICE
PR_SET_THP_DISABLE, PR_GET_THP_DISABLE = 41, 42
PR_SET_MDWE, PR_GET_MDWE = 65, 66
PR_SET_MEMORY_MERGE, PR_GET_MEMORY_MERGE = 67, 68
PR_GET_SPECULATION_CTRL, PR_SET_SPECULATION_CTRL = 52, 53
SPEC_KINDS = (0, 1, 2)           # PR_SPEC_STORE_BYPASS, PR_SPEC_INDIRECT_BRANCH, PR_SPEC_L1D_FLUSH
PR_SPEC_PRCTL, PR_SPEC_ENABLE = 1, 2
EINVAL = 22


def _prctl_get_int(remote: RemoteSyscalls, option: int, step: str) -> int:
    """prctl(option, &int) inside the tracee: the int it wrote."""
    with remote.scratch(8) as buf:
        remote.checked("prctl", option, int(buf), step=step)
        return struct.unpack("<i", remote.mem.read(buf, 4))[0]


def dump_task(pid: int, tids: list[int], status: procfs.Status, st: procfs.Stat,
              remote: RemoteSyscalls | None = None) -> Task:
    """`status` and `st` are one reading of /proc/PID/status and stat, shared by the dump halves."""
    dumpable, pdeath, subreaper, thp, mdwe, merge, spec = 1, 0, 0, 0, 0, 0, ()
    if remote is not None:
        dumpable = remote.checked("prctl", PR_GET_DUMPABLE, step="dump task")
        pdeath = _prctl_get_int(remote, PR_GET_PDEATHSIG, "dump task: pdeath_signal")
        subreaper = _prctl_get_int(remote, PR_GET_CHILD_SUBREAPER, "dump task: child subreaper")
        thp = remote.checked("prctl", PR_GET_THP_DISABLE, 0, 0, 0, 0, step="dump task: THP disable")
        mdwe = _prctl_optional(remote, PR_GET_MDWE, "MDWE")
        merge = _prctl_optional(remote, PR_GET_MEMORY_MERGE, "KSM memory merge")
        spec = tuple(_prctl_optional(remote, PR_GET_SPECULATION_CTRL, "speculation control", kind)
                     for kind in SPEC_KINDS)
    return Task(
        pid=pid,
        ppid=st.ppid,
        pgid=st.pgrp,
        sid=st.session,
        comm=st.comm,
        state=st.state,
        exe=procfs.read_exe(pid),
        cwd=procfs.read_cwd(pid),
        root=procfs.read_root(pid),
        umask=status.umask if status.umask is not None else 0o022,
        personality=procfs.read_personality(pid),
        nice=st.nice,
        sched_policy=st.policy,
        rt_priority=st.rt_priority,
        oom_score_adj=procfs.read_oom_score_adj(pid),
        timerslack_ns=(remote.checked("prctl", PR_GET_TIMERSLACK, step="dump task: timer slack")
                       if remote is not None else procfs.read_timerslack_ns(pid)),
        exit_signal=st.exit_signal,
        tids=tuple(tids),
        cmdline=tuple(procfs.read_cmdline(pid)),
        dumpable=dumpable,
        pdeath_signal=pdeath,
        child_subreaper=bool(subreaper),
        thp_disable=bool(thp),
        mdwe=mdwe,
        memory_merge=bool(merge),
        spec_ctrl=spec,
        cgroups=read_cgroups(pid),
        coredump_filter=int(_read_proc(pid, "coredump_filter", "-1"), 16),
        loginuid=int(_read_proc(pid, "loginuid", str(2**32 - 1))),
    )


def _read_proc(pid: int, name: str, default: str) -> str:
    try:
        return procfs.read_text_file(pid, name)
    except (OSError, PtckptError):
        return default


def _prctl_optional(remote: RemoteSyscalls, option: int, what: str, arg: int = 0) -> int:
    """A prctl GET whose value is its result; 0 where this kernel or CPU lacks it (EINVAL,
    ENODEV): a state that does not exist here cannot have been set."""
    res = remote.syscall("prctl", option, arg, 0, 0, 0)
    if res in (-EINVAL, -19):
        return 0
    if res < 0:
        remote.checked("prctl", option, arg, 0, 0, 0, step=f"dump task: {what}")
    return res


def dump_rlimits(pid: int) -> list[Rlimit]:
    return [Rlimit(r.resource, r.cur, r.max) for r in procfs.read_limits(pid)]


def dump_mm_frozen(pid: int, st: procfs.Stat, remote: RemoteSyscalls) -> Mm:
    """mm_struct fields: /proc/PID/stat gives all but brk, which brk(0) returns from inside,
    and the membarrier registrations (:mod:`.membarrier`)."""
    brk = remote.checked("brk", 0, step="dump mm")
    exe = ""
    with contextlib.suppress(Exception):
        exe = procfs.read_exe(pid)
    return Mm(
        start_code=st.start_code, end_code=st.end_code,
        start_data=st.start_data, end_data=st.end_data,
        start_brk=st.start_brk, brk=brk, start_stack=st.start_stack,
        arg_start=st.arg_start, arg_end=st.arg_end,
        env_start=st.env_start, env_end=st.env_end,
        exe_file=exe,
        auxv=tuple(procfs.read_auxv(pid)),
        membarrier=membarrier.dump_registrations_frozen(pid, remote),
    )


def current_clocks() -> tuple[int, int, int]:
    """(CLOCK_REALTIME, CLOCK_MONOTONIC, CLOCK_BOOTTIME) in ns, taken while the target is frozen."""
    return (time.clock_gettime_ns(time.CLOCK_REALTIME),
            time.clock_gettime_ns(time.CLOCK_MONOTONIC),
            time.clock_gettime_ns(time.CLOCK_BOOTTIME))


# --- restore half ------------------------------------------------------------

PR_SET_MM = 35
PR_SET_MM_MAP = 14
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PRIO_PROCESS = 0
AT_FDCWD = -100 & (2**64 - 1)
_MM_MAP = struct.Struct("<11QQIi")   # struct prctl_mm_map (include/uapi/linux/prctl.h)


def restore_mm_frozen(remote: RemoteSyscalls, mm: Mm, step: str = "restore mm fields") -> None:
    """PR_SET_MM_MAP: code/data/brk/stack/arg/env areas, auxv and the exe link, in one call.

    The single-field PR_SET_MM forms need CAP_SYS_RESOURCE, which these
    machines do not grant; the whole-struct form does not.
    """
    auxv = b"".join(struct.pack("<QQ", t, v) for t, v in mm.auxv) + struct.pack("<QQ", 0, 0)
    exe_fd = -1
    if mm.exe_file:
        with remote.scratch(os.fsencode(mm.exe_file) + b"\0") as p:
            exe_fd = remote.checked("openat", AT_FDCWD, int(p), 0o2000000, 0,
                                    step=f"{step}: open exe {mm.exe_file}")
    try:
        with remote.scratch(auxv) as auxp:
            rec = _MM_MAP.pack(mm.start_code, mm.end_code, mm.start_data, mm.end_data,
                               mm.start_brk, mm.brk, mm.start_stack, mm.arg_start, mm.arg_end,
                               mm.env_start, mm.env_end, int(auxp), len(auxv), exe_fd)
            with remote.scratch(rec) as recp:
                remote.checked("prctl", PR_SET_MM, PR_SET_MM_MAP, int(recp), len(rec), 0, step=step)
    finally:
        if exe_fd >= 0:
            remote.syscall("close", exe_fd)


def _change_dir(remote: RemoteSyscalls, path: str, handed: Mapping) -> None:
    """chdir(path), or fchdir() to the directory a deleted one was made again as."""
    made = handed.get(ghost_dir_key(path))
    if made is not None:
        remote.checked("fchdir", made, step=f"fchdir to {path}")
        return
    with remote.scratch(os.fsencode(path) + b"\0") as p:
        remote.checked("chdir", int(p), step=f"chdir {path}")


def restore_root_frozen(remote: RemoteSyscalls, task: Task, handed: Mapping = {}) -> None:
    """chroot, once nothing more is opened by a path seen from ptckpt's root (the exe, the
    cwd: chroot does not move the cwd); a removed root through its directory made again."""
    if task.root and task.root != "/":
        made = handed.get(ghost_dir_key(task.root))
        root = f"/proc/self/fd/{made}" if made is not None else task.root
        with remote.scratch(os.fsencode(root) + b"\0") as p:
            remote.checked("chroot", int(p), step=f"chroot {task.root}")


def restore_task_frozen(remote: RemoteSyscalls, task: Task, handed: Mapping = {}) -> list[str]:
    """cwd, umask, personality, dumpable from inside; comm, nice, oom_score_adj,
    timerslack from outside.  Returns warnings (things that could not be set).

    A cwd that was removed is entered through the fd of its directory made again
    (``handed[files.ghost_dir_key(path)]``), which is removed by then.  The root is
    restore_root_frozen's."""
    warnings: list[str] = []
    pid = remote.task.tgid
    _change_dir(remote, task.cwd, handed)       # as ptckpt sees it; the root comes later
    remote.checked("umask", task.umask, step="umask")
    remote.checked("personality", task.personality, step="personality")
    remote.checked("prctl", PR_SET_DUMPABLE, task.dumpable, step="dumpable")
    if task.child_subreaper:
        remote.checked("prctl", PR_SET_CHILD_SUBREAPER, 1, step="child subreaper")
    with remote.scratch(task.comm.encode(errors="surrogateescape")[:15] + b"\0") as p:
        remote.checked("prctl", PR_SET_NAME, int(p), step="comm")
    if task.thp_disable:
        remote.checked("prctl", PR_SET_THP_DISABLE, 1, 0, 0, 0, step="THP disable")
    if task.memory_merge:
        remote.checked("prctl", PR_SET_MEMORY_MERGE, 1, 0, 0, 0, step="KSM memory merge")
    for kind, ctrl in zip(SPEC_KINDS, task.spec_ctrl):
        state = ctrl & ~(PR_SPEC_PRCTL | PR_SPEC_ENABLE)     # what a prctl changed from the default
        if ctrl & PR_SPEC_PRCTL and state:
            remote.checked("prctl", PR_SET_SPECULATION_CTRL, kind, state, 0, 0,
                           step=f"speculation control {kind}")
    for name, value in (("oom_score_adj", str(task.oom_score_adj)),
                        ("timerslack_ns", str(task.timerslack_ns))):
        try:
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(value)
        except OSError as err:
            warnings.append(f"cannot set {name} to {value}: {err.strerror}")
            if name == "oom_score_adj":          # at least not expendable() any longer
                with contextlib.suppress(OSError), open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(str(procfs.read_oom_score_adj(os.getpid())))
    try:
        os.setpriority(os.PRIO_PROCESS, pid, task.nice)
    except OSError as err:
        warnings.append(f"cannot set nice {task.nice}: {err.strerror}")
    if task.coredump_filter >= 0:
        try:
            with open(f"/proc/{pid}/coredump_filter", "w") as f:
                f.write(f"{task.coredump_filter:#x}")
        except OSError as err:
            warnings.append(f"cannot set coredump_filter {task.coredump_filter:#x}: {err.strerror}")
    if task.loginuid != int(_read_proc(pid, "loginuid", str(2**32 - 1))):
        warnings += _set_loginuid(remote, task.loginuid)
    return warnings


def _set_loginuid(remote: RemoteSyscalls, uid: int) -> list[str]:
    """The audit login uid is set by the process itself, through /proc/self/loginuid."""
    with remote.scratch(b"/proc/self/loginuid\0") as p:
        fd = remote.syscall("openat", AT_FDCWD, int(p), os.O_WRONLY | os.O_CLOEXEC, 0)
    if fd < 0:
        return [f"cannot set the audit login uid {uid}: {os.strerror(-fd)}"]
    try:
        text = str(uid if uid != 2**32 - 1 else -1).encode()
        with remote.scratch(text) as buf:
            res = remote.syscall("write", fd, int(buf), len(text))
    finally:
        remote.syscall("close", fd)
    return [f"cannot set the audit login uid {uid}: {os.strerror(-res)}"] if res < 0 else []


def restore_rlimits(pid: int, rlimits) -> list[str]:
    """prlimit() from outside; a limit that cannot be raised is reported, not fatal."""
    warnings = []
    for r in rlimits:
        inf = resource.RLIM_INFINITY
        cur = inf if r.cur >= 2**63 else r.cur
        mx = inf if r.max >= 2**63 else r.max
        try:
            resource.prlimit(pid, r.resource, (cur, mx))
        except (OSError, ValueError) as err:
            warnings.append(f"rlimit {r.resource} ({cur}, {mx}) cannot be set "
                            f"(raising a hard limit needs CAP_SYS_RESOURCE): {err}")
    return warnings


def restore_pdeath_signal_frozen(remote: RemoteSyscalls, task: Task) -> None:
    """After the credentials: changing them clears the parent-death signal (prctl(2)).  Set
    even when it is 0: the stub had SIGKILL there while ptckpt built it (pids.start_stub)."""
    remote.checked("prctl", PR_SET_PDEATHSIG, task.pdeath_signal, step="pdeath_signal")


def restore_mdwe_frozen(remote: RemoteSyscalls, task: Task) -> None:
    """Last of the memory work: once set, MDWE refuses mappings that are writable and
    executable (the restore's own gadget is one)."""
    if task.mdwe:
        remote.checked("prctl", PR_SET_MDWE, task.mdwe, 0, 0, 0, step="MDWE")


# --- fd tables and fs state shared between processes (CLONE_FILES, CLONE_FS) -------

def dump_sharing(images: dict[int, ProcessImage], root: int) -> dict[int, ProcessImage]:
    """Mark each member that shares its fd table or fs state with its parent (it was cloned
    with CLONE_FILES or CLONE_FS): the restore clones it so.  Other sharing is refused, by
    name: with a process outside the tree, or with a member that is not its parent (the
    parent unshared since)."""
    what = {KCMP_FILES: "fd table (CLONE_FILES)", KCMP_FS: "cwd, root and umask (CLONE_FS)"}
    out = dict(images)
    for pid, im in images.items():
        ppid = im.task.ppid
        marks = {}
        for kind in (KCMP_FILES, KCMP_FS):
            if pid == root:
                if ppid > 0 and _shares(pid, ppid, kind, same_kernel_object):
                    raise UnsupportedResource(pid, f"its {what[kind]} shared with its parent {ppid} outside "
                                              f"the tree", way_out="dump the parent's tree")
                continue
            marks[kind] = ppid in images and _shares(pid, ppid, kind, same_kernel_object)
            if not marks[kind]:
                other = next((q for q in images if q != pid and _shares(pid, q, kind, same_kernel_object)), None)
                if other is not None:
                    raise UnsupportedResource(pid, f"its {what[kind]} is shared with {other}, which is "
                                              "not its parent (the parent left it)")
        if marks.get(KCMP_FILES) or marks.get(KCMP_FS):
            out[pid] = dataclasses.replace(im, task=dataclasses.replace(
                im.task, shares_files=marks[KCMP_FILES], shares_fs=marks[KCMP_FS]))
    return out


def _shares(a: int, b: int, kind: int, same) -> bool:
    try:
        return same(a, b, kind)
    except PtckptError:
        return False                            # gone, or not ours to compare: not shared


# --- cgroups -------------------------------------------------------------------

def read_cgroups(pid: int | str) -> str:
    try:
        return procfs.read_cgroup(pid)
    except (OSError, PtckptError):
        return ""


def cgroup_mounts() -> dict[frozenset, str]:
    """{controllers (v1; the empty set for the v2 hierarchy): where that hierarchy is mounted}."""
    out: dict[frozenset, str] = {}
    for line in procfs.read_mounts("self"):
        _dev, where, fstype, opts = line.split()[:4]
        if fstype == "cgroup2":
            out.setdefault(frozenset(), where)
        elif fstype == "cgroup":
            names = {o for o in opts.split(",") if o not in ("rw", "ro", "relatime", "noexec",
                                                               "nosuid", "nodev", "clone_children")}
            out.setdefault(frozenset(names), where)
    return out


# The control files a cgroup directory made again by a restore gets back, in the order they
# are written (a period before its quota or runtime, a limit before its memsw limit, a
# cpuset's cpus and mems before anything joins), per v1 controller ("" : the v2 hierarchy,
# whose files exist only where their controller is on).  Only a value that differs from
# the new directory's is written.
CGROUP_PROPERTIES: dict[str, tuple[str, ...]] = {
    "cpu": ("cpu.shares", "cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.rt_period_us",
            "cpu.rt_runtime_us"),
    "cpuset": ("cpuset.cpus", "cpuset.mems", "cpuset.cpu_exclusive", "cpuset.mem_exclusive",
               "cpuset.mem_hardwall", "cpuset.memory_migrate", "cpuset.memory_spread_page",
               "cpuset.memory_spread_slab", "cpuset.sched_load_balance",
               "cpuset.sched_relax_domain_level"),
    "memory": ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes",
               "memory.soft_limit_in_bytes", "memory.kmem.tcp.limit_in_bytes",
               "memory.swappiness", "memory.move_charge_at_immigrate"),
    "devices": ("devices.list",),
    "pids": ("pids.max",),
    "blkio": ("blkio.weight", "blkio.leaf_weight"),
    "net_cls": ("net_cls.classid",),
    "": ("cgroup.type", "cgroup.subtree_control", "cgroup.max.descendants", "cgroup.max.depth",
         "cpuset.cpus", "cpuset.mems", "cpu.weight", "cpu.max", "io.weight", "memory.min",
         "memory.low", "memory.high", "memory.max", "memory.swap.max", "pids.max"),
}
CGROUP_V1_PROPERTIES = ("notify_on_release", "cgroup.clone_children")


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")


def _unesc(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"t": "\t", "n": "\n"}.get(m.group(1), m.group(1)), text)


def _hierarchy(line: str) -> tuple[str, str]:
    """(controllers, path) of one /proc/PID/cgroup line."""
    _id, controllers, path = line.split(":", 2)
    return controllers, path


def thread_cgroups(pid: int, tid: int, process_cgroups: str) -> str:
    """/proc/PID/task/TID/cgroup where it differs from its process's (cgroup v1 moves a
    thread by itself through `tasks`), else ""."""
    if tid == pid:
        return ""
    try:
        mine = procfs.read_cgroup(pid, tid)
    except (OSError, PtckptError):
        return ""
    return "" if mine == process_cgroups else mine


def _properties(controllers: str) -> tuple[str, ...]:
    names = [c for c in controllers.split(",") if c and not c.startswith("name=")]
    if not controllers:
        return CGROUP_PROPERTIES[""]
    return CGROUP_V1_PROPERTIES + tuple(p for c in names for p in CGROUP_PROPERTIES.get(c, ()))


def dump_cgroup_dirs(cgroups: list[str]) -> str:
    """The cgroup directories a process needs, for a restore to make those gone since: in
    each hierarchy it (or a thread of it, `cgroups` are /proc/PID/cgroup texts) is in below
    the root, that cgroup's ancestors, itself and its descendants, parents first.  One
    tab-separated line each (backslash escapes \\t, \\n and \\\\ in names and values):
      d CONTROLLERS PATH MODE UID GID      a directory (PATH from the hierarchy's root)
      f CONTROLLERS PATH MODE UID GID      a file in it (its control files' owners, modes)
      p CONTROLLERS PATH VALUE             a control file's value (CGROUP_PROPERTIES)
    A hierarchy mounted nowhere here is left out (a restore cannot join it either, and
    says so)."""
    mounts = None
    seen: set[tuple[str, str]] = set()
    out: list[str] = []
    for text in cgroups:
        for line in text.splitlines():
            controllers, path = _hierarchy(line)
            if path == "/" or (controllers, path) in seen:
                continue
            mounts = cgroup_mounts() if mounts is None else mounts
            where = mounts.get(frozenset(c for c in controllers.split(",") if c))
            if where is None:
                continue
            parts = path.strip("/").split("/")
            chain = ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]
            below = []
            for top, dirs, _files in os.walk(os.path.join(where, path.lstrip("/"))):
                dirs.sort()
                below.append("/" + os.path.relpath(top, where))
            for rel in chain + below:
                if (controllers, rel) in seen:
                    continue
                seen.add((controllers, rel))
                out += _one_cgroup_dir(where, controllers, rel)
    return "".join(line + "\n" for line in out)


def _one_cgroup_dir(where: str, controllers: str, rel: str) -> list[str]:
    full = os.path.join(where, rel.lstrip("/"))
    try:
        st = os.stat(full)
        names = sorted(os.listdir(full))
    except OSError:
        return []                             # gone meanwhile: nothing of it to keep
    out = [f"d\t{controllers}\t{_esc(rel)}\t{st.st_mode & 0o7777:o}\t{st.st_uid}\t{st.st_gid}"]
    for name in names:
        with contextlib.suppress(OSError):
            fst = os.lstat(os.path.join(full, name))
            if not os.path.isdir(os.path.join(full, name)):
                out.append(f"f\t{controllers}\t{_esc(rel + '/' + name)}\t{fst.st_mode & 0o7777:o}"
                           f"\t{fst.st_uid}\t{fst.st_gid}")
    for prop in _properties(controllers):
        if prop in names:
            with contextlib.suppress(OSError):
                with open(os.path.join(full, prop)) as f:
                    out.append(f"p\t{controllers}\t{_esc(rel + '/' + prop)}\t{_esc(f.read())}")
    return out


def make_cgroup_dirs(recorded: list[str]) -> tuple[list[str], list[str]]:
    """Make again the cgroup directories of `recorded` (TASK cgroup_dirs texts) that are
    gone, parents first, each with its owner and mode, its files' owners and modes and its
    control files' values as at dump; one that exists is left as it is.  Returns (the
    directories made, for an undo; warnings)."""
    dirs: dict[tuple[str, str], dict] = {}
    for text in recorded:
        for line in text.splitlines():
            kind, controllers, *rest = line.split("\t")
            rest[0] = _unesc(rest[0])
            at = rest[0] if kind == "d" else os.path.dirname(rest[0])
            entry = dirs.setdefault((controllers, at), {"stat": None, "files": [], "props": []})
            if kind == "d":
                entry["stat"] = tuple(int(v, 8 if i == 0 else 10) for i, v in enumerate(rest[1:4]))
            elif kind == "f" and (os.path.basename(rest[0]), *rest[1:]) not in entry["files"]:
                entry["files"].append((os.path.basename(rest[0]), *rest[1:]))
            elif kind == "p" and all(n != os.path.basename(rest[0]) for n, _v in entry["props"]):
                entry["props"].append((os.path.basename(rest[0]), _unesc(rest[1])))
    made: list[str] = []
    warnings: list[str] = []
    mounts = cgroup_mounts() if dirs else {}
    for (controllers, rel), entry in sorted(dirs.items(), key=lambda kv: kv[0][1].count("/")):
        where = mounts.get(frozenset(c for c in controllers.split(",") if c))
        if where is None or entry["stat"] is None:
            continue
        full = os.path.join(where, rel.lstrip("/"))
        if os.path.isdir(full):
            continue
        mode, uid, gid = entry["stat"]
        try:
            os.mkdir(full)
        except OSError as err:
            warnings.append(f"cgroup {controllers or 'v2'}:{rel} could not be made again: {err.strerror}")
            continue
        made.append(full)
        warnings += _set_cgroup_dir(full, f"{controllers or 'v2'}:{rel}", mode, uid, gid, entry)
    return made, warnings


def _set_cgroup_dir(full: str, what: str, mode: int, uid: int, gid: int, entry: dict) -> list[str]:
    warnings = []
    for name, value in entry["props"]:
        path = os.path.join(full, name)
        try:
            with open(path) as f:
                if f.read() == value:
                    continue
            if name == "devices.list":
                _write(os.path.join(full, "devices.deny"), "a")
                for rule in value.splitlines():
                    _write(os.path.join(full, "devices.allow"), rule)
            elif name == "cgroup.subtree_control":
                _write(path, " ".join("+" + c for c in value.split()))
            else:
                _write(path, value.strip() or "\n")
        except OSError as err:
            warnings.append(f"cgroup {what}: {name} could not be set back to {value.strip()!r}: "
                            f"{err.strerror}")
    try:
        for name, fmode, fuid, fgid in entry["files"]:
            path = os.path.join(full, name)
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                if (st.st_uid, st.st_gid) != (int(fuid), int(fgid)):
                    os.chown(path, int(fuid), int(fgid))
                if st.st_mode & 0o7777 != int(fmode, 8):
                    os.chmod(path, int(fmode, 8))
        os.chown(full, uid, gid)
        os.chmod(full, mode)
    except OSError as err:
        warnings.append(f"cgroup {what}: its owners and modes could not be set back: {err.strerror}")
    return warnings


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def remove_cgroup_dirs(made: list[str]) -> None:
    """Undo make_cgroup_dirs (a failed restore): the directories it made, children first."""
    for full in reversed(made):
        with contextlib.suppress(OSError):
            os.rmdir(full)


def restore_thread_cgroups(pid: int, tid: int, recorded: str) -> list[str]:
    """Put a restored thread back in its own cgroups (THREAD cgroups): its tid into each
    v1 hierarchy's `tasks`, v2's `cgroup.threads` (a threaded cgroup)."""
    if not recorded:
        return []
    now = {line.rsplit(":", 1)[0]: line for line in procfs.read_cgroup(pid, tid).splitlines()}
    mounts = cgroup_mounts()
    warnings = []
    for line in recorded.splitlines():
        key, _, path = line.rpartition(":")
        if now.get(key) == line:
            continue
        controllers = key.split(":", 1)[1]
        where = mounts.get(frozenset(c for c in controllers.split(",") if c))
        try:
            if where is None:
                raise OSError(f"hierarchy '{controllers or 'v2'}' is not mounted here")
            _write(os.path.join(where, path.lstrip("/"), "cgroup.threads" if not controllers else "tasks"),
                   str(tid))
        except OSError as err:
            warnings.append(f"thread {tid} of process {pid} stays in cgroup {now.get(key, '?')} (it "
                            f"was in {line}): {getattr(err, 'strerror', None) or err}")
    return warnings


def restore_cgroups(pid: int, recorded: str) -> list[str]:
    """Put the restored process back in the cgroups it was in at dump, hierarchy by
    hierarchy (it starts in ptckpt restore's).  One it cannot join is a warning."""
    if not recorded:
        return []
    now = {line.rsplit(":", 1)[0]: line for line in read_cgroups(pid).splitlines()}
    mounts = None
    warnings = []
    for line in recorded.splitlines():
        key, _, path = line.rpartition(":")
        if now.get(key) == line:
            continue
        mounts = cgroup_mounts() if mounts is None else mounts
        controllers = key.split(":", 1)[1]
        where = mounts.get(frozenset(c for c in controllers.split(",") if c))
        try:
            if where is None:
                raise OSError(f"hierarchy '{controllers or 'v2'}' is not mounted here")
            with open(os.path.join(where, path.lstrip("/"), "cgroup.procs"), "w") as f:
                f.write(str(pid))
        except OSError as err:
            warnings.append(f"process {pid} stays in cgroup {now.get(key, '?')} (it was in "
                            f"{line}): {getattr(err, 'strerror', None) or err}")
    return warnings




def parse_cgroup_roots(items) -> dict[str, str]:
    """`--cgroup-root [CONTROLLER:]PATH` items: {controller ("" for every hierarchy no item
    names): PATH}.  A controller is one of a v1 hierarchy's (cpu, name=systemd ...) or
    "v2"."""
    roots: dict[str, str] = {}
    for item in items:
        controller, path = ("", item) if item.startswith("/") else item.rsplit(":", 1) if ":" in item else ("", item)
        parts = [p for p in path.split("/") if p]
        if not path.startswith("/") or any(p in (".", "..") for p in parts):
            raise UsageError(f"--cgroup-root {item}: PATH must be an absolute cgroup path, as /newroot "
                             f"(or CONTROLLER:/newroot)")
        path = "/" + "/".join(parts)
        if roots.get(controller, path) != path:
            raise UsageError(f"--cgroup-root given twice for {controller or 'every hierarchy'}")
        roots[controller] = path
    return roots


def _new_root(controllers: str, roots: dict[str, str]) -> str | None:
    """The root `roots` give the hierarchy of `controllers` (/proc/PID/cgroup's field; "" for
    v2), or None."""
    names = [c for c in controllers.split(",") if c] or ["v2"]
    found = {roots[n] for n in names if n in roots}
    if len(found) > 1:
        raise UsageError(f"--cgroup-root gives the hierarchy {controllers} two roots: {', '.join(sorted(found))}")
    return found.pop() if found else roots.get("")


def _under(path: str, root: str) -> str | None:
    """The part of `path` below `root` ("" for root itself, "/a/b" below), or None."""
    if root == "/":
        return "" if path == "/" else path
    if path == root:
        return ""
    return path[len(root):] if path.startswith(root + "/") else None


def reroot_cgroups(procs: dict, roots: dict[str, str]) -> tuple[dict, list[str]]:
    """The process images `procs` ({vpid: ProcessImage}) with their cgroups moved for
    `--cgroup-root` (`roots`, parse_cgroup_roots): in each hierarchy a root applies to, the
    tree's common cgroup (the deepest one every process and thread is in or below) is
    replaced by the new root, whatever is below it follows, and the cgroup directories
    recorded above it are left out (the new root's missing ancestors are made plain).
    Returns (the images, warnings: a controller no hierarchy of the image has)."""
    if not roots:
        return procs, []
    texts = [p.task.cgroups for p in procs.values()] + [t.cgroups for p in procs.values() for t in p.threads]
    paths: dict[str, list[str]] = {}
    for text in texts:
        for line in text.splitlines():
            controllers, path = _hierarchy(line)
            paths.setdefault(controllers, []).append(path)
    moves: dict[str, tuple[str, str]] = {}                  # controllers: (common root, new root)
    for controllers, members in paths.items():
        new = _new_root(controllers, roots)
        if new is None:
            continue
        common = os.path.commonpath(members) if all(m.startswith("/") for m in members) else None
        if common is not None:
            moves[controllers] = (common, new)
    named = {n for c in paths for n in (c.split(",") if c else ["v2"])}
    warnings = [f"--cgroup-root {c}:{r}: the image has no cgroup hierarchy with {c}"
                for c, r in roots.items() if c and c not in named]

    def move(path: str, controllers: str) -> str | None:
        if controllers not in moves:
            return path
        common, new = moves[controllers]
        rest = _under(path, common)
        return None if rest is None else (new.rstrip("/") + rest) or "/"

    def member_text(text: str) -> str:
        out = []
        for line in text.splitlines():
            hid, controllers, path = line.split(":", 2)
            out.append(f"{hid}:{controllers}:{move(path, controllers)}")
        return "".join(line + "\n" for line in out)

    def dirs_text(text: str) -> str:
        out = []
        for line in text.splitlines():
            kind, controllers, rel, *rest = line.split("\t")
            if controllers in moves:
                at = move(_unesc(rel), controllers)
                if at is None:
                    continue                                # above the common root: not the tree's
                rel = _esc(at)
            out.append("\t".join([kind, controllers, rel, *rest]))
        return "".join(line + "\n" for line in out)

    made = ""
    for controllers, (_common, new) in moves.items():      # the new root's path, parents first
        parts = new.strip("/").split("/") if new != "/" else []
        for i in range(1, len(parts) + 1):
            made += f"d\t{controllers}\t{_esc('/' + '/'.join(parts[:i]))}\t755\t{os.getuid()}\t{os.getgid()}\n"
    out = {}
    for i, (vpid, proc) in enumerate(procs.items()):
        task = dataclasses.replace(proc.task, cgroups=member_text(proc.task.cgroups),
                                   cgroup_dirs=(made if i == 0 else "") + dirs_text(proc.task.cgroup_dirs))
        threads = tuple(dataclasses.replace(t, cgroups=member_text(t.cgroups)) if t.cgroups else t
                        for t in proc.threads)
        out[vpid] = dataclasses.replace(proc, task=task, threads=threads)
    return out, warnings


def ignore_cgroups(procs: dict) -> dict:
    """The process images `procs` with no cgroups to join or make (`--cgroups ignore`): the
    tree stays in the restorer's."""
    return {vpid: dataclasses.replace(
        proc, task=dataclasses.replace(proc.task, cgroups="", cgroup_dirs=""),
        threads=tuple(dataclasses.replace(t, cgroups="") for t in proc.threads))
        for vpid, proc in procs.items()}


def expendable(pid: int) -> None:
    """Make a process being restored the first the OOM killer picks (oom_score_adj 1000;
    its children inherit it), so that a restore running out of memory loses what it was
    building, not ptckpt, which then says so.  The image's own value is set in the fix-up
    (lowering needs CAP_SYS_RESOURCE only below the minimum the process inherited, which
    ptckpt's own value is not)."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("1000")


def oom_kills() -> int:
    """How many processes the OOM killer has ended since boot (/proc/vmstat, 4.13+)."""
    try:
        return procfs.read_vmstat().get("oom_kill", 0)
    except OSError:
        return 0

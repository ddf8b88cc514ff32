"""What the kernel shows of a task, and who answers for it: nothing is dropped unsaid.

Every field of /proc/PID/status (and of each thread's) is in :data:`STATUS`, with the
module that restores it, the reason it needs no restoring (a counter, a value that
follows from what is restored), or the check that refuses the dump when its value holds
state no restore makes.  A field this table does not know (a newer kernel's) refuses the
dump by name: a checkpointer that drops state without saying so is worse than one that
refuses.  The VMA flags are claimed the same way by :mod:`ptckpt.resources.memory`.

:func:`check_status` runs at dump on every thread, while the tree is frozen.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Optional

from .errors import PtckptError, UnsupportedResource
from . import kinds, procfs, tracee


@dataclass(frozen=True)
class Claim:
    how: str                                   # "restored", "derived" or "checked"
    by: str                                    # the module, or why nothing is needed
    refuse: Optional[Callable[[str], Optional[str]]] = None   # value -> why it is refused


def _restored(by: str) -> Claim:
    return Claim("restored", by)


def _derived(why: str) -> Claim:
    return Claim("derived", why)


def _checked(by: str, refuse: Callable[[str], Optional[str]]) -> Claim:
    return Claim("checked", by, refuse)


def _core_dumping(value: str) -> Optional[str]:
    return "it is writing a core dump" if value not in ("", "0") else None


def _untag_mask(value: str) -> Optional[str]:
    # x86 LAM: a process that enabled it has untagged pointers the restore cannot re-enable
    return ("linear address masking (LAM) is enabled" if value and int(value, 16) != 2**64 - 1
            else None)


def _seccomp(value: str) -> Optional[str]:
    return "seccomp strict mode (ptckpt runs without root)" if value == "1" and not tracee.SUSPEND_SECCOMP else None


def _thread_features(value: str) -> Optional[str]:
    return f"x86 thread features ({value}: shadow stack)" if value.strip() else None


_MEMORY = "memory counters that follow from the mappings (resources.memory)"
_PIDS = "pids (resources.pids: the same numbers, or a namespace of their own)"

STATUS: dict[str, Claim] = {
    "Name": _restored("resources.process (comm) and resources.threads (thread names)"),
    "Umask": _restored("resources.process"),
    "State": _restored("resources.process (a stopped process stays stopped)"),
    "Tgid": _restored(_PIDS), "Pid": _restored(_PIDS),
    "NStgid": _restored(_PIDS), "NSpid": _restored(_PIDS),
    "NSpgid": _restored(_PIDS), "NSsid": _restored(_PIDS),
    "PPid": _restored("the process tree (restore.py)"),
    "Ngid": _derived("the NUMA balancing group the kernel picks"),
    "TracerPid": _derived("ptckpt's own; another tracer is refused before the freeze"),
    "Uid": _restored("resources.creds"), "Gid": _restored("resources.creds"),
    "Groups": _restored("resources.creds"),
    "CapInh": _restored("resources.creds"), "CapPrm": _restored("resources.creds"),
    "CapEff": _restored("resources.creds"), "CapBnd": _restored("resources.creds"),
    "CapAmb": _restored("resources.creds"), "NoNewPrivs": _restored("resources.creds"),
    "Seccomp": _checked("resources.creds (filters and strict mode restored; strict mode refused "
                        "without root)", _seccomp),
    "Seccomp_filters": _restored("resources.creds (the filter chain)"),
    "FDSize": _derived("the fd table's size, grown again by the restored fds"),
    "Kthread": _checked("dump.py refuses kernel threads", lambda v: "a kernel thread" if v == "1" else None),
    **{k: _derived(_MEMORY) for k in (
        "VmPeak", "VmSize", "VmLck", "VmPin", "VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem",
        "VmData", "VmStk", "VmExe", "VmLib", "VmPTE", "VmSwap", "HugetlbPages")},
    "CoreDumping": _checked("dump.py", _core_dumping),
    "THP_enabled": _restored("resources.process (prctl THP disable)"),
    "untag_mask": _checked("resources.threads", _untag_mask),
    "x86_Thread_features": _checked("resources.threads", _thread_features),
    "x86_Thread_features_locked": _checked("resources.threads", _thread_features),
    "Threads": _restored("resources.threads"),
    "SigQ": _derived("the count of queued signals, queued again by resources.signals"),
    "SigPnd": _restored("resources.signals"), "ShdPnd": _restored("resources.signals"),
    "SigBlk": _restored("resources.threads (signal mask)"),
    "SigIgn": _restored("resources.signals"), "SigCgt": _restored("resources.signals"),
    "Speculation_Store_Bypass": _restored("resources.process (speculation control)"),
    "SpeculationIndirectBranch": _restored("resources.process (speculation control)"),
    "Cpus_allowed": _restored("resources.threads (CPU affinity)"),
    "Cpus_allowed_list": _restored("resources.threads (CPU affinity)"),
    "Mems_allowed": _derived("the cpuset's memory nodes (set by cgroups, not by the task)"),
    "Mems_allowed_list": _derived("the cpuset's memory nodes (set by cgroups, not by the task)"),
    "voluntary_ctxt_switches": _derived("a counter"),
    "nonvoluntary_ctxt_switches": _derived("a counter"),
}


def _judge(pid: int, pairs, claim_of, unknown: str, refused: str) -> None:
    """Each (key, value) against its claim: a key without one refuses with `unknown`, a
    refused value with `refused` (both formatted with key, value and why)."""
    for key, value in pairs:
        claim = claim_of(key)
        if claim is None:
            raise UnsupportedResource(pid, unknown.format(key=key, value=value) + " (state this "
                                      "ptckpt does not know; a newer ptckpt may)")
        why = claim.refuse(value) if claim.refuse else None
        if why:
            raise UnsupportedResource(pid, refused.format(key=key, value=value, why=why))


def check_status(pid: int, tid: int, raw: dict[str, str]) -> None:
    """Refuse the dump, by name, if a thread's status shows state no restore makes."""
    who = "" if tid == pid else f"thread {tid}: "
    _judge(pid, raw.items(), STATUS.get, who + "/proc status field '{key}: {value}'",
           who + "{why} ('{key}' in /proc status)")


def check_numa(pid: int, remote=None, maps=None) -> None:
    """Refuse a NUMA memory policy (set_mempolicy or mbind).  /proc/PID/numa_maps shows the
    policy each mapping follows, "default" unless the task or the mapping chose one; the
    kernel makes it by walking every page table (~40 ms for 4 GiB).  When it is not being
    read already (procfs.read_ahead, as numa_by_file chose) the frozen process is asked
    instead (`remote`: a syscall scope in its leader): get_mempolicy for the task, then for
    the start of each mapping (`maps`, the frozen process's /proc maps, if read already),
    ~25 us each."""
    if remote is not None and not procfs.reading_ahead(pid, "numa_maps"):
        return _check_numa_injected(pid, remote, maps)
    try:
        lines = procfs.read_numa_maps(pid)
    except procfs.GONE_OR_MISSING:
        return                                   # a kernel without NUMA: no policy to keep
    for line in lines:
        fields = line.split()
        if len(fields) > 1 and fields[1] != "default":
            _refuse_numa(pid, f"{fields[1]} at {fields[0]}")


_MPOL_NAMES = {1: "prefer", 2: "bind", 3: "interleave", 4: "local", 5: "prefer (many)", 6: "weighted interleave"}
_MPOL_F_ADDR = 2
_ENOSYS = 38


def _refuse_numa(pid: int, what: str) -> None:
    raise UnsupportedResource(pid, f"a NUMA memory policy ({what}, from set_mempolicy or mbind)",
                              why="a restore does not make it again", way_out="dump it before it sets one")


def _check_numa_injected(pid: int, remote, maps=None) -> None:
    with remote.scratch(8) as mode:
        res = remote.syscall("get_mempolicy", int(mode), 0, 0, 0, 0)
        if res == -_ENOSYS:
            return                               # a kernel without NUMA: no policy to keep
        if res < 0:
            return check_numa(pid)               # the file says, then
        task = struct.unpack("<i", remote.mem.read(mode, 4))[0]
        if task:
            _refuse_numa(pid, f"{_MPOL_NAMES.get(task, task)} for the whole task")
        for m in maps if maps is not None else procfs.read_maps(pid):
            if m.path == "[vsyscall]":
                continue
            if remote.syscall("get_mempolicy", int(mode), 0, 0, m.start, _MPOL_F_ADDR) < 0:
                return check_numa(pid)
            policy = struct.unpack("<i", remote.mem.read(mode, 4))[0]
            if policy:
                _refuse_numa(pid, f"{_MPOL_NAMES.get(policy, policy)} at {m.start:x}")


def numa_by_file(pid: int) -> bool:
    """Whether numa_maps costs the kernel less than asking the process (check_numa): its
    walk is ~40 ns a resident page, an injected get_mempolicy ~25 us a mapping."""
    try:
        resident = procfs.read_statm(pid).resident
        mappings = len(procfs.read_maps(pid))
    except PtckptError:
        return True
    return mappings * 625 > resident


# --- fdinfo ------------------------------------------------------------------
# /proc/PID/fdinfo/N: the lines every fd has, then those of its kind.  A key no entry
# claims refuses the dump, as a status field does.
_FILES = "resources.files"
FDINFO_COMMON: dict[str, Claim] = {
    "pos": _restored(_FILES + " (the offset)"),
    "flags": _restored(_FILES + " (the open flags; O_ASYNC with its owner and signal)"),
    "mnt_id": _derived("the mount the path is opened on again"),
    "ino": _derived("the inode the path (or the object made again) has"),
    "lock": _restored("resources.locks"),
}
FDINFO_BY_KIND: dict[str, dict[str, Claim]] = {
    "EVENTFD": {k: _restored("resources.eventfd") for k in ("eventfd-count", "eventfd-semaphore")}
    | {"eventfd-id": _derived("the object's id, new for the object made again")},
    "TIMERFD": {k: _restored("resources.timerfd")
                for k in ("clockid", "ticks", "settime flags", "it_value", "it_interval")},
    "SIGNALFD": {"sigmask": _restored("resources.signalfd")},
    "INOTIFY": {"inotify wd": _restored("resources.inotify")},
    "PTY_MASTER": {"tty-index": _restored("resources.terminals (the pty made again, at its index "
                                          "when free)")},
    "FANOTIFY": {k: _restored("resources.fanotify (which refuses content classes and unread events)")
                 for k in ("fanotify flags", "fanotify ino", "fanotify mnt_id", "fanotify sdev")},
    "EPOLL": {"tfd": _restored("resources.epoll")},
    "PIDFD": {k: _restored("resources.pidfds (the process it refers to: a member, a zombie of the "
                           "tree or a dead one; others refused)") for k in ("Pid", "NSpid")},
    "SOCKET": {"scm_fds": _restored("resources.sockets (fds in flight in a unix socket: dumped with "
                                    "their files, passed again; kinds it cannot pass are refused there)")},
}
def fdinfo_keys(text: str) -> list[tuple[str, str]]:
    """(key, value) of each line: "pos:\t0", "inotify wd:1 ino:...", "tfd:  5 events: ..."."""
    out = []
    for line in text.splitlines():
        head, sep, rest = line.partition(":")
        if sep:
            out.append((head.strip(), rest.strip()))
    return out


def check_fdinfo(pid: int, fd: int, kind: str, text: str) -> None:
    """Refuse, by name, an fd whose fdinfo shows state no restore makes."""
    own = FDINFO_BY_KIND.get(kind, {})
    what = f"fd {fd} ({kind.lower()}) with "
    _judge(pid, fdinfo_keys(text), lambda key: FDINFO_COMMON.get(key) or own.get(key),
           what + "'{key}: {value}' in its fdinfo", what + "{why}")


# --- namespaces --------------------------------------------------------------
# A restore makes the tree in ptckpt's own namespaces (a pid namespace or a network
# namespace of its own where asked: --pidns, --netns).  A target that lives in other
# ones (a container) would lose them without a word: refused, with the way in.
NAMESPACES = {"mnt": "-m", "uts": "-u", "ipc": "-i", "net": "-n", "user": "-U", "cgroup": "-C",
              "time": "-T", "time_for_children": "-T"}


def check_namespaces(pid: int) -> None:
    """Refuse a member whose namespaces (but its pid namespace, which dump.py views) are
    not ptckpt's, and one with a namespace file the table of kinds does not know."""
    try:
        present = procfs.list_namespaces(pid)
    except procfs.GONE_OR_MISSING:
        return                                   # gone: the dump meets it elsewhere
    for ns in present:
        if ns not in kinds.NAMESPACES:
            raise UnsupportedResource(pid, f"/proc/{pid}/ns/{ns}, a kind of namespace this ptckpt does "
                                      f"not know (a newer ptckpt may)")
    try:
        if procfs.stat_namespace(pid, "pid_for_children").st_ino != procfs.stat_namespace(pid, "pid").st_ino:
            raise UnsupportedResource(pid, "a pid namespace for its next children other than its own "
                                      "(unshare(CLONE_NEWPID) not yet followed by a fork)")
    except procfs.GONE_OR_MISSING:
        pass
    for ns, flag in NAMESPACES.items():
        try:
            theirs = procfs.stat_namespace(pid, ns).st_ino
            ours = procfs.stat_namespace("self", ns).st_ino
        except procfs.GONE_OR_MISSING:
            continue                             # a kernel without this kind of namespace
        if theirs != ours:
            raise UnsupportedResource(pid, f"a {ns} namespace other than ptckpt's (a container?)",
                                      why="a restore would make it in ptckpt's",
                                      way_out=f"run ptckpt in it: nsenter -t {pid} {flag} ptckpt ...")


# --- security labels -----------------------------------------------------------

def _label(pid: int | str) -> str | None:
    """The LSM label (AppArmor profile, SELinux context); None where no LSM gives one."""
    try:
        return procfs.read_attr_current(pid)
    except (OSError, PtckptError):
        return None


def label_refusal(theirs: str | None, ours: str | None) -> tuple[str, str, str] | None:
    """(what, why, way out) of an UnsupportedResource, or None when the labels agree."""
    if theirs is None or theirs == ours:
        return None
    return (f"a security label of its own ({theirs}; ptckpt runs as {ours})",
            "a restore would run it under ptckpt's", "restore under its label (aa-exec -p, runcon)")


def check_label(pid: int) -> None:
    refusal = label_refusal(_label(pid), _label("self"))
    if refusal:
        raise UnsupportedResource(pid, *refusal)

"""The state comparison every restore in the test suite goes through (issue 19), the idea of
zdtm's checks: what /proc shows of a process just before its dump, and of the restored
process just after the restore, must agree.

Compared: the memory map (addresses, protections, file offsets, what is mapped;
neighbouring anonymous mappings alike count as one, as a restore maps them at once),
each fd's target and open flags, the signal mask and the ignored and caught signals,
credentials (ids, groups, the five capability sets, no_new_privs, seccomp), resource
limits, cwd and root, and the number of threads.  Not compared, because a restore makes
them anew: the inode numbers of pipes, sockets and anonymous inodes (only their kind),
device and inode numbers of mappings, fd positions (tests check those by what the
program reads), and fds 0-2 on a pipe, socket or terminal (a restore gives its own).

The conftest's `ptckpt` fixture takes a snapshot before each `dump PID` and compares after
each `restore --detach` of that image that asks for no change (no plugins, remapping,
environment edits, faults or new terminal).  A test whose program legitimately differs
says which views with ``@pytest.mark.proc_differs("fds", reason=...)``.
"""

from __future__ import annotations

import os
import re

VIEWS = ("maps", "fds", "signals", "creds", "limits", "cwd", "root", "threads")
CHANGING_FLAGS = frozenset({"--plugin", "--remap-path", "--remap-addr", "--set-env", "--unset-env", "--new-pty",
                            "--new-pty-program", "--inject", "--inherit-stdio", "--reconnect"})
_STATUS_CREDS = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs",
                 "Seccomp", "Seccomp_filters")
_STATUS_SIGNALS = ("SigBlk", "SigIgn", "SigCgt")
STDIO = ("stdio on a pipe, socket or terminal", "")
_INODE = re.compile(r"(pipe|socket|anon_inode):\[?\d*\]?")


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _fd_target(link: str) -> str:
    m = _INODE.match(link)
    return m.group(1) if m else link


def snapshot(pid: int) -> dict[str, object]:
    """What /proc shows of `pid` (see the module doc); raises OSError if it is gone."""
    status = dict(line.split(":", 1) for line in _read(f"/proc/{pid}/status").splitlines() if ":" in line)
    status = {k: v.strip() for k, v in status.items()}
    maps: list[tuple[str, str, str, str, str]] = []
    for line in _read(f"/proc/{pid}/maps").splitlines():
        parts = line.split(None, 5)
        path = parts[5] if len(parts) > 5 else ""
        start, end = parts[0].split("-")
        if (maps and (not path or path.startswith("[")) and maps[-1][4] == path and maps[-1][1] == start
                and maps[-1][2] == parts[1]):
            maps[-1] = (maps[-1][0], end, parts[1], "", path)   # anonymous neighbours alike: one
        else:
            maps.append((start, end, parts[1], parts[2] if path.startswith("/") else "", path))
    fds = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
            info = dict(line.split(":", 1) for line in _read(f"/proc/{pid}/fdinfo/{name}").splitlines()
                        if ":" in line)
        except OSError:
            continue                                    # closed as we looked
        if target == "anon_inode:[userfaultfd]" and int(name) >= 900:
            continue                                    # ptckpt's memory tracking (dump --track-mem)
        fd, target = int(name), _fd_target(target)
        if fd <= 2 and (target in ("pipe", "socket") or target.startswith(("/dev/pts/", "/dev/tty"))):
            fds[fd] = STDIO                             # the root's stdio: a restore gives its own
            continue
        fds[fd] = (target, info.get("flags", "").strip())
    return {
        "maps": tuple(maps),
        "fds": fds,
        "signals": {k: status.get(k) for k in _STATUS_SIGNALS},
        "creds": {k: status.get(k) for k in _STATUS_CREDS},
        "limits": _read(f"/proc/{pid}/limits"),
        "cwd": os.readlink(f"/proc/{pid}/cwd"),
        "root": os.readlink(f"/proc/{pid}/root"),
        "threads": int(status.get("Threads", "0")),
    }


def differences(before: dict, after: dict, ignore: frozenset[str] = frozenset()) -> list[str]:
    """One line per view that differs, naming what."""
    out = []
    for view in VIEWS:
        if view in ignore or before.get(view) == after.get(view):
            continue
        a, b = before[view], after[view]
        if view == "maps":
            gone, new = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            out.append(f"maps: only before {gone[:4]}, only after {new[:4]}")
        elif isinstance(a, dict):
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and a.get(k) != STDIO)
            if not keys:
                continue
            out.append(f"{view}: " + "; ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:6]))
        else:
            out.append(f"{view}: {a!r} -> {b!r}")
    return out


def restored_pid(stderr: str) -> int | None:
    """The restored process's pid as the test sees it, from the restore's report line."""
    m = re.search(r"restored pid \d+ (?:in a new pid namespace \(init \d+\) )?as (\d+)", stderr)
    return int(m.group(1)) if m else None

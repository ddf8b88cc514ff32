"""fds on namespace files (nsfs) through `ptckpt dump` and `ptckpt restore`
(fixtures/nsfds.py): the restored program checks each fd still names its own namespace
(fstat inode and link text those of /proc/self/ns/<entry> after the restore), or the
bind-mounted one it had.  A namespace with no name the restore could find is refused at
dump.  Real processes and namespaces; `spawn` kills what it started, the namespaces
made here are deleted in finalisers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest

from conftest import require
from test_restore import _dump_kill, _one_line, _restore

EXIT_UNSUPPORTED, EXIT_INCOMPATIBLE = 13, 15


def _finish(t) -> list[str]:
    t.signal(signal.SIGUSR1)
    assert t.wait_exit(10) == 0, t.describe()
    assert not [line for line in t.out_lines() if line.startswith("FAIL")], t.describe()
    return t.out_lines()


def _preamble(t) -> list[tuple[str, str, str]]:
    """(fd, entry, inode) of each NS line."""
    return [tuple(line.split()[1:4]) for line in t.preamble if line.startswith("NS ")]


def test_own_namespaces_come_back(spawn, ptckpt, tmp_path):
    """zdtm's proc-self, for every entry of /proc/self/ns: restored in place, every fd
    names the very namespaces it named (the process is in them again)."""
    t = spawn("nsfds.py", "own")
    before = _preamble(t)
    assert {e for _fd, e, _ino in before} >= {"net", "mnt", "pid", "uts", "ipc", "user"}
    _dump_kill(ptckpt, t, tmp_path / "img")
    assert _restore(ptckpt, tmp_path / "img") == t.pid
    lines = _finish(t)
    assert lines[-len(before) - 1:] == [f"SAME {fd} {e} {ino}" for fd, e, ino in before] + [f"OK {len(before)}"]


@pytest.mark.proc_differs("fds", reason="--netns: the net namespace fds name the new namespace, as they must")
def test_own_net_namespace_follows_the_process_into_a_new_one(spawn, ptckpt, tmp_path):
    """--netns: the fd of its own network namespace names the new one it is in now."""
    t = spawn("nsfds.py", "own")
    net = {fd: ino for fd, e, ino in _preamble(t) if e == "net"}
    _dump_kill(ptckpt, t, tmp_path / "img")
    assert _restore(ptckpt, tmp_path / "img", "--netns") == t.pid
    after = {line.split()[1]: line.split()[3] for line in _finish(t) if line.startswith("SAME ") and " net " in line}
    assert set(after) == set(net) and len(set(after.values())) == 1
    assert set(after.values()) != set(net.values())          # a new namespace, checked by the program


@pytest.fixture
def named_netns():
    """`ip netns add` under a name of this test's; deleted at the end whatever happens."""
    require("ip")
    name = f"ptckpt-nsfs-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    yield name
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_bound_namespace_comes_back(spawn, ptckpt, tmp_path, named_netns):
    path = f"/run/netns/{named_netns}"
    t = spawn("nsfds.py", "bound", path)
    [(fd, _path, ino)] = _preamble(t)
    _dump_kill(ptckpt, t, tmp_path / "img")
    assert _restore(ptckpt, tmp_path / "img") == t.pid
    assert _finish(t)[-2:] == [f"SAME {fd} {path} {ino}", "OK 1"]


def test_bound_namespace_gone_or_replaced_is_refused_at_restore(spawn, ptckpt, tmp_path, named_netns):
    """The namespace deleted since the dump: refused before anything is built, one line;
    another namespace added under the same name is not it either."""
    path = f"/run/netns/{named_netns}"
    t = spawn("nsfds.py", "bound", path)
    _dump_kill(ptckpt, t, tmp_path / "img")
    subprocess.run(["ip", "netns", "delete", named_netns], check=True, capture_output=True)
    _one_line(ptckpt("restore", "-D", tmp_path / "img", "--detach"), EXIT_INCOMPATIBLE, path, "gone")
    subprocess.run(["ip", "netns", "add", named_netns], check=True, capture_output=True)
    _one_line(ptckpt("restore", "-D", tmp_path / "img", "--detach"), EXIT_INCOMPATIBLE, path,
              "another namespace")


def test_foreign_namespace_is_refused_at_dump(spawn, ptckpt, tmp_path):
    """A network namespace only the fd keeps (its last process gone, mounted nowhere):
    refused by name with the ways out, one line; the program goes on with its fd."""
    t = spawn("nsfds.py", "foreign")
    [(fd, _what, ino)] = _preamble(t)
    res = ptckpt("dump", t.pid, "-D", tmp_path / "img", "--kill")
    _one_line(res, EXIT_UNSUPPORTED, f"process {t.pid}", f"fd {fd} -> net:[{ino}]",
              "net namespace the process is not in", "ip netns attach", f"--external fd:{fd}")
    assert not (tmp_path / "img").exists()
    assert _finish(t)[-2:] == [f"ALIVE {fd} {ino}", "OK 1"]


@pytest.fixture
def bind_mounts():
    """Bind mounts made by the test (target paths): unmounted and removed at the end."""
    made: list[str] = []
    yield made
    for path in reversed(made):
        subprocess.run(["umount", "--lazy", path], capture_output=True)   # a process may hold it still
        with contextlib.suppress(OSError):
            os.unlink(path)


def test_foreign_namespace_named_after_the_fact_comes_back(spawn, ptckpt, tmp_path, bind_mounts):
    """The way out the refusal names: the namespace bind-mounted somewhere (here a file of
    the test's, from the program's own fd): the dump finds it in mountinfo, the restore
    opens it there and the program's fd names the same namespace again."""
    t = spawn("nsfds.py", "foreign")
    [(fd, _what, ino)] = _preamble(t)
    name = tmp_path / "netns-name"
    name.touch()
    bind_mounts.append(str(name))
    subprocess.run(["mount", "--bind", f"/proc/{t.pid}/fd/{fd}", str(name)], check=True, capture_output=True)
    _dump_kill(ptckpt, t, tmp_path / "img")
    assert _restore(ptckpt, tmp_path / "img") == t.pid
    assert _finish(t)[-2:] == [f"ALIVE {fd} {ino}", "OK 1"]

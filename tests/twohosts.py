"""Two test hosts and a Dask cluster over them, for tests/test_group.py and bench/group_dump.

The hosts are network namespaces joined by a veth pair (10.77.0.1 on host A, 10.77.0.2 on
host B; the addresses exist only there).  The cluster: a `dask scheduler` on host A,
listening on A's address, and one `dask worker --name A` / `--name B` (one thread, no
nanny) in each namespace, each with an image cache of its own.  Commands run in a
namespace through nsenter --net (`ip netns exec` would give each process a mount
namespace of its own, which a dump refuses).  Both context managers undo what they made,
whatever happens: the namespaces deleted, every process started killed by process group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ADDR = {"A": "10.77.0.1", "B": "10.77.0.2"}
PORT = 8786
DASK = str(Path(sys.executable).parent / "dask")
ROOT = Path(__file__).resolve().parent.parent


class Hosts:
    """The two namespaces: `inside(host)` is the argv prefix that runs a command there."""

    def __init__(self, tag: str):
        self.names = {h: f"ptckpt-grp{tag}-{h.lower()}" for h in ADDR}

    def inside(self, host: str) -> list[str]:
        return [shutil.which("nsenter") or "nsenter", f"--net=/run/netns/{self.names[host]}"]

    @property
    def backend(self) -> str:
        return f"dask://{ADDR['A']}:{PORT}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def two_hosts():
    tag = str(os.getpid())
    made = Hosts(tag)
    veth = {h: f"pg{tag[-6:]}{h.lower()}" for h in ADDR}
    try:
        for ns in made.names.values():
            _ip("netns", "add", ns)
        _ip("link", "add", veth["A"], "type", "veth", "peer", "name", veth["B"])
        for h, ns in made.names.items():
            _ip("link", "set", veth[h], "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ADDR[h]}/24", "dev", veth[h])
            _ip("-n", ns, "link", "set", veth[h], "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield made
    finally:
        for ns in made.names.values():
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def start(hosts: Hosts, name: str, host: str, argv: list[str], logs: Path) -> subprocess.Popen:
    """`argv` (a dask command) on `host`, in a session of its own, its output in logs/NAME.log."""
    with open(logs / f"{name}.log", "wb") as log:
        return subprocess.Popen(hosts.inside(host) + argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=dict(_env(), PTCKPT_IMAGE_CACHE=str(logs / f"cache-{name}")),
                                start_new_session=True)


def start_worker(hosts: Hosts, name: str, host: str, logs: Path) -> subprocess.Popen:
    """A one-thread `dask worker --name NAME` on `host` (A or B)."""
    return start(hosts, f"worker-{name}", host, [DASK, "worker", f"tcp://{ADDR['A']}:{PORT}", "--name", name,
                                                 "--nthreads", "1", "--no-nanny", "--host", ADDR[host],
                                                 "--no-dashboard"], logs)


def wait_for_workers(hosts: Hosts, n: int) -> None:
    probe = ("from distributed import Client\n"
             f"with Client('tcp://{ADDR['A']}:{PORT}', timeout=60) as c: c.wait_for_workers({n}, timeout=60)\n")
    subprocess.run(hosts.inside("A") + [sys.executable, "-c", probe], check=True, timeout=120, env=_env())


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@contextlib.contextmanager
def dask_cluster(hosts: Hosts, logs: Path):
    """Yields {worker name: its Popen}; the workers import this tree's ptckpt."""
    procs: list[subprocess.Popen] = []
    try:
        procs.append(start(hosts, "scheduler", "A", [DASK, "scheduler", "--host", ADDR["A"], "--port", str(PORT),
                                                      "--no-dashboard"], logs))
        workers = {h: start_worker(hosts, h, h, logs) for h in ADDR}
        procs += workers.values()
        wait_for_workers(hosts, 2)
        yield workers
    finally:
        stop(procs)

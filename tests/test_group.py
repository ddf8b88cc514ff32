"""Group dump and restore across hosts (ptckpt group dump|restore --backend dask://...).

Two test hosts and a Dask cluster over them (tests/twohosts.py: network namespaces joined
by a veth pair, a scheduler on host A, a worker named A and one named B, each in its
namespace).  The programs are started in the namespaces with nsenter --net; the `ptckpt
group` commands run on host A.  Everything started is killed at the end (the workers'
process groups, the targets and what was restored from them, which are the workers'
children), and the namespaces are deleted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FIXTURES_DIR, needs, needs_network_lock, read_counter, reap_orphans, wait_until
from ptckpt.errors import ExitCode
from ptckpt.symbols import SymbolTable, read_environ
from ptckpt.tracee import AddressSpace
from test_emulator import testbench_bin  # noqa: F401
from twohosts import ADDR, PORT, dask_cluster, start_worker, stop, two_hosts, wait_for_workers

pytestmark = [needs("ip", "nsenter", "nft"), pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


@pytest.fixture(scope="module")
def hosts():
    with two_hosts() as made:
        yield made


@pytest.fixture(scope="module")
def cluster(hosts, tmp_path_factory):
    logs = tmp_path_factory.mktemp("group-cluster")
    try:
        with dask_cluster(hosts, logs) as workers:
            yield workers
    finally:
        reap_orphans()
        for log in logs.glob("*.log"):
            if b"Traceback" in log.read_bytes():
                print(f"--- {log.name} ---\n{log.read_text(errors='replace')[-4000:]}")


def _pingpong(spawn, hosts, tmp_path, port: int):
    """A server on host B and its client on host A, talking: (client, server, their state files)."""
    files = {role: tmp_path / f"{role}.{port}.state" for role in ("client", "server")}
    script = str(FIXTURES_DIR / "pingpong.py")
    server = spawn(hosts.inside("B")[0], hosts.inside("B")[1], sys.executable, script, files["server"], "server",
                   ADDR["B"], port, "0.005", out=False, ready=False)
    client = spawn(hosts.inside("A")[0], hosts.inside("A")[1], sys.executable, script, files["client"], "client",
                   ADDR["B"], port, out=False)
    wait_until(lambda: read_counter(files["server"]) >= 20, 20, message="the conversation to start")
    return client, server, files


def _events_left(hosts) -> list[str]:
    """The ptckpt-group events and variables the scheduler still holds (each group clears
    its own)."""
    probe = ("from distributed import Client\n"
             f"with Client('tcp://{ADDR['A']}:{PORT}', timeout=30) as c:\n"
             "    print(c.run_on_scheduler(lambda dask_scheduler: [n for n in "
             "[*dask_scheduler.extensions['events']._events, *dask_scheduler.extensions['variables'].variables] "
             "if n.startswith('ptckpt-group')]))\n")
    res = subprocess.run(hosts.inside("A") + [sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True)
    return eval(res.stdout.strip().splitlines()[-1])


def _locks(hosts, host: str) -> str:
    return subprocess.run(hosts.inside(host) + ["nft", "list", "tables"], capture_output=True, text=True,
                          timeout=30).stdout


def _lock_times(hosts, host: str) -> list[float]:
    """When each ptckpt network lock of `host` was made (its table's lockinfo, time.time())."""
    probe = "from ptckpt import netlock\nprint([i.created for i in netlock.list_locks()])\n"
    res = subprocess.run(hosts.inside(host) + [sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True)
    return eval(res.stdout.strip().splitlines()[-1])


@needs_network_lock()
def test_group_dump_kill_and_restore_the_conversation_goes_on(cluster, hosts, spawn, ptckpt, tmp_path):
    client, server, files = _pingpong(spawn, hosts, tmp_path, 7001)
    image = tmp_path / "group"
    res = ptckpt("group", "dump", "-D", image, "--backend", hosts.backend, "--tcp-established", "--kill", "--json",
                 f"A:{client.pid}", f"B:{server.pid}", prefix=hosts.inside("A"), timeout=180)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert client.wait_exit(10) == -9 and server.wait_exit(10) == -9
    counts = {role: read_counter(path) for role, path in files.items()}
    time.sleep(0.3)
    assert {role: read_counter(path) for role, path in files.items()} == counts, "nothing runs after --kill"
    assert 0 <= counts["client"] - counts["server"] <= 1
    group = json.loads((image / "group.json").read_text())
    assert [(m["member"], m["worker"], m["pid"], m["directory"]) for m in group["members"]] == [
        (f"A:{client.pid}", "A", client.pid, f"A-{client.pid}"), (f"B:{server.pid}", "B", server.pid, f"B-{server.pid}")]
    assert group["options"]["mode"] == "kill" and group["options"]["tcp_established"]
    assert [m["member"] for m in out["members"]] == [m["member"] for m in group["members"]]
    for m in group["members"]:
        assert (image / m["directory"] / "inventory.img").exists()
    assert "ptckpt" in _locks(hosts, "A") and "ptckpt" in _locks(hosts, "B"), "the locks wait for the restore"
    # every member's connection was locked before any member passed the barrier "frozen"
    # (to capture): as each member says, and as its lock's table says (its creation time)
    times = {m["member"]: m["times"] for m in group["members"]}
    all_frozen = min(t["all frozen"] for t in times.values())
    for member, t in times.items():
        assert "locked" in t and t["start"] < t["locked"] <= t["frozen"] <= all_frozen, (member, times)
    for host in ADDR:
        made = _lock_times(hosts, host)
        assert len(made) == 1 and made[0] <= all_frozen, (host, made, times)
    kept = [m["worker_image"] for m in group["members"]]
    assert all(os.path.isdir(k) for k in kept), "the workers keep the images their locks name"

    res = ptckpt("group", "restore", "-D", image, "--backend", hosts.backend, prefix=hosts.inside("A"), timeout=180)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [f"A:{client.pid}", f"B:{server.pid}"]
    client.adopt(client.pid)
    server.adopt(server.pid)
    # each side checks every line it gets: a byte lost or repeated either way ends it (exit 4)
    wait_until(lambda: read_counter(files["server"]) >= counts["server"] + 100, 30,
               message=lambda: f"the conversation to go on: {client.describe()}\n{server.describe()}")
    assert read_counter(files["client"]) >= counts["client"] + 100
    assert client.alive() and server.alive()
    assert "ptckpt" not in _locks(hosts, "A") + _locks(hosts, "B"), "the restore lifted both locks"
    assert _events_left(hosts) == [], "each group clears the Dask events it made"
    assert not any(os.path.exists(k) for k in kept), "the restores removed the workers' copies"


@needs_network_lock()
def test_a_member_that_fails_leaves_the_others_running_as_they_were(cluster, hosts, spawn, ptckpt, tmp_path):
    client, server, files = _pingpong(spawn, hosts, tmp_path, 7002)
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    bad = next(p for p in range(pid_max - 1, 1, -1) if not os.path.exists(f"/proc/{p}"))
    res = ptckpt("group", "dump", "-D", tmp_path / "group", "--backend", hosts.backend, "--tcp-established",
                 "--kill", f"A:{client.pid}", f"B:{bad}", prefix=hosts.inside("A"), timeout=180)
    assert res.returncode == ExitCode.GROUP_FAILED, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert f"member B:{bad} failed at check: no such process: {bad}" in res.stderr, res.stderr
    assert "every member runs on as it was" in res.stderr
    assert not (tmp_path / "group").exists()
    before = read_counter(files["client"])
    wait_until(lambda: read_counter(files["client"]) >= before + 50, 20, message="the client to run on")
    assert client.alive() and server.alive()
    assert "ptckpt" not in _locks(hosts, "A"), "its network lock went with the failed group"
    # two members on a worker of one thread, or a worker that is not in the cluster: refused
    res = ptckpt("group", "dump", "-D", tmp_path / "group", "--backend", hosts.backend,
                 f"A:{client.pid}", f"A:{server.pid}", prefix=hosts.inside("A"), timeout=60)
    assert res.returncode == ExitCode.USAGE and "worker A runs 1 thread(s) for 2 members: start it with " \
        "--nthreads 2" in res.stderr, res.stderr
    res = ptckpt("group", "dump", "-D", tmp_path / "group", "--backend", hosts.backend,
                 f"A:{client.pid}", f"C:{server.pid}", prefix=hosts.inside("A"), timeout=60)
    assert res.returncode == ExitCode.USAGE and "no Dask worker named 'C' (the scheduler has: A, B)" in res.stderr


MEET = '''
import os, time
from ptckpt.plugins import Plugin

LOG = {log!r}


def note(text):
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (text + "\\n").encode())
    os.close(fd)


class Meet(Plugin):
    name = "meet"
    recorded = False

    def pre_dump(self, proc, ctx):
        if ctx.member.startswith("A:"):
            time.sleep(1.0)                   # A comes late: B must wait for it
        note(f"ARRIVE {{ctx.member or '-'}} {{time.time()}}")
        ctx.barrier("meet")
        note(f"PASS {{ctx.member or '-'}} {{time.time()}} {{','.join(ctx.members) or '-'}}")
        note(f"ELECT {{ctx.member or '-'}} {{ctx.elect('emulator') or '-'}}")
'''


def test_plugin_barrier_across_hosts(cluster, hosts, spawn, ptckpt, fixture_bins, tmp_path):
    log = tmp_path / "meet.log"
    plugin = tmp_path / "meet.py"
    plugin.write_text(MEET.format(log=str(log)))
    counters = {h: spawn(hosts.inside(h)[0], hosts.inside(h)[1], fixture_bins["counter"],
                         tmp_path / f"counter-{h}", out=False) for h in ADDR}
    names = [f"{h}:{counters[h].pid}" for h in ADDR]
    res = ptckpt("group", "dump", "-D", tmp_path / "group", "--backend", hosts.backend, "--plugin",
                 f"{plugin}:Meet", *names, prefix=hosts.inside("A"), timeout=180)
    assert res.returncode == 0, res.stderr
    seen = [line.split() for line in log.read_text().splitlines()]
    arrive = {w[1]: float(w[2]) for w in seen if w[0] == "ARRIVE"}
    passed = {w[1]: (float(w[2]), w[3]) for w in seen if w[0] == "PASS"}
    assert set(arrive) == set(passed) == set(names)
    for member, (when, members) in passed.items():
        assert when >= max(arrive.values()), f"{member} passed the barrier before every member reached it"
        assert members == ",".join(names)
    assert passed[names[1]][0] - arrive[names[1]] >= 0.9, "B waited for A"
    elected = {w[1]: w[2] for w in seen if w[0] == "ELECT"}
    assert set(elected) == set(names) and len(set(elected.values())) == 1 and elected[names[0]] in names, elected
    assert _events_left(hosts) == []
    assert all(c.alive() for c in counters.values())
    # a dump of one tree: the barrier returns at once
    log.unlink()
    single = spawn("counter")
    res = ptckpt("dump", single.pid, "-D", tmp_path / "single", "--plugin", f"{plugin}:Meet")
    assert res.returncode == 0, res.stderr
    (_, _, t_arrive), (_, _, t_pass, members), elected = [line.split() for line in log.read_text().splitlines()]
    assert float(t_pass) - float(t_arrive) < 0.5 and members == "-" and elected == ["ELECT", "-", "-"]


@needs_network_lock()
def test_a_member_that_fails_mid_restore_leaves_nothing_and_a_retry_works(cluster, hosts, spawn, ptckpt, tmp_path):
    client, server, files = _pingpong(spawn, hosts, tmp_path, 7003)
    image = tmp_path / "group"
    res = ptckpt("group", "dump", "-D", image, "--backend", hosts.backend, "--tcp-established", "--kill",
                 f"A:{client.pid}", f"B:{server.pid}", prefix=hosts.inside("A"), timeout=180)
    assert res.returncode == 0, res.stderr
    assert client.wait_exit(10) == -9 and server.wait_exit(10) == -9
    counts = {role: read_counter(path) for role, path in files.items()}
    with open(files["server"], "a") as f:       # a file the server holds changed: its restore is refused
        f.write("changed\n")
    res = ptckpt("group", "restore", "-D", image, "--backend", hosts.backend, prefix=hosts.inside("A"), timeout=180)
    assert res.returncode == ExitCode.GROUP_FAILED, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert f"group restore failed: member B:{server.pid} failed at rebuild: " in res.stderr, res.stderr
    assert str(files["server"]) in res.stderr and "every member made was killed before it ran" in res.stderr
    time.sleep(0.3)
    assert not os.path.exists(f"/proc/{client.pid}") and not os.path.exists(f"/proc/{server.pid}"), \
        "nothing is left of the group"
    assert read_counter(files["client"]) == counts["client"], "the client never ran"
    # its connection stayed in repair mode under the locks: the group can be restored again
    res = ptckpt("group", "restore", "-D", image, "--backend", hosts.backend, "--file-policy", "warn", "--json",
                 prefix=hosts.inside("A"), timeout=180)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [(m["member"], m["worker"], m["pid"]) for m in out["members"]] == [
        (f"A:{client.pid}", "A", client.pid), (f"B:{server.pid}", "B", server.pid)]
    client.adopt(client.pid)
    server.adopt(server.pid)
    wait_until(lambda: read_counter(files["server"]) >= counts["server"] + 100, 30,
               message=lambda: f"the conversation to go on: {client.describe()}\n{server.describe()}")
    assert client.alive() and server.alive()


BUSY = '''
import os, signal, time
from ptckpt.plugins import Plugin


class Busy(Plugin):
    name = "busy"
    recorded = False

    def busy(self, proc, ctx):                    # frozen, nothing captured yet
        if ctx.member.startswith("{member}:"):
            {action}
        return None
'''


def _busy_plugin(tmp_path: Path, member: str, action: str) -> str:
    """A plugin whose member `member` does `action` once frozen, before its capture."""
    path = tmp_path / "busy.py"
    path.write_text(BUSY.format(member=member, action=action))
    return f"{path}:Busy"


def test_a_member_killed_mid_dump_leaves_the_others_running(cluster, hosts, spawn, ptckpt, fixture_bins, tmp_path):
    plugin = _busy_plugin(tmp_path, "B", "os.kill(proc.pid, signal.SIGKILL)")     # B dies before its capture
    counters = {h: spawn(hosts.inside(h)[0], hosts.inside(h)[1], fixture_bins["counter"],
                         tmp_path / f"counter-{h}", out=False) for h in ADDR}
    res = ptckpt("group", "dump", "-D", tmp_path / "group", "--backend", hosts.backend, "--kill", "--plugin",
                 plugin, *(f"{h}:{c.pid}" for h, c in counters.items()), prefix=hosts.inside("A"),
                 timeout=180)
    assert res.returncode == ExitCode.GROUP_FAILED, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert f"member B:{counters['B'].pid} failed at capture: " in res.stderr, res.stderr
    assert "every member runs on as it was" in res.stderr
    assert counters["B"].wait_exit(10) == -9
    before = read_counter(tmp_path / "counter-A")
    wait_until(lambda: read_counter(tmp_path / "counter-A") > before + 50, 10, message="member A to run on")
    assert not (tmp_path / "group").exists()


def test_place_restores_members_on_other_workers(cluster, hosts, spawn, ptckpt, fixture_bins, tmp_path):
    counters = {h: spawn(hosts.inside(h)[0], hosts.inside(h)[1], fixture_bins["counter"],
                         tmp_path / f"counter-{h}", out=False) for h in ADDR}
    image = tmp_path / "group"
    res = ptckpt("group", "dump", "-D", image, "--backend", hosts.backend, "--kill",
                 *(f"{h}:{c.pid}" for h, c in counters.items()), prefix=hosts.inside("A"), timeout=180)
    assert res.returncode == 0, res.stderr
    counts = {}
    for h, c in counters.items():
        assert c.wait_exit(10) == -9
        counts[h] = read_counter(tmp_path / f"counter-{h}")
    assert [m["worker_image"] for m in json.loads((image / "group.json").read_text())["members"]] == ["", ""], \
        "no network lock: the workers keep no copy"
    res = ptckpt("group", "restore", "-D", image, "--backend", hosts.backend, "--place", "A=B", "--place", "B=A",
                 "--set-env", "PTCKPT_GROUP=moved", "--json", prefix=hosts.inside("A"), timeout=180)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    pids = {h: c.pid for h, c in counters.items()}
    assert [(m["member"], m["worker"], m["pid"]) for m in out["members"]] == [
        (f"A:{pids['A']}", "B", pids["A"]), (f"B:{pids['B']}", "A", pids["B"])]
    for h, c in counters.items():
        c.adopt(c.pid)
        other = "B" if h == "A" else "A"
        assert os.readlink(f"/proc/{c.pid}/ns/net") == os.readlink(f"/proc/{cluster[other].pid}/ns/net"), \
            f"member {h} now runs on host {other}"
        with AddressSpace(c.pid) as mem:                 # getenv()'s view (--set-env)
            assert b"PTCKPT_GROUP=moved" in read_environ(mem, SymbolTable.for_process(c.pid))
        wait_until(lambda: read_counter(tmp_path / f"counter-{h}") > counts[h] + 20, 10,
                   message=f"member {h} to count on")
    res = ptckpt("group", "restore", "-D", image, "--backend", hosts.backend, "--place", "C=A",
                 prefix=hosts.inside("A"), timeout=60)
    assert res.returncode == ExitCode.USAGE and "no member of the group ran on worker 'C'" in res.stderr




def test_a_worker_lost_mid_dump_leaves_the_others_running(cluster, hosts, spawn, ptckpt, fixture_bins, tmp_path):
    """Worker C (a third one, on host B) dies while its member is frozen: the group gives up,
    member A resumes, and C's target, detached by the kernel with its tracer gone, runs on."""
    extra = [start_worker(hosts, "C", "B", tmp_path)]
    try:
        wait_for_workers(hosts, 3)
        plugin = _busy_plugin(tmp_path, "C", "time.sleep(30)")     # its worker is killed meanwhile
        counters = {h: spawn(hosts.inside(host)[0], hosts.inside(host)[1], fixture_bins["counter"],
                             tmp_path / f"counter-{h}", out=False) for h, host in (("A", "A"), ("C", "B"))}
        with open(tmp_path / "group.stderr", "wb") as err:
            dump = subprocess.Popen(hosts.inside("A") + [sys.executable, "-m", "ptckpt", "group", "dump", "-D",
                                                         str(tmp_path / "group"), "--backend", hosts.backend, "--kill",
                                                         "--plugin", plugin,
                                                         *(f"{h}:{c.pid}" for h, c in counters.items())],
                                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            wait_until(lambda: all(Path(f"/proc/{c.pid}/status").read_text().count("TracerPid:\t0") == 0
                                   for c in counters.values()), 30, message="both members frozen")
            stop(extra)
            assert dump.wait(60) == ExitCode.GROUP_FAILED
        finally:
            stop([dump])
        stderr = (tmp_path / "group.stderr").read_text()
        assert f"failed: member C:{counters['C'].pid} failed: worker C left the cluster; every member runs on " \
            "as it was" in stderr and "Traceback" not in stderr, stderr
        for h, c in counters.items():
            before = read_counter(tmp_path / f"counter-{h}")
            wait_until(lambda: read_counter(tmp_path / f"counter-{h}") > before + 20, 10,
                       message=f"member {h} to run on")
            assert "TracerPid:\t0" in Path(f"/proc/{c.pid}/status").read_text()
    finally:
        stop(extra)


def test_a_member_late_at_a_barrier_makes_the_group_give_up(cluster, hosts, spawn, ptckpt, fixture_bins, tmp_path):
    """B stays in its busy event (frozen) past --timeout: A, waiting frozen at the barrier,
    gives up and says so, and both run on."""
    plugin = _busy_plugin(tmp_path, "B", "time.sleep(4)")
    counters = {h: spawn(hosts.inside(h)[0], hosts.inside(h)[1], fixture_bins["counter"],
                         tmp_path / f"counter-{h}", out=False) for h in ADDR}
    names = [f"{h}:{c.pid}" for h, c in counters.items()]
    res = ptckpt("group", "dump", "-D", tmp_path / "group", "--backend", hosts.backend, "--kill", "--timeout", "1s",
                 "--plugin", plugin, *names, prefix=hosts.inside("A"), timeout=120)
    assert res.returncode == ExitCode.GROUP_FAILED, res.stderr
    assert (f"member {names[0]} failed at freeze: member {names[1]} did not reach barrier frozen within 1 s; "
            "every member runs on as it was") in res.stderr, res.stderr
    for h in ADDR:
        before = read_counter(tmp_path / f"counter-{h}")
        wait_until(lambda: read_counter(tmp_path / f"counter-{h}") > before + 20, 10, message=f"member {h} to run on")


LATE_LINK = '''
import importlib.util, os, time

spec = importlib.util.spec_from_file_location("ptckpt_emulator_link_under_test", {vendor!r})
vendor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vendor)
LOG = {log!r}


def note(text):
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (text + "\\n").encode())
    os.close(fd)


class LateLink(vendor.EmulatorLink):
    """The vendor plugin as it is, with member A 1 s late to its frozen and restored events."""

    def _late(self, event, proc, ctx, call):
        if ctx.member.startswith("A:"):
            time.sleep(1.0)
        note(f"ARRIVE {{event}} {{ctx.member}} {{time.time()}}")
        call(proc, ctx)
        note(f"DONE {{event}} {{ctx.member}} {{time.time()}}")

    def frozen(self, proc, ctx):
        self._late("frozen", proc, ctx, super().frozen)

    def restored(self, proc, ctx):
        self._late("restored", proc, ctx, super().restored)
'''

EMU_VECTORS = 3000


def _testbench(spawn, hosts, host: str, exe, tmp_path: Path, name: str, address: str, config: str):
    """testbench OUTFILE SLOTDIR ADDRESS on `host`: (its Target, OUTFILE, SLOTDIR)."""
    slot = tmp_path / name
    slot.mkdir()
    (slot / "config").write_text(config)
    outfile = tmp_path / f"{name}.out"
    target = spawn(*hosts.inside(host), str(exe), outfile, slot, address, out=False)
    return target, outfile, slot


def _signature(outfile: Path, timeout: float, target) -> str:
    line = wait_until(lambda: next((ln for ln in outfile.read_text().splitlines() if ln.startswith("SIGNATURE ")),
                                   None) if outfile.exists() else None, timeout,
                      message=lambda: f"a SIGNATURE in {outfile}: {target.describe()}")
    return line.split()[1]


def _met(log: Path, event: str, names: list[str]) -> None:
    """Both members came to the vendor plugin's barrier in `event`: neither went on before
    the other arrived, and B (on time) waited there for A (1 s late)."""
    seen = [line.split() for line in log.read_text().splitlines() if line.split()[1] == event]
    arrive = {w[2]: float(w[3]) for w in seen if w[0] == "ARRIVE"}
    done = {w[2]: float(w[3]) for w in seen if w[0] == "DONE"}
    assert set(arrive) == set(done) == set(names), seen
    for member, when in done.items():
        assert when >= max(arrive.values()), f"{member} left {event} before every member arrived: {seen}"
    assert done[names[1]] - arrive[names[1]] >= 0.9, f"B waited for A at the barrier in {event}: {seen}"


def test_emulator_testbenches_on_two_hosts_meet_at_the_vendor_plugins_barrier(cluster, hosts, spawn, ptckpt,
                                                                                testbench_bin, tmp_path):
    """The emulator (--per-connection, not a checkpoint target: it runs on) on host B; a
    testbench on host A and one on host B drive it over TCP at B's address.  Group-dumped
    with --kill mid-vectors and group-restored with the vendor plugin (examples/emulator-link,
    which reconnects to the address the link led to and LOAD_STATEs each testbench's own
    state): the vendor's barriers are met across the hosts, and each testbench ends with the
    signature of an uninterrupted run, every vector logged once, no cycle jump."""
    emulator = spawn(*hosts.inside("B"), sys.executable, str(FIXTURES_DIR / "emulator" / "emulator.py"), "--tcp",
                     f"{ADDR['B']}:0", "--per-connection", out=False)
    kind, host, port = emulator.preamble[0].split()[1:]
    assert (kind, host) == ("tcp", ADDR["B"]), emulator.describe()
    address = f"tcp:{ADDR['B']}:{port}"
    configs = {h: f"seed {seed}\ninit_steps 40\nvectors {EMU_VECTORS}\n" for h, seed in (("A", 11), ("B", 22))}
    # what an uninterrupted run gives (the sleeps do not change the signature)
    reference = {}
    for h in ADDR:
        ref, outfile, _ = _testbench(spawn, hosts, "A", testbench_bin, tmp_path, f"ref-{h}", address,
                                     configs[h] + "init_sleep_us 0\nvector_sleep_us 0\n")
        reference[h] = _signature(outfile, 30, ref)
    assert reference["A"] != reference["B"], "the two testbenches run different tests"

    plugin = tmp_path / "late_link.py"
    log = tmp_path / "link.log"
    plugin.write_text(LATE_LINK.format(vendor=str(Path(__file__).resolve().parent.parent / "examples" /
                                                  "emulator-link" / "ptckpt_emulator_link.py"), log=str(log)))
    benches = {h: _testbench(spawn, hosts, h, testbench_bin, tmp_path, f"bench-{h}", address,
                             configs[h] + "init_sleep_us 1000\nvector_sleep_us 2000\n") for h in ADDR}
    for h, (bench, _, slot) in benches.items():
        wait_until(lambda: "vector 100 " in (slot / "run.log").read_text(), 20,
                   message=lambda: f"testbench {h} at vector 100: {bench.describe()}")
    names = [f"{h}:{bench.pid}" for h, (bench, _, _) in benches.items()]
    image = tmp_path / "group"
    res = ptckpt("group", "dump", "-D", image, "--backend", hosts.backend, "--kill", "--plugin",
                 f"{plugin}:LateLink", *names, prefix=hosts.inside("A"), timeout=180)
    assert res.returncode == 0, res.stderr
    logged = {}
    for h, (bench, outfile, slot) in benches.items():
        assert bench.wait_exit(10) == -9
        logged[h] = (slot / "run.log").read_text()
        assert "SIGNATURE" not in outfile.read_text(), f"testbench {h} ended before the dump"
    _met(log, "frozen", names)
    assert emulator.alive(), "the emulator is no member: it runs on"

    res = ptckpt("group", "restore", "-D", image, "--backend", hosts.backend, "--plugin", f"{plugin}:LateLink",
                 prefix=hosts.inside("A"), timeout=180)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == names
    for bench, _, _ in benches.values():
        bench.adopt(bench.pid)
    _met(log, "restored", names)
    for h, (bench, outfile, slot) in benches.items():
        assert _signature(outfile, 30, bench) == reference[h], f"testbench {h} went on where it was"
        wait_until(lambda: "\ndone " in (slot / "run.log").read_text(), 10, message=f"testbench {h} to finish")
        text = (slot / "run.log").read_text()
        assert text.startswith(logged[h]) and len(text) > len(logged[h]), "its run.log went on"
        assert "cycle jump" not in text and "FAIL" not in outfile.read_text(), text[-2000:]
        vectors = [int(line.split()[1]) for line in text.splitlines() if line.startswith("vector ")]
        assert vectors == list(range(EMU_VECTORS)), f"testbench {h}: every vector once"
    assert emulator.alive()
    assert _events_left(hosts) == [], "each group clears the Dask events it made"

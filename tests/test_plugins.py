"""The plugin model: events in order with a barrier across a tree, data in the image, leader
election, external connections claimed and re-made, refusals."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader

from conftest import kill_pids, reap_orphans, wait_until
from test_restore import _dump_kill, _one_line

PLUGIN = str(Path(__file__).parent / "plugins" / "recorder.py")

TREE = r'''
import os, socket, sys, time
port = int(sys.argv[2])
conn = socket.create_connection(("127.0.0.1", port))
os.dup2(conn.fileno(), 9); conn.close()
pair = socket.socketpair()
kids = []
for i in range(2):
    pid = os.fork()
    if pid == 0:
        while True: time.sleep(0.05)
    kids.append(pid)
print("KIDS", *kids, flush=True)
print("READY", os.getpid(), flush=True)
while True:
    try:
        os.write(9, b"tick\n")
    except OSError:
        pass
    time.sleep(0.05)
'''


class Server:
    """A loopback TCP server counting the lines it receives, per connection."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections: list[list[bytes]] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            lines: list[bytes] = []
            self.connections.append(lines)
            threading.Thread(target=self._read, args=(c, lines), daemon=True).start()

    @staticmethod
    def _read(c, lines):
        with c:
            while data := c.recv(4096):
                lines.append(data)


def _tree_with_server(spawn, tmp_path):
    """A loopback server, and a tree of three whose root writes to it through fd 9 (which its
    children inherit): (server, root target, children pids)."""
    server = Server()
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    target = spawn(str(script), server.port)
    kids = [int(x) for x in next(l for l in target.preamble if l.startswith("KIDS")).split()[1:]]
    return server, target, kids


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_events_in_order_with_a_barrier_data_election_and_an_external_connection(spawn, ptckpt, tmp_path):
    server, target, kids = _tree_with_server(spawn, tmp_path)
    members = [target.pid] + kids
    log = tmp_path / "events.log"
    env = dict(os.environ, PTCKPT_TEST_LOG=str(log), PTCKPT_TEST_PORT=str(server.port))
    try:
        wait_until(lambda: server.connections and server.connections[0], 5)
        res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill", "--plugin", PLUGIN, env=env)
        assert res.returncode == 0, res.stderr
        target.wait_exit(10)
        for p in kids:
            wait_until(lambda: not os.path.exists(f"/proc/{p}"), 5)
        dumped = _events(log)
        order = [e["event"] for e in dumped]
        # the barrier: every process has its pre_dump before any frozen, and so on
        assert order == ["pre_dump"] * 3 + ["shared"] * order.count("shared") + ["frozen"] * 3 + \
               ["post_dump"] * 3, order
        assert [e["pid"] for e in dumped if e["event"] == "frozen"] == members
        assert all(e["regs"] and e["getpid"] == e["pid"] for e in dumped if e["event"] == "frozen")
        shared = [e for e in dumped if e["event"] == "shared"]
        assert any(e["holders"] == sorted(members) and e["what"].startswith("socket:[") for e in shared), \
            "the socketpair held by all three is offered once, with its holders"
        with ImageReader(tmp_path / "img") as image:
            assert [(d.name, d.version) for d in image.plugin_data if d.pid == -1] == [("recorder", "1.0")]
            assert {d.pid for d in image.plugin_data if d.key == "state"} == set(members)
            [ext] = [f for f in image.process(target.pid).fds if f.external]
            assert ext.fd == 9 and ext.external == "recorder: the test server"

        # an image made with a plugin needs it
        _one_line(ptckpt("restore", "-D", tmp_path / "img"), ExitCode.PLUGIN, "needs plugin recorder")

        log.unlink()
        res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--plugin", PLUGIN, env=env)
        assert res.returncode == 0, res.stderr
        restored = _events(log)
        order = [e["event"] for e in restored]
        assert order == ["pre_restore"] * 3 + ["restored"] * 3 + ["resumed"] * 3, order
        assert [e["data"] for e in restored if e["event"] == "pre_restore"] == \
               [f"state of {p}" for p in members]
        assert all(e["getpid"] == e["pid"] for e in restored if e["event"] == "restored")
        # the connection was made again at fd 9 (one per holder: the plugin's choice), and the
        # restored root, restored first, writes through its own
        wait_until(lambda: len(server.connections) == 4 and server.connections[1], 5,
                   message="the restored process writes to the new connection")
        assert os.readlink(f"/proc/{target.pid}/fd/9").startswith("socket:[")
    finally:
        kill_pids(members)
        reap_orphans()


def test_an_unclaimed_external_connection_is_refused_naming_it(spawn, ptckpt, tmp_path):
    server, target, kids = _tree_with_server(spawn, tmp_path)
    log = tmp_path / "events.log"
    env = dict(os.environ, PTCKPT_TEST_LOG=str(log), PTCKPT_TEST_PORT=str(server.port))
    silent = tmp_path / "silent.py"
    silent.write_text("from ptckpt.plugins import Plugin\nclass Recorder(Plugin):\n"
                      "    name = 'recorder'\n")
    try:
        assert ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill", "--plugin", PLUGIN,
                      env=env).returncode == 0
        target.wait_exit(10)
        res = ptckpt("restore", "-D", tmp_path / "img", "--plugin", str(silent), env=env)
        _one_line(res, ExitCode.PLUGIN, f"process {target.pid} fd 9", "is external",
                  "recorder: the test server", "no plugin claimed it")
    finally:
        kill_pids([target.pid] + kids)
        reap_orphans()


def test_plugin_load_errors_are_one_line(ptckpt, tmp_path):
    _one_line(ptckpt("dump", "1", "--plugin", "no_such_module_xyz:Plugin"), ExitCode.PLUGIN,
              "plugin no_such_module_xyz:Plugin: load", "ModuleNotFoundError")
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('vendor bug')\n")
    _one_line(ptckpt("dump", "1", "--plugin", str(bad)), ExitCode.PLUGIN, "vendor bug")


REMAP = r'''
import os, signal, sys, time
out, slot = sys.argv[1], sys.argv[2]
os.chdir(slot)
log = open(os.path.join(slot, "run.log"), "a")
import mmap
with open(os.path.join(slot, "table.bin"), "rb") as f:
    table = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
def later(*_):
    with open(os.path.join(slot, "later.txt")) as f:      # opened after the restore, by its old path
        open(out, "w").write(f.read() + "|" + os.getcwd() + "|" + os.readlink(f"/proc/self/fd/{log.fileno()}"))
signal.signal(signal.SIGUSR1, later)
print("READY", os.getpid(), flush=True)
while True: time.sleep(0.05)
'''


def test_remap_path_moves_fds_cwd_and_later_opens(spawn, ptckpt, tmp_path):
    slot3, slot7 = tmp_path / "slot3", tmp_path / "slot7"
    slot3.mkdir()
    (slot3 / "later.txt").write_text("three")
    (slot3 / "table.bin").write_bytes(b"T" * 8192)
    script = tmp_path / "remap.py"
    script.write_text(REMAP)
    target = spawn(str(script), slot3)
    try:
        _dump_kill(ptckpt, target, tmp_path / "img")
        _one_line(ptckpt("restore", "-D", tmp_path / "img", "--remap-path", f"{slot3}={slot7}"),
                  ExitCode.USAGE, str(slot7), "not a directory")
        slot7.mkdir()
        (slot7 / "run.log").write_text("")
        (slot7 / "later.txt").write_text("seven")
        shutil.copy(slot3 / "table.bin", slot7 / "table.bin")
        res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--remap-path", f"{slot3}={slot7}")
        assert res.returncode == 0, res.stderr
        target.signal(__import__("signal").SIGUSR1)
        wait_until(lambda: target.out_path.exists() and target.out_path.read_text(), 5)
        text, cwd, log = target.out_path.read_text().split("|")
        assert text == "seven", "a later open under the old path lands in the new one"
        assert log == str(slot7 / "run.log")
        assert os.readlink(f"/proc/{target.pid}/cwd") == str(slot7)
        assert f"{slot7}/table.bin" in open(f"/proc/{target.pid}/maps").read(), "the mapping, moved"
        assert (slot3 / "later.txt").read_text() == "three", "the host's view is unchanged"
    finally:
        kill_pids([target.pid])
        reap_orphans()


def test_external_tcp_connection_reconnected_to_the_same_or_a_remapped_address(spawn, ptckpt, tmp_path):
    other = Server()
    server, target, kids = _tree_with_server(spawn, tmp_path)
    try:
        wait_until(lambda: server.connections and server.connections[0], 5)
        res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill",
                     "--external", f"tcp:127.0.0.1:{server.port}")
        assert res.returncode == 0, res.stderr
        target.wait_exit(10)
        for p in kids:
            wait_until(lambda: not os.path.exists(f"/proc/{p}"), 5)
        with ImageReader(tmp_path / "img") as image:
            assert not image.plugin_data, "a built-in plugin is not required at restore"
            assert [f.external for f in image.process(target.pid).fds if f.external] == \
                   [f"tcp:127.0.0.1:{server.port}"]
        _one_line(ptckpt("restore", "-D", tmp_path / "img"), ExitCode.PLUGIN,
                  f"tcp:127.0.0.1:{server.port}", "no plugin claimed it")
        res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--remap-addr",
                     f"tcp:127.0.0.1:{server.port}=tcp:127.0.0.1:{other.port}")
        assert res.returncode == 0, res.stderr
        wait_until(lambda: other.connections and other.connections[0], 5,
                   message="the root writes to the remapped address")
        assert len(server.connections) == 1
    finally:
        kill_pids([target.pid] + kids)
        reap_orphans()


def test_plugin_from_an_entry_point(spawn, ptckpt, tmp_path):
    """A plugin a vendor ships as a package: found through the ptckpt.plugins entry point group."""
    site = tmp_path / "site"
    (site / "vendor_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "vendor_plugin-1.0.dist-info" / "METADATA").write_text("Name: vendor-plugin\nVersion: 1.0\n")
    (site / "vendor_plugin-1.0.dist-info" / "entry_points.txt").write_text(
        "[ptckpt.plugins]\nvendor = vendor_plugin:Vendor\n")
    (site / "vendor_plugin.py").write_text(
        "from ptckpt.plugins import Plugin\n"
        "class Vendor(Plugin):\n"
        "    name, version = 'vendor', '3'\n"
        "    def frozen(self, proc, ctx):\n"
        "        ctx.save(b'hello', key='k', pid=proc.vpid)\n")
    target = spawn("counter")
    env = dict(os.environ, PYTHONPATH=str(site))
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--plugin", "vendor", env=env)
    assert res.returncode == 0, res.stderr
    with ImageReader(tmp_path / "img") as image:
        assert [(d.name, d.version, d.key, d.data) for d in image.plugin_data] == \
               [("vendor", "3", "", b""), ("vendor", "3", "k", b"hello")]
    _one_line(ptckpt("dump", target.pid, "-D", tmp_path / "img2", "--plugin", "nonesuch"),
              ExitCode.PLUGIN, "no entry point 'nonesuch'")


def test_a_plugin_failing_halfway_leaves_the_target_running_or_nothing_behind(spawn, ptckpt, tmp_path):
    """A plugin that fails in `frozen` fails the dump: the target runs on, untraced, and no
    image is left.  One that fails in `restored` fails the restore: what was built is killed."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom ptckpt.plugins import Plugin\n"
                   "class Bad(Plugin):\n"
                   "    name = 'bad'\n"
                   "    def frozen(self, proc, ctx):\n"
                   "        if os.environ.get('FAIL') == 'frozen': raise RuntimeError('vendor bug at dump')\n"
                   "    def restored(self, proc, ctx):\n"
                   "        raise RuntimeError('vendor bug at restore')\n")
    target = spawn("counter")
    _one_line(ptckpt("dump", target.pid, "-D", tmp_path / "img", "--plugin", str(bad),
                     env=dict(os.environ, FAIL="frozen")),
              ExitCode.PLUGIN, "plugin bad: frozen", "vendor bug at dump")
    assert not (tmp_path / "img").exists()
    with open(f"/proc/{target.pid}/status") as f:
        assert "TracerPid:\t0" in f.read()
    target.wait_progress()
    _dump_kill(ptckpt, target, tmp_path / "img")
    _one_line(ptckpt("restore", "-D", tmp_path / "img", "--plugin", str(bad)), ExitCode.REMOTE_SYSCALL,
              "killed", "plugin bad: restored", "vendor bug at restore")
    reap_orphans()
    wait_until(lambda: not os.path.exists(f"/proc/{target.pid}"), 5, message="nothing left behind")


def test_a_plugin_that_says_busy_once_frozen_gets_the_tree_frozen_again(spawn, ptckpt, tmp_path):
    """A plugin whose program was frozen mid-transaction says so in `busy`: the dump thaws
    the tree, calls its pre_dump (its wait for a quiet moment) again and freezes it again,
    instead of failing; one that stays busy fails the dump after --critical-timeout, naming
    itself and why, and the target runs on untraced."""
    log = tmp_path / "events"
    plugin = tmp_path / "txn.py"
    plugin.write_text("import os\nfrom ptckpt.plugins import Plugin\n"
                      "class Txn(Plugin):\n"
                      "    name = 'txn'\n"
                      "    def pre_dump(self, proc, ctx):\n"
                      f"        open({str(log)!r}, 'a').write('pre_dump\\n')\n"
                      "    def busy(self, proc, ctx):\n"
                      f"        n = open({str(log)!r}).read().count('busy')\n"
                      f"        open({str(log)!r}, 'a').write('busy\\n')\n"
                      "        if n < int(os.environ['BUSY_TIMES']): return 'a transaction in flight'\n"
                      "    def frozen(self, proc, ctx):\n"
                      f"        open({str(log)!r}, 'a').write('frozen\\n')\n")
    target = spawn("counter")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--plugin", str(plugin),
                 env=dict(os.environ, BUSY_TIMES="2"))
    assert res.returncode == 0, res.stderr
    assert log.read_text().split() == ["pre_dump", "busy"] * 3 + ["frozen"]
    log.unlink()
    _one_line(ptckpt("dump", target.pid, "-D", tmp_path / "img2", "--plugin", str(plugin),
                     "--critical-timeout", "0.3", env=dict(os.environ, BUSY_TIMES="1000000")),
              ExitCode.PLUGIN, "plugin txn: busy", "a transaction in flight", "0.3 s")
    assert not (tmp_path / "img2").exists() and "frozen" not in log.read_text()
    with open(f"/proc/{target.pid}/status") as f:
        assert "TracerPid:\t0" in f.read()
    target.wait_progress()

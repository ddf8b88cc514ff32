"""dump --page-server and restore [--lazy] --page-server: the memory pages go to a
`ptckpt page-server` (on loopback TCP here) as they are read, never to the local disk, and
come back from it, all before the rebuild or block by block as the process touches them.

Every page server a test starts, every process it restores and every lazy page server
process (with its watchdog) is killed in a finaliser, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import kill_pids, kill_process_groups, pid_alive, reap_orphans, wait_pid_free, wait_until
from ptckpt.errors import ExitCode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def page_server(ptckpt_cmd, tmp_path):
    """start(extra_env=None) -> (address, token file, directory): `ptckpt page-server` on a
    loopback TCP port; killed at the end."""
    started: list[subprocess.Popen] = []
    token = tmp_path / "token"
    token.write_text(os.urandom(24).hex() + "\n")
    token.chmod(0o600)

    def start(extra_env: dict | None = None) -> tuple[str, Path, Path, subprocess.Popen]:
        n = len(started)
        port, directory = _free_port(), tmp_path / f"server{n}"
        with open(tmp_path / f"page-server{n}.log", "wb") as log:
            p = subprocess.Popen([*ptckpt_cmd, "page-server", "--listen", f"127.0.0.1:{port}", "-D", directory,
                                  "--token-file", token], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 start_new_session=True, env={**os.environ, **(extra_env or {})})
        started.append(p)

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        wait_until(listening, 20, message="the page server listens")
        return f"127.0.0.1:{port}", token, directory, p

    yield start
    kill_process_groups(started)
    reap_orphans()


@pytest.fixture
def lazy_servers():
    """The lazy page server processes (and watchdogs) restores made: killed at the end."""
    pids: list[int] = []
    logs: list[str] = []
    yield pids, logs
    kill_pids(pids)
    reap_orphans()
    for path in logs:
        Path(path).unlink(missing_ok=True)


def _streamed_dump(ptckpt, target, image: Path, address: str, token: Path, *extra) -> dict:
    res = ptckpt("dump", target.pid, "-D", image, "--kill", "--page-server", address, "--token-file", token,
                 "--json", *extra)
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    wait_pid_free(target.pid)
    return json.loads(res.stdout)


def _no_page_data_here(image: Path, pid: int) -> None:
    names = sorted(p.name for p in image.iterdir())
    assert f"pagemap-{pid}.img" in names and f"core-{pid}.img" in names, names
    assert not [n for n in names if n.startswith("pages-")], names


def _lazy_restore(ptckpt, image: Path, address: str, token: Path, servers, env: dict | None = None):
    pids, logs = servers
    res = ptckpt("restore", "-D", image, "--detach", "--lazy", "--json", "--page-server", address,
                 "--token-file", token, env={**os.environ, **(env or {})})
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    info = out["lazy"]
    assert info, f"nothing was left to a page server: {res.stderr}"
    pids.extend([info["server"], info["watchdog"]])
    logs.append(info["log"])
    return out["pid"], info


def _gone(pid: int, timeout: float = 60.0) -> None:
    wait_until(lambda: (reap_orphans(), not pid_alive(pid))[1], timeout, message=f"process {pid} ends")


def test_streamed_counter_is_restored_from_the_page_server_and_counts_on(spawn, ptckpt, page_server, tmp_path):
    """The dump writes no page data here (the page server holds it, a PAGES file like any
    image's); a restore without --page-server is refused naming the server; with it, the
    counter goes on from its value."""
    address, token, received, _p = page_server()
    target = spawn("counter")
    target.wait_progress()
    image = tmp_path / "img"
    out = _streamed_dump(ptckpt, target, image, address, token)
    at_dump = target.read_counter()
    _no_page_data_here(image, target.pid)
    assert out["page_server"]["address"] == address
    there = received / out["page_server"]["pages"] / f"pages-{target.pid}.img"
    assert there.stat().st_size > 4096 and there.read_bytes()[:4] == b"PTCK"
    assert there.stat().st_mode & 0o077 == 0

    for show in (("show", image, "--summary"), ("check", "--image", image)):
        res = ptckpt(*show)                               # the records are all here
        assert res.returncode == 0, res.stderr
    res = ptckpt("restore", "-D", image, "--detach")
    assert res.returncode == ExitCode.USAGE, res.stderr
    assert address in res.stderr and "--page-server" in res.stderr and len(res.stderr.strip().splitlines()) == 1

    res = ptckpt("restore", "-D", image, "--detach", "--page-server", address, "--token-file", token)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.strip().splitlines()[-1]) == target.pid
    wait_until(lambda: target.read_counter() > at_dump + 20, 10, message="the counter goes on")
    assert target.read_counter() > at_dump
    target.assert_ok()
    _no_page_data_here(image, target.pid)


def test_counter_lazily_restored_over_the_network(spawn, ptckpt, page_server, tmp_path, lazy_servers):
    address, token, _received, _p = page_server()
    target = spawn("counter")
    target.wait_progress()
    image = tmp_path / "img"
    _streamed_dump(ptckpt, target, image, address, token)
    at_dump = target.read_counter()
    pid, info = _lazy_restore(ptckpt, image, address, token, lazy_servers)
    assert pid == target.pid and info["bytes"] > 0
    wait_until(lambda: target.read_counter() > at_dump + 20, 10, message="the counter goes on")
    _gone(info["server"])
    assert "all pages in" in Path(info["log"]).read_text()
    target.assert_ok()
    _no_page_data_here(image, target.pid)


def test_one_gib_heap_lazily_restored_over_the_network(spawn, ptckpt, page_server, tmp_path, lazy_servers):
    """1 GiB of heap streamed to the page server and taken back on demand: the pattern is
    intact when read at once (faults served over the network), and again once every page
    is in and the lazy server has left."""
    address, token, _received, _p = page_server()
    target = spawn("bigheap", 1024)
    image = tmp_path / "img"
    out = _streamed_dump(ptckpt, target, image, address, token)
    assert out["bytes"] >= 1 << 30
    _no_page_data_here(image, target.pid)
    pid, info = _lazy_restore(ptckpt, image, address, token, lazy_servers)
    assert pid == target.pid and info["bytes"] >= 1 << 30
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK", timeout=120)
    _gone(info["server"], 120)
    text = Path(info["log"]).read_text()
    assert "all pages in" in text and "1024 MiB" in text, text
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 2 OK", timeout=60)
    target.assert_ok()


def test_wrong_token_and_no_server_are_refused_and_the_process_runs_on(spawn, ptckpt, page_server, tmp_path,
                                                                       lazy_servers):
    """A wrong token and an address nobody listens at: the dump says so in one line (exit
    24) before touching the process, which runs on; no image is made.  A restore too."""
    address, token, _received, _p = page_server()
    wrong = tmp_path / "wrong"
    wrong.write_text("x" * 32)
    target = spawn("counter")
    target.wait_progress()
    nobody = f"127.0.0.1:{_free_port()}"
    for to, key, words in ((address, wrong, "refused the token"), (nobody, token, "no page server at")):
        res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill", "--page-server", to, "--token-file", key)
        assert res.returncode == ExitCode.TRANSFER and words in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
        assert not (tmp_path / "img").exists()
        assert target.alive()
    target.wait_progress()
    image = tmp_path / "good"
    _streamed_dump(ptckpt, target, image, address, token)
    for to, key, words in ((address, wrong, "refused the token"), (nobody, token, "no page server at")):
        for lazy in ((), ("--lazy",)):
            res = ptckpt("restore", "-D", image, "--detach", *lazy, "--page-server", to, "--token-file", key)
            assert res.returncode == ExitCode.TRANSFER and words in res.stderr, res.stderr
            assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
            assert not pid_alive(target.pid)


def test_page_server_gone_mid_dump_leaves_the_process_running_and_no_image(spawn, ptckpt, page_server, tmp_path):
    address, token, received, _p = page_server({"PTCKPT_TEST_DIE_AT": "page-server-write:3"})
    target = spawn("bigheap", 64)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill", "--page-server", address,
                 "--token-file", token)
    assert res.returncode == ExitCode.TRANSFER, res.stderr
    assert "connection" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "img").exists() and not list(tmp_path.glob(".img.tmp-*"))
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK", timeout=30)       # ran on, its memory as it was
    target.assert_ok()


def test_page_server_gone_mid_lazy_restore_kills_the_process_and_says_why(spawn, ptckpt, page_server, tmp_path,
                                                                          lazy_servers):
    address, token, _received, server = page_server()
    target = spawn("bigheap", 32)
    image = tmp_path / "img"
    _streamed_dump(ptckpt, target, image, address, token)
    pid, info = _lazy_restore(ptckpt, image, address, token, lazy_servers, {"PTCKPT_TEST_LAZY_PACE": "0.1"})
    kill_process_groups([server])                         # while pages are still to come
    _gone(pid, 60)
    _gone(info["server"])
    text = Path(info["log"]).read_text()
    assert "page server went away" in text and f"killed {pid}" in text, text


def test_readme_page_server_example_runs_as_written_and_again(tmp_path):
    """README's example (Memory pages on a page server, not on disk), as written, twice: no
    page data in the image directory, the pages at the page server, and the counter lazily
    restored counts on.  What it leaves running is ended in any case."""
    from conftest import require
    from test_readme import blocks_under, run_block
    require("gcc")
    block, = [code for _, code in blocks_under("### Memory pages on a page server, not on disk")]
    for run in ("first", "again"):
        status, out = run_block(block, tmp_path / f"{run}.out", 120)
        assert status == 0 and "Traceback" not in out, f"README example ({run} run) exited {status}:\n{out}"
        meta = sorted(os.listdir("/tmp/meta"))
        assert "inventory.img" in meta and not [n for n in meta if n.startswith("pages-")], meta
        assert any(n.startswith("pagemap-") for n in meta), meta
        assert list(Path("/tmp/ps-in/pages").glob("*/pages-*.img")), out
        assert "restored pid" in out and "stopped" in out, out


def test_page_server_keeps_only_what_a_dump_sealed(page_server):
    """What a connection wrote without sealing it is removed when it ends (a dump that
    failed, or was killed); what it sealed stays, and reads back the same."""
    from ptckpt.pagestream import PageServerSink, RemoteSource
    address, token, received, _p = page_server()
    key = token.read_bytes().strip()
    data = os.urandom(3 * 4096)
    for seal in (False, True):
        sink = PageServerSink(address, key)
        sink.image_id = f"probe-{seal}"
        sink.pwrite("pages-1.img", data, 4096)
        if seal:
            sink.seal()
        else:
            sink.abort()
        there = received / "pages" / sink.image_id / "pages-1.img"
        if seal:
            assert there.read_bytes()[4096:] == data
            source = RemoteSource(address, key, lazy=True)
            back = bytearray(len(data))
            source.read_into(f"pages/{sink.image_id}/pages-1.img", 4096, memoryview(back))
            source.close()
            assert bytes(back) == data
        else:
            wait_until(lambda: not there.exists(), 10, message="the unsealed stream is removed")


def test_streamed_background_dump_restores_whole(spawn, ptckpt, page_server, tmp_path, lazy_servers):
    """A leave-running dump of more than 64 MiB copies the memory while the process runs,
    then the pages written meanwhile: streamed, both go to the page server; the process
    runs on, and a lazy restore of the image (once it is killed) has its whole pattern."""
    address, token, _received, _p = page_server()
    target = spawn("bigheap", 96)
    image = tmp_path / "img"
    res = ptckpt("dump", target.pid, "-D", image, "--page-server", address, "--token-file", token, "-v")
    assert res.returncode == 0, res.stderr
    assert "while it runs" in res.stderr, res.stderr          # the background copy was made
    _no_page_data_here(image, target.pid)
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK", timeout=30)
    target.kill()
    wait_pid_free(target.pid)
    pid, info = _lazy_restore(ptckpt, image, address, token, lazy_servers)
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK", count=2, timeout=60)
    _gone(info["server"])
    assert "all pages in" in Path(info["log"]).read_text()


def test_forked_tree_lazily_restored_over_the_network(spawn, ptckpt, page_server, tmp_path, lazy_servers):
    """A forked tree streamed and restored lazily over the network: the pages the children
    share with their parent come from the page server before the children are made (the
    parent's memory first), the rest on demand; the parent sees its workers count on."""
    from test_lazy import _totals
    address, token, _received, _p = page_server()
    server = spawn("forkserver")
    workers = [int(line.split()[2]) for line in server.preamble if line.startswith("WORKER")]
    wait_until(lambda: _totals(server)[0] > 100, 5)
    try:
        image = tmp_path / "img"
        _streamed_dump(ptckpt, server, image, address, token)
        for p in workers:
            wait_pid_free(p)
        _no_page_data_here(image, server.pid)
        pid, info = _lazy_restore(ptckpt, image, address, token, lazy_servers)
        at_restore = _totals(server)
        wait_until(lambda: all(t > a + 300 for t, a in zip(_totals(server), at_restore)), 20,
                   message="the parent sees the workers count on")
        _gone(info["server"])
        assert "all pages in" in Path(info["log"]).read_text()
        server.assert_ok()
    finally:
        kill_pids([server.pid] + workers)
        reap_orphans()


def test_waiting_lazy_restore_says_the_page_server_went_away(spawn, ptckpt_cmd, page_server, ptckpt, tmp_path,
                                                            lazy_servers):
    """Without --detach ptckpt waits for the restored process; when the page server goes
    away before every page is in, the process is killed, and ptckpt exits 137 with one
    last line saying why (no traceback)."""
    import re
    address, token, _received, server = page_server()
    target = spawn("bigheap", 32)
    image = tmp_path / "img"
    _streamed_dump(ptckpt, target, image, address, token)
    err = tmp_path / "restore.err"
    with open(err, "wb") as f:
        proc = subprocess.Popen([*ptckpt_cmd, "restore", "-D", image, "--lazy", "--page-server", address,
                                 "--token-file", token], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=f, env={**os.environ, "PTCKPT_TEST_LAZY_PACE": "0.1"}, start_new_session=True)
    try:
        m = wait_until(lambda: re.search(r"page server (\d+) \(watchdog (\d+), log (\S+)\)", err.read_text()), 30,
                       message="the restored process runs")
        lazy_servers[0].extend([int(m.group(1)), int(m.group(2))])
        lazy_servers[1].append(m.group(3))
        kill_process_groups([server])
        assert proc.wait(60) == 128 + signal.SIGKILL, err.read_text()
        text = err.read_text()
        last = text.strip().splitlines()[-1]
        assert last.startswith("ptckpt: lazy restore: the page server went away") and "killed" in last, text
        assert "Traceback" not in text
    finally:
        kill_process_groups([proc])

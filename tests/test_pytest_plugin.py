"""The pytest plugin (ptckpt.pytest_plugin, entry point pytest11): a user's test suite,
run by pytester in its own interpreter, sets a program up once, and each of its tests
gets a fresh restore of that checkpoint; the next run of the suite takes the image from
pytest's cache, and --ptckpt-refresh builds it again."""

from __future__ import annotations

import os
import textwrap

import pytest

from conftest import kill_pids, reap_orphans

pytest_plugins = ("pytester",)

PROGRAM = textwrap.dedent(r"""
    import os, signal, sys, time
    log, marker = sys.argv[1], sys.argv[2]
    with open(marker, "a") as f:
        f.write("setup\n")                     # the expensive part: once per image
    time.sleep(0.2)
    count = 0

    def bump(*_):
        global count
        count += 1
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {count}\n")

    signal.signal(signal.SIGUSR1, bump)
    open(marker + ".ready", "w").close()
    while True:
        signal.pause()
""")

SUITE = textwrap.dedent(r"""
    import os, signal, subprocess, sys, time
    import pytest

    PROGRAM, LOG, MARKER, PIDS = (os.environ[k] for k in ("PROGRAM", "LOG", "MARKER", "PIDS"))

    def wait_for(cond):
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def lines():
        with open(LOG) as f:
            return f.read().splitlines()

    @pytest.fixture(scope="session")
    def booted(ptckpt_image):
        def start():
            if os.path.exists(MARKER + ".ready"):
                os.unlink(MARKER + ".ready")           # an earlier build's
            return subprocess.Popen([sys.executable, PROGRAM, LOG, MARKER], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        return ptckpt_image("counter-v1", start, ready=lambda pid: wait_for(
            lambda: os.path.exists(MARKER + ".ready")))

    @pytest.fixture
    def prog(booted, ptckpt_restored):
        tree = ptckpt_restored(booted)
        with open(PIDS, "a") as f:
            f.write(f"{tree.init_pid} {tree.pid}\n")
        return tree

    @pytest.mark.parametrize("copy", range(3))
    def test_each_test_gets_a_fresh_copy(prog, copy):
        assert prog.init_pid and prog.alive()      # its own pid namespace
        open(LOG, "a").close()
        seen = len(lines())
        for n in (1, 2):
            prog.signal(signal.SIGUSR1)
            wait_for(lambda: len(lines()) >= seen + n)
        assert lines()[seen:] == [f"{prog.vpid} 1", f"{prog.vpid} 2"]   # counting from the checkpoint
""")


@pytest.fixture
def suite(pytester, tmp_path):
    """The user's suite and its program; every tree its runs restored is killed at the end."""
    files = {k: tmp_path / v for k, v in (("PROGRAM", "program.py"), ("LOG", "log"), ("MARKER", "marker"),
                                          ("PIDS", "pids"))}
    files["PROGRAM"].write_text(PROGRAM)
    for k, v in files.items():
        pytester._monkeypatch.setenv(k, str(v))
    pytester.makepyfile(test_user=SUITE)
    yield files
    if files["PIDS"].exists():
        kill_pids(int(p) for p in files["PIDS"].read_text().split())
    reap_orphans()


def test_a_suite_sets_up_once_and_each_test_gets_a_fresh_restore(pytester, suite):
    def setups() -> int:
        return suite["MARKER"].read_text().count("setup")

    first = pytester.runpytest_subprocess("-q")
    first.assert_outcomes(passed=3)
    assert setups() == 1
    assert len(suite["PIDS"].read_text().split()) == 6            # three copies, each with its init
    again = pytester.runpytest_subprocess("-q")                 # the image comes from the cache
    again.assert_outcomes(passed=3)
    assert setups() == 1
    cached = list((pytester.path / ".pytest_cache" / "d" / "ptckpt" / "counter-v1").iterdir())
    assert any(p.name == "inventory.img" for p in cached)
    assert all(p.stat().st_mode & 0o077 == 0 for p in cached)   # memory secrets: 0600
    fresh = pytester.runpytest_subprocess("-q", "--ptckpt-refresh")
    fresh.assert_outcomes(passed=3)
    assert setups() == 2
    for pid in map(int, suite["PIDS"].read_text().split()):
        assert not os.path.exists(f"/proc/{pid}/status") or "zombie" in open(f"/proc/{pid}/status").read()

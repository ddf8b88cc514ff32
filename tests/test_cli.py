"""The CLI surface: --version, help with examples, `ptckpt check`, and exit codes of bad usage."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
import re

import pytest

from ptckpt import __version__
from ptckpt.errors import ExitCode


def test_version(ptckpt):
    res = ptckpt("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"ptckpt {__version__}"


@pytest.mark.parametrize("command", ["dump", "restore", "show", "check"])
def test_every_command_has_help_with_an_example(ptckpt, command):
    res = ptckpt(command, "--help")
    assert res.returncode == 0, res.stderr
    assert "Example: ptckpt " + command in " ".join(res.stdout.split())


def test_check_lists_features_and_passes_here(ptckpt):
    res = ptckpt("check")
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("ptrace seize", "PTRACE_GET_RSEQ_CONFIGURATION", "clone3 set_tid", "pid namespaces",
                 "pidfd_getfd", "PR_SET_MM_MAP", "userfaultfd", "soft-dirty", "CAP_SYS_RESOURCE"):
        assert name in res.stdout, name
    data = json.loads(ptckpt("check", "--json").stdout)
    by_name = {c["name"]: c for c in data}
    assert by_name["clone3 set_tid"]["present"] and by_name["clone3 set_tid"]["required"]
    # DESIGN.md: soft-dirty is compiled out and CAP_SYS_RESOURCE is missing on these machines.
    assert not by_name["soft-dirty"]["present"] and by_name["soft-dirty"]["cost"]
    # what the features serve is named; soft-dirty is not needed (userfaultfd write-protection is used)
    assert "--track-mem" in by_name["userfaultfd"]["detail"]
    assert by_name["userfaultfd events"]["present"] and "--lazy" in by_name["userfaultfd events"]["detail"]
    assert "not in ptckpt yet" not in res.stdout
    assert all(c["present"] for c in data if c["required"])


@pytest.mark.parametrize("argv,words", [
    (("dump", "not-a-pid"), ("'not-a-pid' is not a valid integer", "ptckpt dump --help")),
    (("dump", "1", "--bogus"), ("No such option: --bogus",)),
    (("restore",), ("Missing option '-D'",)),
    (("frob",), ("No such command 'frob'",)),
])
def test_bad_usage_is_one_line_and_exit_2(ptckpt, argv, words):
    res = ptckpt(*argv)
    assert res.returncode == ExitCode.USAGE
    assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith("ptckpt: error: "), res.stderr
    for w in words:
        assert w in res.stderr


def test_short_options_and_verbose_after_the_command(ptckpt, tmp_path):
    assert ptckpt("-V").stdout.strip() == ptckpt("--version").stdout.strip()
    assert "Usage: ptckpt dump" in ptckpt("dump", "-h").stdout
    res = ptckpt("restore", "-D", tmp_path / "none", "-v")         # -v after the command
    assert res.returncode == ExitCode.NOT_AN_IMAGE
    assert res.stderr.splitlines()[0] == f"ptckpt: collect {tmp_path / 'none'}", res.stderr
    from ptckpt.cli import hoist_verbose
    assert hoist_verbose(["run", "-v", "--", "cmd", "-v"]) == ["--verbose", "run", "--", "cmd", "-v"]
    assert hoist_verbose(["run", "--", "cmd", "-v"]) == ["run", "--", "cmd", "-v"]
    assert hoist_verbose(["dump", "1", "-q"]) == ["--quiet", "dump", "1"]


def test_quiet_prints_the_result_only(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "-q")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [str(tmp_path / "img")] and res.stderr == ""


def test_quiet_and_verbose_together_are_refused(ptckpt, tmp_path):
    """Issue 37: `dump PID -q -v` ignored -q; the pair is refused now, before anything is done."""
    for argv in (("dump", "1", "-D", tmp_path / "img", "-q", "-v"), ("-v", "restore", "-D", tmp_path, "-q")):
        res = ptckpt(*argv)
        assert res.returncode == ExitCode.USAGE and res.stdout == "", res.stdout + res.stderr
        assert res.stderr.startswith("ptckpt: error: ") and "-q" in res.stderr and "-v" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "img").exists()


def test_results_go_to_stdout_and_summaries_to_stderr(spawn, ptckpt, tmp_path):
    """Issue 37: dump printed its summary on stdout, restore its "restored pid" line on
    stderr; now every command gives its result on stdout (the directory, the pid) and says
    what it did on stderr, which -q leaves out."""
    from conftest import wait_pid_free
    target = spawn("counter")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [str(tmp_path / "img")], res.stdout
    assert res.stderr.startswith(f"dumped {target.pid} to {tmp_path / 'img'}: "), res.stderr
    target.wait_exit(10)
    wait_pid_free(target.pid)
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [str(target.pid)], res.stdout
    assert res.stderr.startswith(f"restored pid {target.pid} as {target.pid} in "), res.stderr
    target.adopt(target.pid)
    target.wait_progress()
    res = ptckpt("stop", target.pid)
    assert res.returncode == 0 and res.stdout == "" and res.stderr.startswith(f"stopped {target.pid}: "), res


def test_help_names_arguments_and_types_plainly(ptckpt):
    """The typer pinned in pyproject.toml renders PID / INTEGER / TEXT and flag pairs
    without a type (later ones show {pid}, <int>, <bool>)."""
    res = ptckpt("dump", "--help")
    assert res.returncode == 0
    assert "Usage: ptckpt dump [OPTIONS] PID" in res.stdout
    assert "INTEGER" in res.stdout and "Process to checkpoint" in res.stdout
    assert "<bool>" not in res.stdout and "<int>" not in res.stdout


COMMANDS = ("dump", "pre-dump", "restore", "campaign", "run", "control", "compact", "show", "stop", "page-server",
            "push", "migrate", "core", "diff", "check")


def _help80(ptckpt_cmd, *argv: str) -> str:
    res = subprocess.run(ptckpt_cmd + [*argv, "-h"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, COLUMNS="80", TERM="dumb"))
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_help_at_80_columns_names_extras_and_fault_forms(ptckpt_cmd):
    """Issue 37: campaign's help said "(pip install 'ptckpt')" (rich took [cluster] for
    markup), and restore's did not show the call: faults README documents."""
    campaign = " ".join(_help80(ptckpt_cmd, "campaign").replace("│", " ").split())
    assert "pip install 'ptckpt[cluster]'" in campaign, campaign
    restore = " ".join(_help80(ptckpt_cmd, "restore").replace("│", " ").split())
    for form in ("flip:symbol=NAME[+OFF],bits=N[,size=B]", "flip:addr=A,bits=N[,size=B]",
                 "set:symbol=NAME,value=V[,size=B]", "reg:name=REG,value=V", "reg:name=REG,bits=N[,tid=T]",
                 "call:function=F,n=N,arg=I,value=V", "call:function=F,n=N,ret=V",
                 "call:function=F,n=N,flip=SYMBOL,bits=B"):
        assert form in restore, form
    assert "…" not in _help80(ptckpt_cmd, "restore"), "a form cut short"


@pytest.mark.parametrize("argv", [()] + [(c,) for c in COMMANDS])
def test_help_at_80_columns_wraps_descriptions_where_the_width_ends(ptckpt_cmd, argv):
    """Issue 37: docstrings wrapped in the source kept their line breaks, so at 80 columns
    a line of a paragraph could end after one word ("as").  Every line of a description
    but a paragraph's last runs on to near the width; so do those of the command list."""
    shown = _help80(ptckpt_cmd, *argv)
    text, _, boxes = shown.partition("╭")
    paragraphs = re.split(r"\n[ \t]*\n", "\n".join(line.rstrip() for line in text.splitlines()))
    for paragraph in paragraphs:
        lines = [line for line in paragraph.splitlines() if line.strip()]
        for line in lines[:-1]:
            assert len(line) >= 60, (line, paragraph)
    if not argv:                                # the command list: entries wrap at the width too
        rows = [line[1:-1].rstrip() for line in boxes.splitlines() if line.startswith("│")]
        for row, after in zip(rows, rows[1:]):
            if after.startswith("  ") and after[:14].strip() == "":     # the entry goes on below
                assert len(row) >= 60, (row, after)


def test_show_of_a_non_image(ptckpt, tmp_path):
    res = ptckpt("show", tmp_path / "nothing")
    assert res.returncode == ExitCode.NOT_AN_IMAGE, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_check_probe_pid_wraps_below_pid_max():
    from ptckpt.check import free_pid_after
    assert free_pid_after(1000, 32768, lambda p: False) == 1500
    assert free_pid_after(32600, 32768, lambda p: False) == 300 + (33100 - 32768)
    assert free_pid_after(1000, 32768, lambda p: p < 1503) == 1503
    assert free_pid_after(32767, 32768, lambda p: False) < 32768


def test_dump_and_restore_print_json(spawn, ptckpt, tmp_path):
    from conftest import wait_pid_free
    target = spawn("counter")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill", "--json")
    assert res.returncode == 0, res.stderr
    dumped = json.loads(res.stdout)
    assert dumped["directory"] == str(tmp_path / "img") and dumped["pids"] == [target.pid]
    assert dumped["threads"] == 1 and dumped["pages"] > 0 and dumped["bytes"] == dumped["pages"] * 4096
    assert 0 < dumped["frozen_seconds"] <= dumped["seconds"]
    target.wait_exit(10)
    wait_pid_free(target.pid)
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--json")
    assert res.returncode == 0, res.stderr
    restored = json.loads(res.stdout)
    assert restored["pid"] == restored["vpid"] == target.pid and restored["init_pid"] == 0
    assert restored["pids"] == {str(target.pid): target.pid} and restored["warnings"] == []
    target.adopt(target.pid)
    target.wait_progress()


def test_dump_summary_speaks_in_human_units(spawn, ptckpt, tmp_path):
    """'1 thread', not '1 threads'; the page data's size in KiB/MiB/GiB, not raw bytes."""
    target = spawn("counter")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [str(tmp_path / "img")], "the result on stdout, the summary on stderr"
    summary = res.stderr.strip().splitlines()[-1]
    assert re.search(r": 1 thread, \d+ VMAs, \d+ pages \([\d.]+ (KiB|MiB)\), [\d.]+ s \(frozen [\d.]+ s\)$",
                     summary), summary
    target.assert_ok()


def test_shell_completion_script_completes_commands_and_options(ptckpt_cmd, tmp_path):
    """The script `--show-completion bash` prints, sourced in a real bash, completes a
    command and an option of it."""
    script = subprocess.run(ptckpt_cmd + ["--show-completion", "bash"], capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "complete " in script.stdout, script.stderr
    (tmp_path / "completion.bash").write_text(script.stdout)
    env = dict(os.environ, PATH=f"{Path(ptckpt_cmd[0]).parent}:{os.environ['PATH']}")

    def complete(*words: str) -> list[str]:
        line = " ".join(words)
        res = subprocess.run(["bash", "--norc", "-c", f'source {tmp_path / "completion.bash"}; '
                              f'COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _ptckpt_completion ptckpt; '
                              'printf "%s\\n" "${COMPREPLY[@]}"'],
                             capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        return res.stdout.split()

    assert complete("ptckpt", "res") == ["restore"]
    assert "--remap-path" in complete("ptckpt", "restore", "--rem")
    assert set(complete("ptckpt", "pre")) == {"pre-dump"}


@pytest.mark.parametrize("shell,marks", [
    ("bash", ("complete -o default -F _ptckpt_completion ptckpt",)),
    ("zsh", ("#compdef ptckpt", "compdef _ptckpt_completion ptckpt")),
    ("fish", ("complete --command ptckpt", "complete_fish")),
    ("powershell", ("Register-ArgumentCompleter", "complete_powershell")),
])
def test_show_completion_prints_the_script_of_the_shell_named(ptckpt, shell, marks):
    """Issue 37: `--show-completion zsh` printed bash's script and `--show-completion=zsh`
    was refused; each shell gets its own, in either spelling."""
    for argv in (("--show-completion", shell), (f"--show-completion={shell}",)):
        res = ptckpt(*argv)
        assert res.returncode == 0, res.stderr
        for mark in marks:
            assert mark in res.stdout, (argv, res.stdout[:300])
    res = ptckpt("--show-completion", "tcsh")
    assert res.returncode == ExitCode.USAGE and "bash, zsh, fish" in res.stderr, res.stderr


def test_install_completion_says_where_on_stderr(ptckpt, tmp_path):
    """Issue 37: results on stdout, what is said about them on stderr, for every command:
    `--install-completion` printed its "installed in" line on stdout."""
    res = ptckpt("--install-completion", "bash", env=dict(os.environ, HOME=str(tmp_path)))
    assert res.returncode == 0 and res.stdout == "", res
    assert res.stderr.startswith("bash completion installed in "), res.stderr
    path = res.stderr.split(" installed in ", 1)[1].split(" (")[0]
    assert os.path.isfile(path) and path.startswith(str(tmp_path)), path


def _on_terminal(ptckpt_cmd, *args: str, env=None) -> str:
    """What `ptckpt ARGS` draws on a terminal (script(1) gives it one), escapes and all."""
    import shlex
    res = subprocess.run(["script", "-qec", shlex.join(ptckpt_cmd + list(args)), "/dev/null"],
                         stdin=subprocess.DEVNULL, capture_output=True, timeout=300, env=env)
    shown = res.stdout.decode(errors="replace")
    assert res.returncode == 0, shown
    return shown


# One frame of the bar: "dump copy ━━━━━  42% 0.4/1.0 GiB 280.1 MiB/s 0:00:02"
_FRAME = re.compile(r"(?P<what>dump|restore) (?P<phase>\w+) [━╸╺ ]*\s+(?P<pct>\d+)% "
                    r"(?P<done>[\d.]+)/(?P<total>[\d.]+) (?P<unit>\S+)(?: (?P<rate>[\d.]+) (?P<per>\S+)/s)?")


def _frames(shown: str) -> list[re.Match]:
    frames = re.split(r"\x1b\[2K|\r|\n", shown)         # rich redraws the line: one frame each
    return [m for f in frames if (m := _FRAME.search(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", f)))]


def test_a_dump_and_a_restore_show_a_progress_bar_on_a_terminal(spawn, ptckpt_cmd, tmp_path):
    """On a terminal a dump and a restore that move memory for long enough (here: at once,
    PTCKPT_PROGRESS_AFTER=0) show a bar with the bytes, which is gone again before the result
    line; -q shows none, and neither does a stderr that is no terminal."""
    target = spawn("bigheap", 64)
    env = dict(os.environ, PTCKPT_PROGRESS_AFTER="0")
    quiet = _on_terminal(ptckpt_cmd, "-q", "dump", str(target.pid), "-D", str(tmp_path / "quiet"), env=env)
    assert "MiB" not in quiet and "\x1b[" not in quiet, quiet
    shown = _on_terminal(ptckpt_cmd, "dump", str(target.pid), "-D", str(tmp_path / "img"), "--kill", env=env)
    assert re.search(r"dump .*\d+\.\d/\d+\.\d MiB", shown), shown
    bar_end = [m.end() for m in re.finditer(r"\d+\.\d/\d+\.\d MiB", shown)][-1]
    assert bar_end < shown.index("dumped "), "the bar goes before the summary"
    target.wait_exit(10)
    plain = subprocess.run(ptckpt_cmd + ["restore", "-D", str(tmp_path / "img"), "--detach"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert plain.returncode == 0 and "\x1b[" not in plain.stderr, plain.stderr
    target.adopt(int(plain.stdout.split()[-1]))


def test_the_progress_bar_names_the_phase_and_speaks_one_unit_family(spawn, ptckpt_cmd, tmp_path):
    """Issue 37: a dump of a few hundred MiB shows the phase (copy), a percentage, and bytes
    and rate both in binary units (MiB and MiB/s, never MB/s); a compressed one (over half
    a second: the default threshold shows it) too, and its restore (phases read, then
    rebuild) moves in several steps, not 0 then 100%."""
    target = spawn("bigheap", 384)
    env = {k: v for k, v in os.environ.items() if k != "PTCKPT_PROGRESS_AFTER"}
    shown = _on_terminal(ptckpt_cmd, "dump", str(target.pid), "-D", str(tmp_path / "plain"),
                         env=dict(env, PTCKPT_PROGRESS_AFTER="0"))
    frames = _frames(shown)
    assert frames, shown
    assert {f["phase"] for f in frames} <= {"freeze", "copy", "write"} and "copy" in {f["phase"] for f in frames}
    for f in frames:
        assert f["unit"] in ("KiB", "MiB", "GiB") and (f["per"] is None or f["per"] in ("KiB", "MiB", "GiB")), f[0]
    assert " MB/s" not in shown and " GB/s" not in shown, shown
    shown = _on_terminal(ptckpt_cmd, "dump", str(target.pid), "-D", str(tmp_path / "zstd"), "--kill",
                         "--compress", "zstd:10", env=env)
    frames = _frames(shown)
    assert frames and "copy" in {f["phase"] for f in frames}, shown
    assert any(f["per"] for f in frames) and " MB/s" not in shown, shown
    target.wait_exit(10)
    shown = _on_terminal(ptckpt_cmd, "restore", "-D", str(tmp_path / "zstd"), "--detach",
                         env=dict(env, PTCKPT_PROGRESS_AFTER="0"))
    target.adopt(int(shown.split()[-1]))
    frames = _frames(shown)
    assert {"read", "rebuild"} <= {f["phase"] for f in frames}, shown
    # how often the bar redraws depends on the machine's load; what the library reports does
    # not: the read phase of a compressed image moves frame by frame, not 0 then all at once
    events = _progress_events(lambda: _api_restore_killed(tmp_path / "zstd", target))
    read = [n for ph, kind, n in events if ph == "read" and kind == "moved"]
    expected = sum(n for ph, kind, n in events if ph == "read" and kind == "expect")
    assert len(read) >= 10 and 0 < read[0] < expected and sum(read) == expected, (len(read), expected)


class _Recorder:
    """A progress sink that keeps what the library says: (phase, "expect"|"moved", bytes)."""

    def __init__(self):
        self.now, self.events = "", []

    def phase(self, name):
        self.now = name

    def expect(self, n):
        self.events.append((self.now, "expect", n))

    def moved(self, n):
        self.events.append((self.now, "moved", n))

    def close(self):
        pass


def _progress_events(work) -> list:
    from ptckpt import progress
    rec = _Recorder()
    with progress.showing(rec):
        work()
    return rec.events


def _api_restore_killed(image, target) -> None:
    """Restore `image` in-process (a fresh pid namespace: the CLI's copy runs on), then kill it."""
    import ptckpt
    tree = ptckpt.restore(str(image), pidns=True)
    try:
        assert tree.alive()
    finally:
        tree.kill()
        tree.wait(timeout=10)

"""ptckpt.resources.filepolicy: build-ids, file identities and changes, policies, path patterns.

Real files throughout: small C programs compiled into a temporary directory
(with and without a build-id), the system's python3 and libc, non-ELF and
odd files (FIFO, directory, device, truncated ELF).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ptckpt.errors import ExitCode
from ptckpt.resources.filepolicy import (
    Action, FileIdentity, FilePolicy, FilesChanged, Verdict, abbreviate_build_ids, build_id,
    changes, check_pattern, evaluate, identify, parse_action, parse_policy, path_matches,
    refusal_message,
)
from conftest import require

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"

# Programs of the same size whose bytes (hence build-ids) differ; "big" is larger.
PROGRAMS = {
    "one": "int main(void) { return 1; }\n",
    "two": "int main(void) { return 2; }\n",
    "big": "static char pad[8192] = {1};\nint main(void) { return pad[0]; }\n",
}


def _readelf_build_id(path: str) -> str | None:
    """The build-id as binutils' readelf sees it (the reference for build_id)."""
    require("readelf")
    out = subprocess.run(["readelf", "-n", path], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "Build ID:" in line:
            return line.split("Build ID:")[1].strip()
    return None


@pytest.fixture(scope="module")
def elfs(tmp_path_factory) -> dict[str, Path]:
    """name -> compiled program: one, two, big (build-ids), noid (linked with --build-id=none)."""
    require("gcc")
    d = tmp_path_factory.mktemp("elfs")
    out = {}
    for name, text in PROGRAMS.items():
        (d / f"{name}.c").write_text(text)
        # --build-id is Debian's default; said explicitly so the test does not depend on it.
        subprocess.run(["gcc", "-O0", "-Wl,--build-id", "-o", str(d / name), str(d / f"{name}.c")],
                       check=True)
        out[name] = d / name
    subprocess.run(["gcc", "-O0", "-Wl,--build-id=none", "-o", str(d / "noid"), str(d / "one.c")],
                   check=True)
    out["noid"] = d / "noid"
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    return dst


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


# --- build_id ------------------------------------------------------------------

def test_build_id_of_compiled_programs_matches_readelf(elfs):
    ids = {name: build_id(str(elfs[name])) for name in ("one", "two", "big")}
    for name, bid in ids.items():
        assert bid == _readelf_build_id(str(elfs[name]))
        assert len(bid) == 40 and int(bid, 16) >= 0        # ld's default sha1, hex
    assert len(set(ids.values())) == 3


def test_build_id_none_without_note(elfs):
    assert _readelf_build_id(str(elfs["noid"])) is None
    assert build_id(str(elfs["noid"])) is None


@pytest.mark.parametrize("path", ["/usr/bin/python3", LIBC])
def test_build_id_of_system_binaries_is_fast(path):
    if not os.path.exists(path):
        pytest.skip(f"{path} not present")
    t0 = time.perf_counter()
    bid = build_id(path)
    elapsed = time.perf_counter() - t0
    assert bid and bid == _readelf_build_id(path)
    assert elapsed < 0.2, f"build_id({path}) took {elapsed:.3f} s"


def test_build_id_from_segments_when_section_headers_are_gone(elfs, tmp_path):
    p = _copy(elfs["one"], tmp_path / "noshdr")
    _patch(p, 0x28, bytes(8))                  # e_shoff
    _patch(p, 0x3C, bytes(4))                  # e_shnum, e_shstrndx
    assert build_id(str(p)) == build_id(str(elfs["one"]))


def test_build_id_from_section_when_program_headers_are_gone(elfs, tmp_path):
    p = _copy(elfs["one"], tmp_path / "nophdr")
    _patch(p, 0x38, bytes(2))                  # e_phnum
    assert build_id(str(p)) == build_id(str(elfs["one"]))


def test_build_id_none_for_non_elf_and_odd_files(elfs, tmp_path):
    text = tmp_path / "text"
    text.write_text("#!/bin/sh\necho hi\n")
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    magic_only = tmp_path / "magic"
    magic_only.write_bytes(b"\x7fELF")
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x7fELF" + b"\xff" * 200)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)                            # must not block waiting for a writer
    for p in (text, empty, magic_only, garbage, fifo, tmp_path, Path("/dev/null")):
        assert build_id(str(p)) is None, p


def test_build_id_never_raises_on_truncated_or_corrupt_elf(elfs, tmp_path):
    data = elfs["one"].read_bytes()
    for n in (16, 63, 64, 100, 400, 800, len(data) // 2):
        p = tmp_path / f"cut{n}"
        p.write_bytes(data[:n])
        assert build_id(str(p)) in (None, build_id(str(elfs["one"])))
    # Headers pointing far past the end of the file.
    p = _copy(elfs["one"], tmp_path / "wild")
    _patch(p, 0x20, (1 << 40).to_bytes(8, "little"))      # e_phoff
    _patch(p, 0x28, (1 << 40).to_bytes(8, "little"))      # e_shoff
    assert build_id(str(p)) is None


def test_build_id_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        build_id(str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        build_id(str(tmp_path / "file" / "below"))


# --- identify / changes --------------------------------------------------------

def test_identify_fields(elfs, tmp_path):
    p = str(elfs["one"])
    st = os.stat(p)
    ident = identify(p)
    assert ident == FileIdentity(path=p, size=st.st_size, mtime_ns=st.st_mtime_ns,
                                 inode=st.st_ino, dev=st.st_dev, build_id="")
    assert identify(p, elf=True).build_id == build_id(p)
    assert identify(str(elfs["noid"]), elf=True).build_id == ""
    # A given stat result is used as is.
    other = os.stat(elfs["two"])
    assert identify(p, other).inode == other.st_ino
    with pytest.raises(FileNotFoundError):
        identify(str(tmp_path / "nope"))


def test_identity_is_frozen(elfs):
    ident = identify(str(elfs["one"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ident.size = 1


def test_unchanged_file_has_no_changes(elfs):
    assert changes(identify(str(elfs["one"]), elf=True)) == []


def test_size_change(tmp_path):
    p = tmp_path / "data"
    p.write_bytes(b"x" * 123)
    rec = identify(str(p))
    with open(p, "ab") as f:
        f.write(b"y" * 333)
    os.utime(p, ns=(rec.mtime_ns, rec.mtime_ns))       # only the size differs
    assert changes(rec) == ["size 123 -> 456"]


def test_mtime_change(tmp_path):
    p = tmp_path / "data"
    p.write_bytes(b"x")
    rec = identify(str(p))
    os.utime(p, ns=(rec.mtime_ns, rec.mtime_ns + 1_000_000_000))
    assert changes(rec) == ["mtime changed"]


def test_mtime_change_with_same_build_id_is_still_reported(elfs, tmp_path):
    p = _copy(elfs["one"], tmp_path / "prog")
    rec = identify(str(p), elf=True)
    os.utime(p, ns=(rec.mtime_ns, rec.mtime_ns + 5))
    assert changes(rec) == ["mtime changed"]


def test_inode_change_by_rename(tmp_path):
    p = tmp_path / "data"
    p.write_bytes(b"same bytes")
    rec = identify(str(p))
    shutil.copy2(p, tmp_path / "data.new")            # same bytes, same mtime
    os.rename(tmp_path / "data.new", p)
    new_ino = os.stat(p).st_ino
    assert changes(rec) == [f"inode {rec.inode} -> {new_ino}"]


def test_device_change_is_reported():
    rec = identify("/etc/passwd")
    moved = dataclasses.replace(rec, dev=os.makedev(254, 7))
    now = os.stat("/etc/passwd").st_dev
    assert changes(moved) == [f"device 254:7 -> {os.major(now)}:{os.minor(now)}"]


def test_missing(tmp_path):
    p = tmp_path / "data"
    p.write_bytes(b"x")
    rec = identify(str(p))
    p.unlink()
    assert changes(rec) == ["missing"]
    p.write_bytes(b"x")                                # a file where a directory was
    assert changes(dataclasses.replace(rec, path=str(p / "below"))) == ["missing"]


def test_build_id_change_with_same_size_and_mtime(elfs, tmp_path):
    one, two = elfs["one"], elfs["two"]
    assert one.stat().st_size == two.stat().st_size
    p = _copy(one, tmp_path / "prog")
    rec = identify(str(p), elf=True)
    _patch(p, 0, two.read_bytes())                     # in place: same inode and size
    os.utime(p, ns=(rec.mtime_ns, rec.mtime_ns))
    old, new = build_id(str(one)), build_id(str(two))
    assert changes(rec) == [f"build-id {old[:12]}.. -> {new[:12]}.."]
    # Without a recorded build-id, stat alone cannot see it.
    assert changes(dataclasses.replace(rec, build_id="")) == []


def test_patched_build_id_note(elfs, tmp_path):
    p = _copy(elfs["one"], tmp_path / "prog")
    rec = identify(str(p), elf=True)
    data = p.read_bytes()
    at = data.index(bytes.fromhex(rec.build_id))
    _patch(p, at, b"\xab" * 20)
    os.utime(p, ns=(rec.mtime_ns, rec.mtime_ns))
    assert build_id(str(p)) == "ab" * 20
    assert changes(rec) == [f"build-id {rec.build_id[:12]}.. -> abababababab.."]


def test_build_id_lost_and_order_of_changes(elfs, tmp_path):
    p = _copy(elfs["one"], tmp_path / "prog")
    rec = identify(str(p), elf=True)
    p.write_text("no longer an ELF\n")
    got = changes(rec)
    assert got[0] == f"build-id {rec.build_id[:12]}.. -> none"
    assert got[1] == f"size {rec.size} -> 17"
    # Replaced by a different, bigger program: build-id first, then size.
    shutil.copyfile(elfs["big"], p)
    got = changes(rec)
    assert got[0].startswith("build-id ") and got[1].startswith("size ")


def test_abbreviate_build_ids():
    a, b = "1a2b3c4d5e6f" + "0" * 28, "3c4d" + "f" * 36
    assert abbreviate_build_ids(a, b) == ("1a2b3c4d5e6f..", "3c4dffffffff..")
    # Alike in the first 12 digits: shown in full.
    c = "1a2b3c4d5e6f" + "1" * 28
    assert abbreviate_build_ids(a, c) == (a, c)
    assert abbreviate_build_ids(a, "") == ("1a2b3c4d5e6f..", "")
    assert abbreviate_build_ids("abcd", "ef01") == ("abcd", "ef01")


# --- policies ------------------------------------------------------------------

def test_parse_action():
    assert parse_action("strict") is Action.STRICT
    assert parse_action(" WARN ") is Action.WARN
    assert parse_action("Ignore") is Action.IGNORE
    with pytest.raises(ValueError, match="unknown file policy action 'loud'"):
        parse_action("loud")


def test_parse_policy_defaults():
    assert parse_policy([]) == FilePolicy(Action.STRICT, ())
    assert parse_policy([], default=Action.WARN).default is Action.WARN
    assert parse_policy(["warn"]).default is Action.WARN
    assert parse_policy(["ignore", "strict"]).default is Action.STRICT     # the last wins


def test_parse_policy_rules_in_order():
    pol = parse_policy(["/usr/lib/**=ignore", "warn", "/usr/**=strict", "/tmp/=WARN"])
    assert pol.default is Action.WARN
    assert pol.rules == (("/usr/lib/**", Action.IGNORE), ("/usr/**", Action.STRICT),
                         ("/tmp/", Action.WARN))
    assert pol.decide("/usr/lib/x86_64-linux-gnu/libc.so.6") is Action.IGNORE
    assert pol.decide("/usr/bin/python3") is Action.STRICT
    assert pol.decide("/tmp/a/b") is Action.WARN
    assert pol.decide("/home/u/data") is Action.WARN                      # the default


def test_first_matching_rule_wins():
    a = FilePolicy(Action.WARN, (("/srv/**", Action.IGNORE), ("/srv/db/*", Action.STRICT)))
    b = FilePolicy(Action.WARN, (("/srv/db/*", Action.STRICT), ("/srv/**", Action.IGNORE)))
    assert a.decide("/srv/db/x") is Action.IGNORE
    assert b.decide("/srv/db/x") is Action.STRICT
    assert b.decide("/srv/web/x") is Action.IGNORE


def test_parse_policy_splits_at_last_equals():
    pol = parse_policy(["/srv/a=b/*=warn", "/x==ignore"])
    assert pol.rules == (("/srv/a=b/*", Action.WARN), ("/x=", Action.IGNORE))
    assert pol.decide("/srv/a=b/c") is Action.WARN


@pytest.mark.parametrize("value, message", [
    ("loud", "unknown file policy action 'loud'"),
    ("", "unknown file policy action ''"),
    ("/usr/lib=loud", "unknown file policy action 'loud'"),
    ("/usr/lib=", "unknown file policy action ''"),
    ("/a=warn=x", "unknown file policy action 'x'"),
    ("=warn", "the pattern before '=' is empty"),
    ("usr/lib/*=warn", "path pattern 'usr/lib/\\*' is not absolute"),
    ("*.so=ignore", "is not absolute"),
    ("/usr/lib", "a pattern needs an action"),
    ("/[z-a]=warn", "bad path pattern '/\\[z-a\\]'"),
    ("/[[:digit:]]=warn", "POSIX classes"),
])
def test_parse_policy_errors(value, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_policy(["warn", value])
    text = str(info.value)
    assert text.startswith(f"--file-policy {value!r}: ")
    assert "\n" not in text


def test_file_policy_checks_its_patterns():
    with pytest.raises(ValueError, match="not absolute"):
        FilePolicy(Action.WARN, (("lib/*.so", Action.IGNORE),))


# --- path patterns -------------------------------------------------------------

MATCHES = [
    # literal paths, and everything under them
    ("/etc/passwd", "/etc/passwd", True),
    ("/etc/passwd", "/etc/passwd2", False),
    ("/etc/passwd", "/etc/passw", False),
    ("/etc", "/etc/passwd", True),
    ("/etc", "/etcetera", False),
    ("/etc", "/etc", True),
    ("/", "/", True),
    ("/", "/anything/at/all", True),
    # trailing '/': the directory and its tree
    ("/slot3/", "/slot3", True),
    ("/slot3/", "/slot3/a", True),
    ("/slot3/", "/slot3/a/b/c", True),
    ("/slot3/", "/slot33/a", False),
    ("/slot3/", "/slot", False),
    ("/home/*/", "/home/u/.cache/x", True),
    ("/home/*/", "/home/u", True),
    ("/home/*/", "/home", False),
    # '*' within one component
    ("/usr/lib/*.so", "/usr/lib/libfoo.so", True),
    ("/usr/lib/*.so", "/usr/lib/.so", True),
    ("/usr/lib/*.so", "/usr/lib/x/libfoo.so", False),
    ("/usr/lib/*.so", "/usr/lib/libfoo.so.1", False),
    ("/usr/lib/*.so*", "/usr/lib/libfoo.so.1", True),
    ("/usr/*/python3", "/usr/bin/python3", True),
    ("/usr/*/python3", "/usr/local/bin/python3", False),
    ("/usr/*/python3", "/usr/bin/python3/x", True),           # literal last: its tree
    ("/tmp/*", "/tmp/a", True),
    ("/tmp/*", "/tmp/a/b", False),                            # wildcard last: no tree
    ("/tmp/*", "/tmp", False),
    ("/tmp/*", "/tmp/", False),
    ("/tmp/*", "/tmp/.hidden", True),                         # no dot-file rule
    ("/opt/app-*", "/opt/app-1", True),
    ("/opt/app-*", "/opt/app-1/lib/x.so", False),
    ("/*", "/etc", True),
    ("/*", "/etc/passwd", False),
    ("/a*b", "/ab", True),
    ("/a*b", "/a/b", False),
    ("/a**b", "/axxb", True),                                 # '**' inside a name is '*'
    ("/a**b", "/a/b", False),
    # '?'
    ("/dev/tty?", "/dev/tty1", True),
    ("/dev/tty?", "/dev/tty", False),
    ("/dev/tty?", "/dev/tty12", False),
    ("/a?b", "/a/b", False),
    ("/??", "/ab", True),
    # '**'
    ("/usr/**", "/usr", True),
    ("/usr/**", "/usr/lib", True),
    ("/usr/**", "/usr/lib/x86_64-linux-gnu/libc.so.6", True),
    ("/usr/**", "/usrx/lib", False),
    ("/usr/**/libc.so.6", "/usr/libc.so.6", True),
    ("/usr/**/libc.so.6", "/usr/lib/libc.so.6", True),
    ("/usr/**/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6", True),
    ("/usr/**/libc.so.6", "/usr/lib/libc.so.7", False),
    ("/usr/**/lib*.so", "/usr/a/b/libz.so", True),
    ("/usr/**/lib*.so", "/usr/a/b/libz.so.1", False),
    ("/**/*.py", "/x.py", True),
    ("/**/*.py", "/a/b/c/x.py", True),
    ("/**/*.py", "/a/b/c/x.pyc", False),
    ("/**", "/", True),
    ("/**", "/a/b", True),
    ("/a/**/b/**/c", "/a/b/c", True),
    ("/a/**/b/**/c", "/a/x/y/b/z/c", True),
    ("/a/**/b/**/c", "/a/x/c", False),
    ("/a/**/", "/a/x/y", True),
    # character classes
    ("/dev/sd[ab]", "/dev/sda", True),
    ("/dev/sd[ab]", "/dev/sdc", False),
    ("/dev/sd[a-c]1", "/dev/sdb1", True),
    ("/dev/sd[a-c]1", "/dev/sdd1", False),
    ("/dev/sd[!a-c]", "/dev/sdd", True),
    ("/dev/sd[!a-c]", "/dev/sda", False),
    ("/dev/sd[^a-c]", "/dev/sdd", True),
    ("/x[]]", "/x]", True),
    ("/x[]a]", "/xa", True),
    ("/x[!]]", "/x]", False),
    ("/x[!]]", "/xq", True),
    ("/x[-a]", "/x-", True),
    ("/x[a-]", "/x-", True),
    ("/x[a\\-c]", "/xb", False),                              # an escaped '-' is no range
    ("/x[a\\-c]", "/x-", True),
    ("/x[.]", "/x.", True),
    ("/x[.]", "/xa", False),
    ("/a[+-0]b", "/a/b", False),                              # a range holding '/'
    ("/a[+-0]b", "/a.b", True),
    ("/a[!x]b", "/a/b", False),                               # a negated class
    ("/x[ab", "/x[ab", True),                                 # unclosed: literal '['
    ("/x[ab", "/xa", False),
    ("/x[", "/x[", True),
    # escapes and regex metacharacters
    ("/a\\*b", "/a*b", True),
    ("/a\\*b", "/axb", False),
    ("/a\\?", "/a?", True),
    ("/a\\?", "/ab", False),
    ("/a\\[b]", "/a[b]", True),
    ("/a\\[b]", "/ab", False),
    ("/a.b", "/a.b", True),
    ("/a.b", "/axb", False),
    ("/a+(b)|c$", "/a+(b)|c$", True),
    ("/a^b", "/a^b", True),
    ("/memfd:x (deleted)", "/memfd:x (deleted)", True),
    ("/a=b/*", "/a=b/c", True),
    # slashes
    ("/usr//lib/", "/usr/lib/x", True),
    ("/usr/lib", "/usr//lib/x", True),
    ("/usr/lib", "/usr/lib/", True),
    ("/a/*", "/a/b\nc", True),                                # a newline is just a character
    ("/a", "/a\n/b", False),                                 # the component is "a\n"
    ("/a", "/a/b\n/c", True),
    ("/a?", "/a\n", True),
]


@pytest.mark.parametrize("pattern, path, expected", MATCHES)
def test_path_matches(pattern, path, expected):
    assert path_matches(pattern, path) is expected


@pytest.mark.parametrize("pattern", ["", "usr/lib", "*.so", "**/x", "./x", "~/x"])
def test_relative_pattern_is_an_error(pattern):
    with pytest.raises(ValueError, match="is not absolute"):
        path_matches(pattern, "/x")
    with pytest.raises(ValueError, match="is not absolute"):
        check_pattern(pattern)


@pytest.mark.parametrize("pattern", ["/[z-a]", "/x/[[:alpha:]]"])
def test_malformed_pattern_is_an_error(pattern):
    with pytest.raises(ValueError, match="bad path pattern"):
        path_matches(pattern, "/x")


def test_check_pattern_returns_the_pattern():
    assert check_pattern("/slot3/**") == "/slot3/**"


# --- evaluate ------------------------------------------------------------------

def test_evaluate_sorts_changes_by_policy(elfs, tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    so = _copy(elfs["one"], lib / "libfoo.so.1")
    strict_file = tmp_path / "strict.dat"
    strict_file.write_bytes(b"a")
    warned = tmp_path / "warn.dat"
    warned.write_bytes(b"b")
    ignored = tmp_path / "cache" / "x"
    ignored.parent.mkdir()
    ignored.write_bytes(b"c")
    same = tmp_path / "same.dat"
    same.write_bytes(b"d")
    recs = [identify(str(so), elf=True), identify(str(strict_file)), identify(str(warned)),
            identify(str(ignored)), identify(str(same))]

    shutil.copyfile(elfs["big"], so)                   # new build-id, new size
    os.utime(so, ns=(recs[0].mtime_ns, recs[0].mtime_ns))
    with open(strict_file, "ab") as f:
        f.write(b"more")
    os.utime(strict_file, ns=(recs[1].mtime_ns, recs[1].mtime_ns))
    warned.unlink()
    ignored.write_bytes(b"changed")

    policy = parse_policy(["strict", f"{tmp_path}/*.dat=warn", f"{strict_file}=strict",
                           f"{tmp_path}/cache=ignore"])
    # the "*.dat=warn" rule comes first, so strict.dat is only warned about ...
    v = evaluate(recs, policy)
    old, new = abbreviate_build_ids(recs[0].build_id, build_id(str(elfs["big"])))
    big = os.path.getsize(elfs["big"])
    assert v.refused == [f"{so}: build-id {old} -> {new}, size {recs[0].size} -> {big}"]
    assert v.warnings == [f"{strict_file}: size 1 -> 5", f"{warned}: missing"]
    assert not v.ok
    # ... and refused when its own rule is put first.
    policy = parse_policy([f"{strict_file}=strict", f"{tmp_path}/*.dat=warn",
                           f"{tmp_path}/cache=ignore", "ignore"])
    v = evaluate(recs, policy)
    assert v.refused == [f"{strict_file}: size 1 -> 5"]
    assert v.warnings == [f"{warned}: missing"]


def test_evaluate_nothing_changed_and_duplicates(elfs):
    rec = identify(str(elfs["one"]), elf=True)
    assert evaluate([rec, rec], FilePolicy()) == Verdict([], [])
    assert evaluate([], FilePolicy()).ok


def test_evaluate_repeated_identity_gives_one_line(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x")
    rec = identify(str(p))
    p.unlink()
    assert evaluate([rec, rec], FilePolicy(Action.WARN)).warnings == [f"{p}: missing"]


def test_refusal_message_and_error():
    lines = ["/a: size 1 -> 2", "/b: missing"]
    msg = refusal_message(lines)
    assert msg == ("files changed since the dump (restore with --file-policy warn or ignore "
                   "to go on): /a: size 1 -> 2; /b: missing")
    err = FilesChanged(lines)
    assert str(err) == msg
    assert err.refused == lines
    assert err.exit_code == ExitCode.INCOMPATIBLE

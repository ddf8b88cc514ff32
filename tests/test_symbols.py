"""ptckpt.symbols on real processes: lookup by ELF symbol, writes, and a new environment.

The target is a small C program compiled here (PIE, -no-pie, and PIE using
``environ`` itself, which gives it a copy relocation of libc's variable).  It
prints ``SYM design_state 0x...`` and ``READY <pid>``, then on each SIGUSR1
its globals and getenv("DISPLAY") / getenv("GONE").  Targets are started by
`spawn`, whose finalizer kills and reaps them; a frozen target is resumed by
:func:`_frozen` whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from ptckpt import procfs, symbols
from ptckpt.errors import PtckptError
from ptckpt.procfs import MapEntry
from ptckpt.symbols import (BadSymbolExpression, ElfSymbols, SymbolNotFound, SymbolTable,
                            environ_slots, read_environ, set_env, unset_env, write_environ)
from ptckpt.tracee import AddressSpace, Session, Task, find_syscall_insn, remote_syscalls
from conftest import require

PROGRAM = r"""
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

unsigned long design_state[4] = {11, 22, 33, 44};
char banner[32] = "hello";
__thread int tls_counter = 5;
#ifdef USE_ENVIRON
extern char **environ;
#endif

int main(void)
{
    sigset_t set;
    int sig;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigprocmask(SIG_BLOCK, &set, NULL);
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("SYM design_state 0x%lx\n", (unsigned long)&design_state);
    printf("SYM banner 0x%lx\n", (unsigned long)banner);
    printf("READY %d\n", (int)getpid());
    for (;;) {
        if (sigwait(&set, &sig) != 0)
            return 5;
        const char *d = getenv("DISPLAY"), *g = getenv("GONE");
        printf("STATE %lu %lu %lu %lu %s %d\n", design_state[0], design_state[1],
               design_state[2], design_state[3], banner, tls_counter);
#ifdef USE_ENVIRON
        int n = 0;
        for (char **e = environ; *e; e++)
            n++;
        printf("ENVIRON %d\n", n);
#endif
        printf("DISPLAY %s GONE %s\n", d ? d : "(unset)", g ? g : "(unset)");
    }
}
"""

BUILDS = {
    "pie": [],
    "nopie": ["-no-pie"],
    "pie-environ": ["-DUSE_ENVIRON"],
}
START_ENV = {"DISPLAY": ":3", "GONE": "1", "KEEP": "yes"}


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build name -> executable compiled from PROGRAM."""
    require("gcc")
    d = tmp_path_factory.mktemp("symbols")
    (d / "prog.c").write_text(PROGRAM)
    out = {}
    for name, flags in BUILDS.items():
        out[name] = d / name
        subprocess.run(["gcc", "-O0", "-o", str(out[name]), str(d / "prog.c"), *flags],
                       check=True, capture_output=True)
    return out


@contextlib.contextmanager
def _frozen(pid: int) -> Iterator[tuple[Task, AddressSpace, SymbolTable]]:
    """The frozen leader of `pid`, its memory and its symbol table; resumed on exit."""
    session = Session()
    try:
        tasks = session.freeze_process(pid)
        leader = next(t for t in tasks if t.tid == pid)
        with AddressSpace(pid) as mem:
            yield leader, mem, SymbolTable.for_process(pid)
    finally:
        session.resume_all()


def _mapping_of(pid: int, addr: int) -> MapEntry:
    return next(m for m in procfs.read_maps(pid) if m.start <= addr < m.end)


def _file_bytes(path: str, vaddr: int, n: int) -> bytes:
    """`n` bytes of the ELF file at `path` that its PT_LOADs put at `vaddr` (no bias)."""
    with open(path, "rb") as f:
        for seg in ELFFile(f).iter_segments("PT_LOAD"):
            if seg["p_vaddr"] <= vaddr < seg["p_vaddr"] + seg["p_filesz"]:
                f.seek(vaddr - seg["p_vaddr"] + seg["p_offset"])
                return f.read(n)
    raise AssertionError(f"{vaddr:#x} is in no PT_LOAD of {path}")


def _assert_in_data_of(pid: int, obj, bias: int, addr: int) -> None:
    """`addr` is in a writable PT_LOAD of `obj`: its rw file mapping or the anonymous
    .bss mapping right after the object's last file mapping."""
    with open(obj.path, "rb") as f:
        segs = [(s["p_vaddr"], s["p_memsz"]) for s in ELFFile(f).iter_segments("PT_LOAD")
                if s["p_flags"] & 2]
    assert any(bias + v <= addr < bias + v + size for v, size in segs)
    m = _mapping_of(pid, addr)
    assert m.perms.startswith("rw")
    assert m.path == obj.path or (m.path == "" and m.start == obj.mappings[-1].end)


def _poke_state(target) -> str:
    """SIGUSR1, then the STATE .. DISPLAY lines the target answers with, as one string."""
    before = len([line for line in target.stdout_lines() if line.startswith("DISPLAY")])
    target.signal(signal.SIGUSR1)
    target.wait_for_line(r"^DISPLAY ", count=before + 1, timeout=5)
    lines = target.stdout_lines()
    start = max(i for i, line in enumerate(lines) if line.startswith("STATE"))
    return "\n".join(lines[start:])


# --- real processes --------------------------------------------------------------

@pytest.mark.parametrize("build", list(BUILDS))
def test_lookup_write_and_new_environment(spawn, programs, build):
    target = spawn(str(programs[build]), out=False, env=START_ENV)
    printed = target.symbols["design_state"]
    with _frozen(target.pid) as (leader, mem, table):
        sym = table.lookup("design_state")
        assert (sym.address, sym.size, sym.type) == (printed, 32, "OBJECT")
        assert sym.object == str(programs[build])
        assert table.lookup("banner").address == target.symbols["banner"]
        assert table.resolve("design_state+8") == printed + 8
        assert table.resolve("design_state + 0x10") == printed + 16
        assert table.resolve(hex(printed)) == printed

        main, bias = table.loaded()[0]
        assert main.path == str(programs[build])
        if build == "nopie":
            assert bias == 0 and printed < 0x1000000
        else:
            assert bias != 0 and bias % procfs.PAGE_SIZE == 0

        getenv = table.lookup("getenv")
        assert getenv.type == "FUNC" and getenv.object.endswith("/libc.so.6")
        assert _mapping_of(target.pid, getenv.address).path == getenv.object
        assert "x" in _mapping_of(target.pid, getenv.address).perms
        libc, libc_bias = next(o for o in table.loaded() if o[0].path == getenv.object)
        assert mem.read(getenv.address, 16) == _file_bytes(libc.path, getenv.address - libc_bias, 16)
        libc_environ = table.lookup("environ", object="libc.so.6")
        assert libc_environ.type == "OBJECT" and libc_environ.size == 8
        _assert_in_data_of(target.pid, libc, libc_bias, libc_environ.address)
        assert table.resolve("libc.so.6:environ") == libc_environ.address
        assert table.lookup("__environ", object="libc.so.6").address == libc_environ.address

        environ = table.lookup("environ")
        if build == "pie-environ":      # copy relocation: the live variable is the program's
            assert environ.object == main.path
            assert table.lookup("__environ").object == main.path
            assert environ_slots(table) == [environ.address, libc_environ.address]
        else:
            assert environ == libc_environ
            assert environ_slots(table) == [libc_environ.address]

        env = read_environ(mem, table)
        assert sorted(env) == sorted(f"{k}={v}".encode() for k, v in START_ENV.items())
        mem.write(table.resolve("design_state+8"), struct.pack("<Q", 4242))
        new_env = unset_env(set_env(env, "DISPLAY", ":7"), "GONE")
        with remote_syscalls(leader, mem, find_syscall_insn(mem, procfs.read_maps(target.pid))) as remote:
            write_environ(remote, mem, table, new_env)
        assert read_environ(mem, table) == new_env
    state = _poke_state(target)
    assert "STATE 11 4242 33 44 hello 5" in state
    assert "DISPLAY :7 GONE (unset)" in state
    if build == "pie-environ":
        assert "ENVIRON 2" in state          # DISPLAY and KEEP


def test_missing_symbol_names_what_was_searched(spawn, programs):
    target = spawn(str(programs["pie"]), out=False, env=START_ENV)
    with _frozen(target.pid) as (_leader, _mem, table):
        with pytest.raises(SymbolNotFound) as err:
            table.lookup("no_such_symbol_here")
        assert isinstance(err.value, PtckptError)
        assert err.value.name == "no_such_symbol_here"
        assert str(programs["pie"]) in err.value.searched
        assert any(p.endswith("/libc.so.6") for p in err.value.searched)
        assert "'no_such_symbol_here' not found in" in str(err.value)
        assert str(programs["pie"]) in str(err.value)

        with pytest.raises(SymbolNotFound) as err:
            table.lookup("design_state", object="libc.so.6")     # restricted: not in libc
        assert len(err.value.searched) == 1 and err.value.searched[0].endswith("/libc.so.6")
        with pytest.raises(SymbolNotFound, match="no mapped ELF object matches 'libnope.so'"):
            table.resolve("libnope.so:design_state")
        assert table.lookup("design_state", object="pie").address == target.symbols["design_state"]
        with pytest.raises(SymbolNotFound):
            table.lookup("design_state", object="ie")            # whole path components only

        tls = table.lookup("tls_counter")
        assert tls.type == "TLS"
        with pytest.raises(BadSymbolExpression, match="thread-local"):
            table.resolve("tls_counter")
        with pytest.raises(BadSymbolExpression):
            table.resolve("design_state+")


def test_big_environment_round_trip(spawn, programs):
    """An array and strings spanning several pages, read back through page-sized reads."""
    target = spawn(str(programs["pie"]), out=False, env=START_ENV)
    big = [f"V{i:04d}={'x' * (i % 50)}".encode() for i in range(1500)] + [b"DISPLAY=:big"]
    with _frozen(target.pid) as (leader, mem, table):
        with remote_syscalls(leader, mem, find_syscall_insn(mem, procfs.read_maps(target.pid))) as remote:
            write_environ(remote, mem, table, big)
        assert read_environ(mem, table) == big
    assert "DISPLAY :big GONE (unset)" in _poke_state(target)


def test_file_replaced_on_disk_still_resolves(spawn, programs, tmp_path):
    """Symbols come from the mapped file (map_files), not from the path's new contents."""
    exe = tmp_path / "replaced"
    shutil.copy(programs["pie"], exe)
    target = spawn(str(exe), out=False, env=START_ENV)
    shutil.copy(programs["nopie"], tmp_path / "new")
    os.replace(tmp_path / "new", exe)
    with _frozen(target.pid) as (_leader, _mem, table):
        assert table.lookup("design_state").address == target.symbols["design_state"]


# --- pure parts ------------------------------------------------------------------

def test_set_and_unset_env():
    env = [b"A=1", b"DISPLAY=:3", b"B=2", b"DISPLAY=:9", b"DISPLAYX=1"]
    assert set_env(env, "DISPLAY", ":7") == [b"A=1", b"DISPLAY=:7", b"B=2", b"DISPLAYX=1"]
    assert set_env(env, b"NEW", b"v") == env + [b"NEW=v"]
    assert unset_env(env, "DISPLAY") == [b"A=1", b"B=2", b"DISPLAYX=1"]
    assert unset_env(env, "MISSING") == env
    with pytest.raises(symbols.SymbolError):
        set_env(env, "A=B", "x")


def test_pack_environ_layout():
    blob = symbols.pack_environ([b"A=1", b"BB=22"], 0x1000)
    pointers = struct.unpack_from("<3Q", blob)
    assert pointers == (0x1000 + 24, 0x1000 + 28, 0)
    assert blob[24:] == b"A=1\0BB=22\0"


def _map(start: int, end: int, perms: str, offset: int, inode: int = 7,
         path: str = "/lib/x.so") -> MapEntry:
    prot = sum(bit for ch, bit in zip(perms, (1, 2, 4)) if ch != "-")
    return MapEntry(start, end, perms + "p", prot, False, offset, 8, 1, inode, path, False)


def test_group_mappings():
    maps = [
        _map(0x1000, 0x2000, "r--", 0x0),
        _map(0x2000, 0x3000, "r-x", 0x1000),
        _map(0x3000, 0x4000, "r--", 0x2000),
        _map(0x4000, 0x5000, "r--", 0x2000),       # RELRO shares the .rodata page
        _map(0x5000, 0x6000, "rw-", 0x3000),
        _map(0x6000, 0x7000, "rw-", 0),            # anonymous .bss
        _map(0x8000, 0x9000, "r--", 0x0),           # the same file mmap'ed as data
        _map(0xa000, 0xb000, "r--", 0x0, inode=9, path="/lib/y.so"),
        _map(0xb000, 0xc000, "r-x", 0x1000, inode=9, path="/lib/y.so"),
    ]
    maps[5] = maps[5]._replace(inode=0, path="")
    objs = symbols.group_mappings(maps)
    assert [(o.path, len(o.mappings)) for o in objs] == [("/lib/x.so", 5), ("/lib/y.so", 2)]
    assert objs[0].matches("x.so") and objs[0].matches("lib/x.so") and not objs[0].matches(".so")


def test_load_bias():
    dyn = ElfSymbols("ET_DYN", ((0, 0, 0x500), (0x1000, 0x1000, 0x800), (0x2e10, 0x3e10, 0x200)),
                     {}, ".dynsym")
    text = _map(0x7f0000001000, 0x7f0000002000, "r-x", 0x1000)
    data = _map(0x7f0000003000, 0x7f0000004000, "rw-", 0x2000)
    first = _map(0x7f0000000000, 0x7f0000001000, "r--", 0)
    assert symbols.load_bias(dyn, [first, text, data]) == 0x7f0000000000
    assert symbols.load_bias(dyn, [text]) == 0x7f0000000000
    # Without the offset-0 mapping: the segment whose vaddr and offset differ.
    # page of vaddr 0x3e10 at bias + 0x3000, file page 0x2000
    moved = _map(0x7f0000004000, 0x7f0000005000, "rw-", 0x2000)
    assert symbols.load_bias(dyn, [moved]) == 0x7f0000001000
    exe = ElfSymbols("ET_EXEC", ((0, 0x400000, 0x500),), {}, ".symtab")
    assert symbols.load_bias(exe, [_map(0x400000, 0x401000, "r-x", 0)]) == 0
    assert symbols.load_bias(dyn, [_map(0x1000, 0x2000, "r--", 0x9000)]) is None

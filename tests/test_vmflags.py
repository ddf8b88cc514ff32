"""VMA flags come back (madvise hints, locks, droppable memory, names, guard pages, seals),
and every flag smaps can show is either made again, follows from the mapping, or is refused
by name (ptckpt.resources.memory's tables; fixtures/vmflags.c)."""

from __future__ import annotations

import pytest

from ptckpt.errors import UnsupportedResource
from ptckpt.formats.model import Vma, VmaKind
from ptckpt.resources import memory

from test_restore import _dump_kill, _restore


def _smaps_flags(pid: int) -> dict[int, tuple[str, set[str]]]:
    """{start: (path, VmFlags)} of every mapping."""
    out, start, path = {}, None, ""
    for line in open(f"/proc/{pid}/smaps"):
        head = line.split()
        if "-" in head[0] and not line.startswith("VmFlags"):
            start = int(head[0].split("-")[0], 16)
            path = head[5] if len(head) > 5 else ""
        elif line.startswith("VmFlags:"):
            out[start] = (path, set(head[1:]))
    return out


def test_madvise_hints_locks_names_guards_and_seals_survive(spawn, ptckpt, tmp_path):
    target = spawn("vmflags")
    areas = {line.split()[1]: int(line.split()[2], 16)
             for line in target.preamble if line.startswith("VMA ")}
    before = _smaps_flags(target.pid)
    guards = memory.guard_regions(target.pid, areas["guarded"], areas["guarded"] + 4 * 4096)
    assert guards == [(areas["guarded"] + 4096, areas["guarded"] + 2 * 4096)]
    # the fixture shows every flag the restore claims to make (protections aside)
    seen = set().union(*(before[a][1] for a in areas.values()))
    made = set(memory.VMFLAGS_MADE) - {"rd", "wr", "ex", "sh", "mr", "mw", "me", "ms", "gd", "nr"}
    if "droppable" not in areas:
        made.discard("dp")
    assert made <= seen, f"not covered by the fixture: {made - seen}"
    assert areas["moved"] + 4 * 4096 in before, "the moved half is a mapping of its own"
    _dump_kill(ptckpt, target, tmp_path / "img")
    target.adopt(_restore(ptckpt, tmp_path / "img"))
    after = _smaps_flags(target.pid)
    for name, addr in areas.items():
        # "gu" (may hold guard pages) is a hint that sticks to whatever a mapping is merged with:
        # the moved area joins its neighbour, sealed, which had it from guarded before the seal
        # split them.  The guard pages themselves are compared below.
        assert after[addr][0] == before[addr][0] and after[addr][1] - {"gu"} == before[addr][1] - {"gu"}, name
    if "named" in areas:
        assert after[areas["named"]][0] == "[anon:ptckpt-named]"
    assert memory.guard_regions(target.pid, areas["guarded"], areas["guarded"] + 4 * 4096) == guards
    target.signal()
    line = target.wait_for_line(r"^CHECKED ", timeout=15).string
    assert target.wait_exit(10) == 0, target.describe()
    assert int(line.split()[1]) == len(areas) + 3
    if "droppable" in areas:                      # MAP_DROPPABLE pages are not saved (CRIU's maps11)
        assert "DROPPED droppable" in target.stdout_lines(), target.describe()


def _vma(flags: str, kind=VmaKind.ANON_PRIVATE, path="") -> Vma:
    return Vma(0x10000, 0x20000, 3, False, kind, 0, 0, 0, 0, path, flags)


@pytest.mark.parametrize("flag", sorted(memory.VMFLAGS_REFUSED) + ["zz"])
def test_a_flag_no_restore_makes_is_refused_by_name(flag):
    with pytest.raises(UnsupportedResource) as info:
        memory.check_vmas(7, [_vma(f"rd wr mr mw me ac {flag}")])
    assert f"VmFlags '{flag}'" in str(info.value)
    assert "0x10000-0x20000" in str(info.value)


def test_flags_of_kernel_mappings_are_theirs_and_a_strange_mapping_is_refused():
    memory.check_vmas(7, [_vma("rd ex mr mw me de pf io", VmaKind.VVAR, "[vvar]")])
    with pytest.raises(UnsupportedResource, match="VmFlags 'io'"):
        memory.check_vmas(7, [_vma("rd mr io")])
    with pytest.raises(UnsupportedResource, match="cannot make again"):
        memory.check_vmas(7, [_vma("rd mr", VmaKind.OTHER, "[uprobes]")])

"""Files that changed between dump and restore, and what the user wants done about it.

A restore reopens every file and file mapping by path, so a file that was
replaced or edited since the dump gives the restored process different bytes
than it had.  This module is the pure decision logic, no ptrace:

* :func:`identify` records a :class:`FileIdentity` (size, mtime, inode, device,
  and for executables and libraries the GNU build-id from :func:`build_id`);
* :func:`changes` compares one with the file now at its path;
* :class:`FilePolicy` (built by :func:`parse_policy` from the repeated
  ``--file-policy`` option) says per path whether a change refuses the restore
  (STRICT), is printed (WARN) or is let through (IGNORE);
* :func:`evaluate` applies a policy to every recorded file, and
  :func:`refusal_message` / :class:`FilesChanged` report the refusal;
* :func:`path_matches` is the glob matcher shared by the policy and by
  ``--save-file`` / ``--skip-file``.

Pattern syntax (absolute paths only): ``*`` any run of characters and ``?``
one character, neither crossing '/'; ``[abc]``, ``[a-z]``, ``[!a-z]`` (or
``[^a-z]``) one character of a class, never '/'; ``**`` as a whole component
any number of components, none included; a backslash makes the next character
literal.  There is no dot-file rule: ``*`` matches a leading '.'.  A pattern
also matches everything *under* what it matches when it ends in '/' or its
last component has no wildcard (so ``/slot3``, ``/slot3/`` and ``/slot3/**``
all cover the tree /slot3; ``/opt/app-*`` matches /opt/app-1 but not the files
in it: write ``/opt/app-*/`` for that).
"""

from __future__ import annotations

import enum
import errno as _errno
import functools
import os
import re
import stat as _stat
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elftools.elf.elffile import ELFFile

from ..errors import Incompatible

BUILD_ID_NOTE = ".note.gnu.build-id"
_ABBREV = 12          # hex digits of a build-id shown in a change line
_OUT_OF = frozenset({_errno.EMFILE, _errno.ENFILE, _errno.ENOMEM})


# --- build-id ------------------------------------------------------------------

def build_id(path: str) -> str | None:
    """The GNU build-id (NT_GNU_BUILD_ID note, lower-case hex) of the ELF file at `path`.

    None for anything that is not a regular ELF file with such a note: a
    non-ELF, an ELF without one, a directory, FIFO or device, a truncated or
    malformed ELF, a file ptckpt may not read.  Only the program headers and the
    notes are read (PT_NOTE segments first, then the .note.gnu.build-id
    section), so a big library costs a few small reads.

    Raises FileNotFoundError (and NotADirectoryError) when there is no file at
    `path`: a missing file is the caller's to report.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)   # a FIFO must not block
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as err:
        if err.errno in _OUT_OF:                 # ptckpt's own limits: not a property of the file
            raise
        return None
    if not _stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as stream:
        try:
            if stream.read(4) != b"\x7fELF":
                return None
            found = _note_in_segments_quick(stream)
        except OSError as err:
            _raise_if_ours(err)
            return None
        if found:
            return found
        # pyelftools for the rest (no note in a PT_NOTE segment, or one that does not parse):
        # imported here, as few files need it, and out of the try below: no fd left for its
        # files is no "none"
        from elftools.elf.elffile import ELFFile
        try:
            elf = ELFFile(stream)
        except Exception as err:   # EIO, or pyelftools' anything from ELFError to struct.error
            _raise_if_ours(err)
            return None
        return _note_in_segments(elf) or _note_in_section(elf)


def _raise_if_ours(err: Exception) -> None:
    """Out of fds or memory, or a part of pyelftools that could not be imported (for want of an
    fd): ptckpt's trouble, to be said as such, not "this file has no build-id"."""
    if isinstance(err, ImportError) or isinstance(err, OSError) and err.errno in _OUT_OF:
        raise err


def _gnu_build_id(notes: Iterable[Mapping[str, Any]]) -> str | None:
    """The hex of the first NT_GNU_BUILD_ID note owned by "GNU" among `notes`."""
    for note in notes:
        if note["n_type"] == "NT_GNU_BUILD_ID" and note["n_name"] == "GNU" and note["n_desc"]:
            return note["n_desc"]
    return None


# The ELF file header's fields that lead to the program headers, by e_ident[EI_CLASS]
# (elf(5), /usr/include/elf.h: Elf32_Ehdr / Elf64_Ehdr, Elf32_Phdr / Elf64_Phdr):
# (e_phoff's offset and format, e_phentsize/e_phnum's offset, a Phdr's size, the format
# of its p_type, p_offset, p_filesz).
_ELF_CLASSES = {1: (0x1C, "I", 0x2A, 32, "II8xI"), 2: (0x20, "Q", 0x36, 56, "I4xQ16xQ")}
_PT_NOTE, _NT_GNU_BUILD_ID = 4, 3
_NOTES_LIMIT = 1 << 20       # bytes of one PT_NOTE segment read at most (they hold a few hundred)


def _note_in_segments_quick(stream) -> str | None:
    """The build-id from the PT_NOTE segments of an executable or shared object, read with
    struct in a few small reads; None when there is none or anything is not as expected
    (another ELF type, a header or note that does not parse), for pyelftools to decide."""
    head = stream.read(60)                       # the rest of Elf64_Ehdr after the magic
    if len(head) < 60 or head[0] not in _ELF_CLASSES or head[1] not in (1, 2):
        return None
    phoff_at, phoff_fmt, ph_at, phsize, phdr_fmt = _ELF_CLASSES[head[0]]
    order = "<" if head[1] == 1 else ">"
    if struct.unpack_from(order + "H", head, 0x10 - 4)[0] not in (2, 3):      # e_type: EXEC, DYN
        return None
    phoff = struct.unpack_from(order + phoff_fmt, head, phoff_at - 4)[0]
    phentsize, phnum = struct.unpack_from(order + "HH", head, ph_at - 4)
    if phentsize < phsize or not 0 < phnum < 0xFFFF:
        return None
    stream.seek(phoff)
    table = stream.read(phentsize * phnum)
    if len(table) < phentsize * phnum:
        return None
    for i in range(phnum):
        p_type, offset, size = struct.unpack_from(order + phdr_fmt, table, i * phentsize)
        if p_type != _PT_NOTE or size > _NOTES_LIMIT:
            continue
        stream.seek(offset)
        found = _gnu_build_id_in(stream.read(size), order)
        if found:
            return found
    return None


def _gnu_build_id_in(notes: bytes, order: str) -> str | None:
    """The first NT_GNU_BUILD_ID note named "GNU" in a run of notes (Elf_Nhdr: namesz,
    descsz, type; the name and the descriptor each padded to 4 bytes, as pyelftools reads
    them); None when there is none or a note runs past the end."""
    at = 0
    while at + 12 <= len(notes):
        namesz, descsz, ntype = struct.unpack_from(order + "III", notes, at)
        name_at = at + 12
        desc_at = name_at + (namesz + 3) // 4 * 4
        at = desc_at + (descsz + 3) // 4 * 4
        if desc_at + descsz > len(notes):
            return None
        if ntype == _NT_GNU_BUILD_ID and descsz and notes[name_at:name_at + namesz].split(b"\0")[0] == b"GNU":
            return notes[desc_at:desc_at + descsz].hex()
    return None


def _note_in_segments(elf: ELFFile) -> str | None:
    """The build-id from the PT_NOTE segments, None if none has it or they do not parse."""
    try:
        for seg in elf.iter_segments("PT_NOTE"):
            found = _gnu_build_id(seg.iter_notes())
            if found:
                return found
    except Exception as err:       # a malformed header or note: try the section instead
        _raise_if_ours(err)
    return None


def _note_in_section(elf: ELFFile) -> str | None:
    """The build-id from the .note.gnu.build-id section, None if absent or malformed."""
    try:
        sec = elf.get_section_by_name(BUILD_ID_NOTE)
        if sec is None or sec["sh_type"] != "SHT_NOTE":
            return None
        return _gnu_build_id(sec.iter_notes())
    except Exception as err:
        _raise_if_ours(err)
        return None


# --- identities and changes ----------------------------------------------------

@dataclass(frozen=True)
class FileIdentity:
    """What a file was at dump time; build_id is "" when not asked for or absent."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    dev: int
    build_id: str = ""
    append_hash: int = 0      # open O_APPEND: head_hash of its first `size` bytes at dump (0: none)


def identify(path: str, st: os.stat_result | None = None, *, elf: bool = False) -> FileIdentity:
    """The identity of the file at `path` (stat'ed here unless `st` is given).

    With elf=True the build-id is read too ("" for a file without one).  Raises
    OSError (FileNotFoundError ...) when the file cannot be stat'ed.
    """
    if st is None:
        st = os.stat(path)
    bid = (build_id(path) or "") if elf else ""
    return FileIdentity(path=path, size=st.st_size, mtime_ns=st.st_mtime_ns,
                        inode=st.st_ino, dev=st.st_dev, build_id=bid)


APPEND_HASH_LIMIT = 1 << 30   # bytes of a file open for appending hashed at dump, at most


def head_hash(path: str, size: int) -> int:
    """xxh3-64 of the first `size` bytes of the file at `path` (a /proc/PID/fd link will
    do); 0 when it cannot be read, is shorter, or is bigger than APPEND_HASH_LIMIT."""
    import xxhash
    if not 0 < size <= APPEND_HASH_LIMIT:
        return 0
    h = xxhash.xxh3_64()
    try:
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < size:
                chunk = f.read(min(8 << 20, size - done))
                if not chunk:
                    return 0
                h.update(chunk)
                done += len(chunk)
    except OSError:
        return 0
    return h.intdigest() or 1                       # 0 means "none"


def appended(recorded: FileIdentity) -> int | None:
    """Bytes a file open for appending grew by since the dump, when that is all that
    changed (the same file, its first bytes as they were); None otherwise."""
    if not recorded.append_hash:
        return None
    try:
        st = os.stat(recorded.path)
    except OSError:
        return None
    if (st.st_ino, st.st_dev) != (recorded.inode, recorded.dev) or st.st_size < recorded.size:
        return None
    if head_hash(recorded.path, recorded.size) != recorded.append_hash:
        return None
    return st.st_size - recorded.size


def changes(recorded: FileIdentity) -> list[str]:
    """What differs between `recorded` and the file now at its path; [] when nothing does.

    ["missing"] when the path is gone.  Otherwise, in this order, any of
    "build-id 1a2b.. -> 3c4d.." (only when a build-id was recorded; "-> none"
    when the file has none now), "size 123 -> 456", "mtime changed",
    "inode 11 -> 12", "device 8:1 -> 8:2".  An mtime change is reported even
    when the build-id is the same: the policy decides what it is worth.
    """
    try:
        st = os.stat(recorded.path)
    except (FileNotFoundError, NotADirectoryError):
        return ["missing"]
    except OSError as err:
        return [f"cannot stat: {err.strerror}"]
    out = []
    if recorded.build_id:
        out += _build_id_change(recorded)
    if st.st_size != recorded.size:
        out.append(f"size {recorded.size} -> {st.st_size}")
    if st.st_mtime_ns != recorded.mtime_ns:
        out.append("mtime changed")
    if st.st_ino != recorded.inode:
        out.append(f"inode {recorded.inode} -> {st.st_ino}")
    if st.st_dev != recorded.dev:
        out.append(f"device {_devname(recorded.dev)} -> {_devname(st.st_dev)}")
    return out


def _build_id_change(recorded: FileIdentity) -> list[str]:
    """["build-id OLD -> NEW"] if the file's build-id is no longer the recorded one, else []."""
    try:
        now = build_id(recorded.path) or ""
    except (FileNotFoundError, NotADirectoryError):   # removed since the stat
        now = ""
    if now == recorded.build_id:
        return []
    old, new = abbreviate_build_ids(recorded.build_id, now)
    return [f"build-id {old} -> {new or 'none'}"]


def abbreviate_build_ids(a: str, b: str) -> tuple[str, str]:
    """Short forms ("1a2b3c4d5e6f..") of two different build-ids, full ones if those would look alike."""
    short_a, short_b = (_abbrev(x) for x in (a, b))
    if short_a == short_b:
        return a, b
    return short_a, short_b


def _abbrev(hex_id: str) -> str:
    return hex_id[:_ABBREV] + ".." if len(hex_id) > _ABBREV else hex_id


def _devname(dev: int) -> str:
    return f"{os.major(dev)}:{os.minor(dev)}"


# --- path patterns -------------------------------------------------------------

def check_pattern(pattern: str) -> str:
    """`pattern` itself if it is a valid path pattern; ValueError with a one-line reason if not."""
    _compile(pattern)
    return pattern


def path_matches(pattern: str, path: str) -> bool:
    """Whether the absolute `path` matches the glob `pattern` (syntax: the module docstring).

    Raises ValueError for a relative or malformed pattern.  Repeated slashes
    count as one and a trailing slash of `path` is ignored.
    """
    path = re.sub("/+", "/", path)
    if path.endswith("/"):
        path = path[:-1]          # "/" becomes "": the root is zero components
    return _compile(pattern).fullmatch(path) is not None


@functools.lru_cache(maxsize=1024)
def _compile(pattern: str) -> re.Pattern[str]:
    """The regex of `pattern`, matched against a path of "/component" pieces ("" for /)."""
    if not pattern.startswith("/"):
        raise ValueError(f"path pattern {pattern!r} is not absolute (start it with /)")
    parts = re.sub("/+", "/", pattern)[1:].split("/")
    trailing_slash = parts[-1] == ""
    if trailing_slash:
        parts.pop()
    pieces = []
    literal = False
    for part in parts:
        if part == "**":
            pieces.append("(?:/[^/]+)*")
            literal = False
        else:
            regex, literal = _component_regex(part, pattern)
            pieces.append("/" + regex)
    if trailing_slash or literal:        # the pattern names a directory (perhaps): its tree too
        pieces.append("(?:/.*)?")
    try:
        return re.compile("".join(pieces), re.DOTALL)
    except re.error as err:
        raise ValueError(f"bad path pattern {pattern!r}: {err.msg}") from None


def _component_regex(comp: str, pattern: str) -> tuple[str, bool]:
    """(regex, has no wildcard) of one path component of a glob; nothing in it matches '/'."""
    out = []
    literal = True
    i = 0
    while i < len(comp):
        c = comp[i]
        i += 1
        if c == "*" or c == "?":
            out.append("[^/]*" if c == "*" else "[^/]")
            literal = False
        elif c == "\\" and i < len(comp):
            out.append(re.escape(comp[i]))
            i += 1
        elif c == "[" and (cls := _class_regex(comp, i, pattern)):
            out.append(cls[0])
            i = cls[1]
            literal = False
        else:
            out.append(re.escape(c))
    return "".join(out), literal


def _class_regex(comp: str, start: int, pattern: str) -> tuple[str, int] | None:
    """(regex, index after it) of the character class opening at comp[start - 1], None if unclosed.

    '!' or '^' first negates, a ']' first (after the negation) is literal, a
    backslash escapes, '-' between two characters is a range.  The class never
    matches '/'.  An unclosed '[' is a literal '['.
    """
    i = start
    negate = i < len(comp) and comp[i] in "!^"
    if negate:
        i += 1
    body = []
    while i < len(comp) and (comp[i] != "]" or not body):
        if re.match(r"\[:\w+:\]", comp[i:]):
            raise ValueError(f"bad path pattern {pattern!r}: "
                             "POSIX classes like [:alpha:] are not supported")
        c = comp[i]
        if c == "\\" and i + 1 < len(comp):
            i += 1
            body.append(re.escape(comp[i]))
        else:
            body.append("-" if c == "-" and body else re.escape(c))
        i += 1
    if i >= len(comp):
        return None
    return "(?!/)[" + ("^" if negate else "") + "".join(body) + "]", i + 1


# --- policies ------------------------------------------------------------------

class Action(enum.Enum):
    """What a restore does about a file that changed since the dump."""

    STRICT = "strict"    # refuse the restore
    WARN = "warn"        # restore, print a warning
    IGNORE = "ignore"    # restore silently


def parse_action(text: str) -> Action:
    """The Action named `text` (any case, surrounding blanks ignored); ValueError if none is."""
    try:
        return Action(text.strip().lower())
    except ValueError:
        names = ", ".join(a.value for a in Action)
        raise ValueError(f"unknown file policy action {text!r} (use {names})") from None


@dataclass(frozen=True)
class FilePolicy:
    """A default Action and (pattern, Action) rules; the first matching rule wins."""

    default: Action = Action.STRICT
    rules: tuple[tuple[str, Action], ...] = ()

    def __post_init__(self) -> None:
        for pattern, _ in self.rules:
            check_pattern(pattern)

    def decide(self, path: str) -> Action:
        """The Action for a change of the file at `path`."""
        for pattern, action in self.rules:
            if path_matches(pattern, path):
                return action
        return self.default


def parse_policy(values: Sequence[str], default: Action = Action.STRICT) -> FilePolicy:
    """The FilePolicy of the repeated ``--file-policy`` values, in the order given.

    A bare action (strict, warn, ignore) sets the default (the last one wins;
    `default` without any); PATTERN=ACTION adds a rule.  The split is at the
    *last* '=', so a pattern may itself contain '=' (``/srv/a=b/*=warn``), an
    action never does.  A bad value raises ValueError with a one-line message.
    """
    rules = []
    for value in values:
        pattern, eq, action_text = value.rpartition("=")
        try:
            if not eq and value.startswith("/"):
                raise ValueError("a pattern needs an action: PATTERN=strict|warn|ignore")
            if not eq:
                default = parse_action(value)
                continue
            if not pattern:
                raise ValueError("the pattern before '=' is empty")
            rules.append((check_pattern(pattern), parse_action(action_text)))
        except ValueError as err:
            raise ValueError(f"--file-policy {value!r}: {err}") from None
    return FilePolicy(default=default, rules=tuple(rules))


# --- verdict -------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    """Lines "PATH: what changed" of the files that refuse the restore, and of those only warned about."""

    refused: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)   # files open for appending that only grew

    @property
    def ok(self) -> bool:
        """Whether the restore may go on."""
        return not self.refused


def evaluate(identities: Sequence[FileIdentity], policy: FilePolicy) -> Verdict:
    """Compare every recorded file with the file system and sort the changed ones by `policy`.

    Files the policy ignores are not even looked at; a repeated identity (one
    file both mapped and open) gives one line.
    """
    verdict = Verdict()
    for ident in dict.fromkeys(identities):
        action = policy.decide(ident.path)
        if action is Action.IGNORE:
            continue
        what = changes(ident)
        grew = appended(ident) if what else None
        if grew is not None:
            verdict.accepted.append(f"{ident.path}: grew by {grew} bytes, open for appending and its "
                                    f"first {ident.size} bytes unchanged: accepted")
        elif what:
            line = f"{ident.path}: {', '.join(what)}"
            (verdict.refused if action is Action.STRICT else verdict.warnings).append(line)
    return verdict


def refusal_message(refused: Sequence[str]) -> str:
    """One line naming every refused change, and how to restore anyway."""
    return ("files changed since the dump (restore with --file-policy warn or ignore "
            "to go on): " + "; ".join(refused))


class FilesChanged(Incompatible):
    """Files the image uses changed since the dump and the policy is strict about them (restore)."""

    def __init__(self, refused: Sequence[str]):
        super().__init__(refusal_message(refused))
        self.refused = list(refused)

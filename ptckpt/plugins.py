"""The plugin model: third-party code that reacts to dump and restore events.

A plugin is a Python class (subclass :class:`Plugin`, override the events it
cares about), loaded by ``--plugin module:Class``, ``--plugin path/to/file.py[:Class]``
or from the entry point group ``ptckpt.plugins``.  Every event is called for
every process of the tree, plugins in the order given, and an event is over for
every plugin and every process before the next one starts (the barrier):

dump     ``pre_dump``   the tree still runs: ask it to quiesce, drain transactions
         ``busy``       the tree just frozen, nothing captured yet: return why it may
                        not be dumped now (a transaction in flight), or None; the dump
                        thaws it, calls ``pre_dump`` again (the plugin's wait for a quiet
                        moment) and freezes it again, up to ``--critical-timeout``
         ``shared``     a resource held by several processes, offered once with all
                        its holders: return the pid that saves and restores it
         ``frozen``     everything captured: add data to the image (ctx.save),
                        claim connections as external (ctx.claim_external); with
                        --tcp-established the tree's TCP connections are locked since
                        the freeze (ptckpt.netlock), but for those claimed in pre_dump:
                        a plugin that talks over a TCP connection of the tree here
                        claims it there
         ``post_dump``  the tree resumed (or killed)
restore  ``pre_restore`` no process exists yet: read data (ctx.load), check or acquire
                        outside resources, claim external fds, give fds (ctx.install_fd)
         ``restored``   memory, fds and registers in place, nothing has run: read and
                        write memory and registers, inject syscalls, install fds
         ``resumed``    the tree runs

`proc` is a :class:`ProcessHandle` (its pid as ptckpt sees it, the image's pid,
memory by address or symbol, registers per thread, injected syscalls, fds);
`ctx` the plugin's :class:`DumpContext` or :class:`RestoreContext`.  In a group dump or
restore (ptckpt.group: members on several hosts), ``ctx.barrier("name")`` in any event
returns once every member of the group has reached it (``ctx.member`` and ``ctx.members``
name them, WORKER:PID), and ``ctx.elect(ident)`` names the member that saves and restores
a resource several members share (the first to ask); in a dump or restore of one tree
the barrier returns at once and elect() gives "" (this member).  The image
records each plugin used (name, version) with its data; a restore refuses an
image whose plugin is not loaded.  A complete example is in README.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .errors import PluginError, PluginMissing
from .formats.model import Fd, PluginData, ProcessImage
from .tracee import AddressSpace, Regs

ENTRY_POINT_GROUP = "ptckpt.plugins"
DUMP_EVENTS = ("pre_dump", "frozen", "post_dump")
RESTORE_EVENTS = ("pre_restore", "restored", "resumed")


class Plugin:
    """Base class: every event does nothing.  `name` defaults to the class name."""

    name: str = ""
    version: str = "0"
    recorded: bool = True         # the image names it, and a restore needs it loaded

    def pre_dump(self, proc: "ProcessHandle", ctx: "DumpContext") -> None: ...
    def busy(self, proc: "ProcessHandle", ctx: "DumpContext") -> str | None: ...
    def shared(self, resource: "SharedResource", ctx: "DumpContext") -> int | None: ...
    def frozen(self, proc: "ProcessHandle", ctx: "DumpContext") -> None: ...
    def post_dump(self, proc: "ProcessHandle", ctx: "DumpContext") -> None: ...
    def pre_restore(self, proc: "ProcessHandle", ctx: "RestoreContext") -> None: ...
    def restored(self, proc: "ProcessHandle", ctx: "RestoreContext") -> None: ...
    def resumed(self, proc: "ProcessHandle", ctx: "RestoreContext") -> None: ...


def plugin_name(plugin: Plugin) -> str:
    return plugin.name or type(plugin).__name__


# --- loading -----------------------------------------------------------------------

def load_plugin(spec: str) -> Plugin:
    """A plugin instance from `module:Class`, `file.py[:Class]` or an entry point name."""
    try:
        if spec.endswith(".py") or ".py:" in spec:
            path, _, cls_name = spec.partition(".py")
            path += ".py"
            cls_name = cls_name.lstrip(":")
            mod_spec = importlib.util.spec_from_file_location(f"ptckpt_plugin_{abs(hash(path))}", path)
            if mod_spec is None or mod_spec.loader is None or not os.path.exists(path):
                raise PluginError(spec, "load", f"no such file: {path}")
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        elif ":" in spec:
            mod_name, _, cls_name = spec.partition(":")
            module = importlib.import_module(mod_name)
        else:
            return _from_entry_point(spec)
        return _instantiate(spec, module, cls_name)
    except PluginError:
        raise
    except Exception as err:                    # a third party's import error, whatever it is
        raise PluginError(spec, "load", f"{type(err).__name__}: {err}") from err


def _instantiate(spec: str, module, cls_name: str) -> Plugin:
    if cls_name:
        cls = getattr(module, cls_name, None)
        if cls is None:
            raise PluginError(spec, "load", f"{module.__name__} has no {cls_name}")
    else:
        found = [c for _, c in inspect.getmembers(module, inspect.isclass)
                 if issubclass(c, Plugin) and c is not Plugin and c.__module__ == module.__name__]
        if len(found) != 1:
            raise PluginError(spec, "load", f"name the class: {len(found)} Plugin classes in the file")
        cls = found[0]
    plugin = cls()
    for event in DUMP_EVENTS + RESTORE_EVENTS + ("shared",):
        if not callable(getattr(plugin, event, None)):
            raise PluginError(spec, "load", f"{cls.__name__} has no {event}() (subclass ptckpt.plugins.Plugin)")
    return plugin


def _from_entry_point(name: str) -> Plugin:
    from importlib import metadata    # here: about 20 ms of imports a run without plugins skips
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            obj = ep.load()
            return obj() if inspect.isclass(obj) else obj
    raise PluginError(name, "load", f"no entry point {name!r} in group {ENTRY_POINT_GROUP} "
                                    f"(give module:Class or a file path)")


# --- what plugins see ----------------------------------------------------------------

@dataclass
class SharedResource:
    """A resource several processes hold: one open file description (a socket, a pipe end,
    a file) or one shared memory object."""

    kind: str                         # "fd" | "memory"
    ident: object                     # Fd.desc, or the memory object's key
    what: str                         # "socket:[123]", "/dev/zero (deleted)" ...
    holders: list[tuple[int, int]]    # (pid, fd number or mapping address)
    leader: int = 0                   # the pid chosen to save and restore it


class ProcessHandle:
    """One process of the tree, as a plugin sees it during an event.

    Memory access and injection are available when the process is stopped
    (frozen at dump; restored); `image` is its ProcessImage once captured.  In
    pre_restore a plugin may replace `image` (a changed copy: other paths, say),
    and that is what is restored.  Registers set at restore take effect when the
    process runs; at dump they are read only.
    """

    def __init__(self, pid: int, vpid: int, image: ProcessImage | None = None, *,
                 tasks: dict | None = None, remote_scope: Callable | None = None,
                 fd_installer: Callable | None = None, reg_overrides: dict | None = None,
                 breakpoints: list | None = None):
        self.pid = pid                    # as ptckpt sees it
        self.vpid = vpid                  # the image's pid (what the process sees)
        self.image = image
        self._tasks = tasks or {}
        self._remote_scope = remote_scope
        self._install = fd_installer
        self._regs = reg_overrides if reg_overrides is not None else {}
        self._breakpoints = breakpoints
        self._symbols = None

    def __repr__(self) -> str:
        return f"<process {self.vpid} (pid {self.pid})>"

    @property
    def fds(self) -> tuple[Fd, ...]:
        return self.image.fds if self.image else ()

    @property
    def tids(self) -> list[int]:
        return list(self._tasks) or ([t.tid for t in self.image.threads] if self.image else [])

    # memory
    def read(self, addr: int, size: int) -> bytes:
        with AddressSpace(self.pid) as mem:
            return mem.read(addr, size)

    def write(self, addr: int, data: bytes) -> None:
        with AddressSpace(self.pid) as mem:
            mem.write(addr, data)

    def symbol(self, expr: str) -> int:
        """The address of `expr`: "name", "name+16", "libc.so.6:environ" or "0x7f...", resolved
        over the mapped executable and libraries (PIE and ASLR applied)."""
        return self._table().resolve(expr)

    def symbol_extent(self, expr: str) -> tuple[int, int]:
        """(address, bytes of the symbol's object from there on, 0 if unknown) of `expr`."""
        return self._table().extent(expr)

    def read_symbol(self, expr: str, size: int) -> bytes:
        return self.read(self.symbol(expr), size)

    def write_symbol(self, expr: str, data: bytes) -> None:
        self.write(self.symbol(expr), data)

    def _table(self):
        from . import symbols
        if self._symbols is None:
            self._symbols = symbols.SymbolTable.for_process(self.pid)
        return self._symbols

    def environ(self) -> list[bytes]:
        """The process's environment as getenv() sees it (libc's `environ`)."""
        from . import symbols
        with AddressSpace(self.pid) as mem:
            return symbols.read_environ(mem, self._table())

    def set_environ(self, env: Sequence[bytes]) -> None:
        """Give the process environment `env` (stopped processes only: memory is mapped by an
        injected mmap, then `environ` points to the new array)."""
        from . import symbols
        if self._remote_scope is None:
            raise PluginError("-", "set_environ", f"process {self.vpid} is not stopped in this event")
        with AddressSpace(self.pid) as mem, self._remote_scope() as remote:
            symbols.write_environ(remote, mem, self._table(), list(env))

    def fd_copy(self, number: int) -> int:
        """A copy, in ptckpt, of the process's fd `number` (pidfd_getfd); the caller closes it."""
        from .tracee import pidfd_getfd
        return pidfd_getfd(self.pid, number)

    # registers
    def registers(self, tid: int | None = None) -> dict[str, int]:
        """The thread's registers (the leader's by default) as they will be when it runs."""
        tid = tid or self.vpid
        if tid in self._regs:
            return dict(self._regs[tid])
        task = self._tasks.get(tid)
        if task is not None and self.image is None:
            return _regs_dict(task.get_regs())
        thread = next((t for t in self.image.threads if t.tid == tid), None) if self.image else None
        if thread is None:
            raise PluginError("-", "registers", f"process {self.vpid} has no thread {tid}")
        from .formats.model import GP_REG_NAMES
        return dict(zip(GP_REG_NAMES, thread.regs))

    def set_registers(self, tid: int | None = None, **values: int) -> None:
        tid = tid or self.vpid
        regs = self.registers(tid)
        unknown = set(values) - set(regs)
        if unknown:
            raise PluginError("-", "set_registers", f"no such registers: {', '.join(sorted(unknown))}")
        regs.update(values)
        self._regs[tid] = regs

    # breakpoints
    def break_at(self, expr: str, callback: Callable) -> None:
        """restored: stop at `expr` (a function: "name", "lib:name", an address) each time it
        is reached once the process runs; `callback(hit)` (ptckpt.breakpoints.Hit: the call's
        number, its registers and arguments to change, on_return) returns True to go on
        counting, False when done.  Once no breakpoint is left the process runs untraced."""
        from .breakpoints import Breakpoint
        if self._breakpoints is None:
            raise PluginError("-", "break_at", f"breakpoints are set in the restored event "
                                               f"(process {self.vpid})")
        self._breakpoints.append(Breakpoint(self.symbol(expr), callback, expr))

    # injected syscalls and fds
    def syscall(self, name: str, *args: int) -> int:
        """Run one syscall inside the process (its leader thread); returns the raw result."""
        if self._remote_scope is None:
            raise PluginError("-", "syscall", f"process {self.vpid} is not stopped in this event")
        with self._remote_scope() as remote:
            return remote.syscall(name, *args)

    def install_fd(self, number: int, local_fd: int) -> None:
        """Give the process a copy of ptckpt's fd `local_fd` at fd `number` (replacing one)."""
        if self._install is None:
            raise PluginError("-", "install_fd", f"fds cannot be installed in process {self.vpid} "
                                                 f"in this event")
        self._install(self.vpid, number, local_fd)


def _regs_dict(regs: Regs) -> dict[str, int]:
    from .formats.model import GP_REG_NAMES
    return dict(zip(GP_REG_NAMES, regs.values()))


@dataclass
class _Context:
    plugin: Plugin
    directory: str
    resources: list[SharedResource] = field(default_factory=list)
    group: object = None          # ptckpt.group.Barrier of a group dump or restore, else None

    @property
    def name(self) -> str:
        return plugin_name(self.plugin)

    @property
    def member(self) -> str:
        """This member of the group (WORKER:PID), "" outside a group."""
        return self.group.me if self.group is not None else ""

    @property
    def members(self) -> list[str]:
        """Every member of the group (WORKER:PID, in the group's order), [] outside a group."""
        return list(self.group.members) if self.group is not None else []

    def barrier(self, name: str) -> None:
        """Return once every member of the group has reached barrier `name` (at once outside
        a group); raises if another member failed or one did not come in time."""
        if self.group is not None:
            self.group.wait(f"plugin-{self.name}-{name}")

    def elect(self, ident: str) -> str:
        """The member (WORKER:PID) that saves and restores `ident`, a resource members of
        the group on several hosts share (an emulator's connection): the first to ask, the
        same answer for every member; outside a group "" (ctx.member: this one)."""
        return self.group.elect(f"{self.name}-{ident}") if self.group is not None else ""

    def leader(self, ident: object) -> int:
        """The pid chosen to save and restore the shared resource `ident` (0: not shared)."""
        return next((r.leader for r in self.resources if r.ident == ident), 0)


@dataclass
class DumpContext(_Context):
    data: list[PluginData] = field(default_factory=list)
    external: dict[tuple[int, int], str] = field(default_factory=dict)

    def save(self, data: bytes, key: str = "", pid: int = 0) -> None:
        """Put `data` into the image under (this plugin, pid, key)."""
        self.data.append(PluginData(name=self.name, version=str(self.plugin.version), pid=pid, key=key,
                                    data=bytes(data)))

    def claim_external(self, pid: int, fd: int, note: str = "") -> None:
        """fd `fd` of `pid` leads outside the checkpoint: not saved, and a restore needs a
        plugin to claim it (and give the process a new one)."""
        self.external[(pid, fd)] = note or self.name


@dataclass
class RestoreContext(_Context):
    data: list[PluginData] = field(default_factory=list)
    claimed: set[tuple[int, int]] = field(default_factory=set)
    installs: list[tuple[int, int, int]] = field(default_factory=list)     # (pid, number, local fd)
    moved_dirs: list[str] = field(default_factory=list)
    binds: list[tuple[str, str]] = field(default_factory=list)

    def load(self, key: str = "", pid: int = 0) -> bytes | None:
        """What this plugin saved under (pid, key) at dump, or None."""
        return next((d.data for d in self.data if d.name == self.name and d.pid == pid and d.key == key),
                    None)

    def claim_external(self, pid: int, fd: int) -> None:
        """This plugin takes care of external fd `fd` of `pid` (it installs a new one)."""
        self.claimed.add((pid, fd))

    def install_fd(self, pid: int, number: int, local_fd: int) -> None:
        """pre_restore: process `pid` (the image's pid) gets a copy of `local_fd` at `number`
        when it is created (ptckpt keeps its own copy until then)."""
        self.installs.append((pid, number, os.dup(local_fd)))

    def moved(self, directory: str) -> None:
        """pre_restore, after changing paths in proc.image: the files now under `directory`
        are other files by design; they must exist, but the changed-file policy skips them."""
        self.moved_dirs.append(directory)

    def bind_mount(self, source: str, target: str) -> None:
        """pre_restore: the tree runs in a private mount namespace with `source` bind-mounted
        on `target` (made in the root before any other process exists)."""
        self.binds.append((source, target))


# --- running events ----------------------------------------------------------------

class Plugins:
    """The loaded plugins and their contexts for one dump or restore."""

    def __init__(self, plugins: Sequence[Plugin], directory: str, *, restore: bool = False,
                 data: Sequence[PluginData] = (), group=None):
        self.plugins = list(plugins)
        cls = RestoreContext if restore else DumpContext
        self.contexts = [cls(plugin=p, directory=directory, group=group) for p in self.plugins]
        if restore:
            for ctx in self.contexts:
                ctx.data = [d for d in data if d.name == ctx.name]
        self.resources: list[SharedResource] = []

    def __bool__(self) -> bool:
        return bool(self.plugins)

    def run(self, event: str, handles: Sequence[ProcessHandle]) -> None:
        """`event` for every plugin and every process (the barrier: all of it, then return)."""
        for plugin, ctx in zip(self.plugins, self.contexts):
            for handle in handles:
                self.call(plugin, ctx, event, handle)

    def call(self, plugin: Plugin, ctx, event: str, handle: ProcessHandle) -> None:
        try:
            getattr(plugin, event)(handle, ctx)
        except PluginError:
            raise
        except Exception as err:
            raise PluginError(plugin_name(plugin), event,
                              f"process {handle.vpid}: {type(err).__name__}: {err}") from err

    def busy(self, handles: Sequence[ProcessHandle]) -> tuple[str, str] | None:
        """(plugin name, why) of the first plugin that says a frozen process may not be
        dumped now (its `busy` event), or None when every one lets the dump go on."""
        for plugin, ctx in zip(self.plugins, self.contexts):
            for handle in handles:
                try:
                    why = plugin.busy(handle, ctx) if hasattr(plugin, "busy") else None
                except Exception as err:
                    raise PluginError(plugin_name(plugin), "busy",
                                      f"process {handle.vpid}: {type(err).__name__}: {err}") from err
                if why:
                    return plugin_name(plugin), f"process {handle.vpid}: {why}"
        return None

    def elect(self, resources: Sequence[SharedResource]) -> None:
        """Offer each shared resource once; the first plugin that names a holder decides."""
        for res in resources:
            res.leader = res.holders[0][0]
            for plugin, ctx in zip(self.plugins, self.contexts):
                try:
                    chosen = plugin.shared(res, ctx)
                except Exception as err:
                    raise PluginError(plugin_name(plugin), "shared", f"{res.what}: {err}") from err
                if chosen:
                    if chosen not in {p for p, _ in res.holders}:
                        raise PluginError(plugin_name(plugin), "shared",
                                          f"{res.what}: {chosen} does not hold it")
                    res.leader = chosen
                    break
        self.resources = list(resources)
        for ctx in self.contexts:
            ctx.resources = self.resources

    # dump results
    def image_records(self) -> list[PluginData]:
        """One record per plugin used (its name and version, no key), then its data."""
        out = [PluginData(name=plugin_name(p), version=str(p.version), pid=-1, key="", data=b"")
               for p in self.plugins if getattr(p, "recorded", True)]
        for ctx in self.contexts:
            out += ctx.data
        return out

    def external(self) -> dict[tuple[int, int], str]:
        out: dict[tuple[int, int], str] = {}
        for ctx in self.contexts:
            out.update(ctx.external)
        return out

    # restore checks
    def claimed(self) -> set[tuple[int, int]]:
        return set().union(*(ctx.claimed for ctx in self.contexts)) if self.contexts else set()

    def installs(self) -> list[tuple[int, int, int]]:
        return [i for ctx in self.contexts for i in ctx.installs]

    def moved(self) -> list[str]:
        return [d for ctx in self.contexts for d in ctx.moved_dirs]

    def bind_mounts(self) -> list[tuple[str, str]]:
        return [b for ctx in self.contexts for b in ctx.binds]


def required(records: Sequence[PluginData]) -> list[tuple[str, str]]:
    """(name, version) of each plugin an image was made with."""
    return [(r.name, r.version) for r in records if r.pid == -1]


def check_present(records: Sequence[PluginData], plugins: Sequence[Plugin]) -> None:
    have = {plugin_name(p) for p in plugins}
    for name, version in required(records):
        if name not in have:
            raise PluginMissing(name, version)


# --- giving a restored process an fd of ptckpt's -------------------------------------

_MSGHDR = struct.Struct("<QI4xQQQQi4x")      # struct msghdr (x86_64): 56 bytes
_IOVEC = struct.Struct("<QQ")
_CMSG = struct.Struct("<QiI")                 # cmsghdr: len, level, type; then the int
SOL_SOCKET, SCM_RIGHTS = 1, 1


def receive_fd_frozen(remote, channel: int, number: int, *, cloexec: bool = False) -> None:
    """Inside the restored process: recvmsg() one fd from `channel` (SCM_RIGHTS, sent by
    ptckpt just before) and dup3() it to `number`."""
    with remote.scratch(8) as byte, remote.scratch(24) as cmsg:
        with remote.scratch(_IOVEC.pack(int(byte), 1)) as iov:
            with remote.scratch(_MSGHDR.pack(0, 0, int(iov), 1, int(cmsg), 24, 0)) as msg:
                remote.checked("recvmsg", channel, int(msg), 0, step=f"receive fd {number} from ptckpt")
        length, level, kind = _CMSG.unpack(remote.mem.read(cmsg, 16))
        if level != SOL_SOCKET or kind != SCM_RIGHTS or length < 20:
            raise PluginError("-", "install_fd", "ptckpt's fd did not arrive")
        got = struct.unpack("<i", remote.mem.read(int(cmsg) + 16, 4))[0]
    if got != number:
        remote.checked("dup3", got, number, 0o2000000 if cloexec else 0, step=f"install fd {number}")
        remote.checked("close", got, step=f"install fd {number}")
    elif cloexec:
        remote.checked("fcntl", number, 2, 1, step=f"set FD_CLOEXEC on fd {number}")    # F_SETFD

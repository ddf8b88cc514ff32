"""The package's layering (README, Layout): the graph of ptckpt's imports of its own modules
has no cycle, counting the imports made inside functions as well as those at module level,
and the CLI reaches the library only through ptckpt.api.

The graph is read from the sources with `ast`, nothing is imported: every ``import
ptckpt.x``, ``from ptckpt.x import ...``, ``from . import x`` and ``from .x import ...``,
at any depth (a function's lazy import is an edge too: it is as much a dependency, only
paid later), except under ``if TYPE_CHECKING:`` (annotations only, never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the installed package -> its directory in the repository (pyproject's package-dir)
PACKAGES = {"ptckpt": "ptckpt", "ptckpt.resources": "ptckpt/resources", "ptckpt.pipeline": "ptckpt/pipeline",
            "ptckpt.formats": "formats", "ptckpt.restorer": "restorer"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, is a package's __init__)."""
    found = {}
    for package, directory in PACKAGES.items():
        for path in sorted((ROOT / directory).glob("*.py")):
            init = path.name == "__init__.py"
            found[package if init else f"{package}.{path.stem}"] = (path, init)
    return found


MODULES = _modules()


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _resolve(module: str, is_init: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_init else module.rpartition(".")[0]
    parts = package.split(".")
    base = ".".join(parts[:len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def imports_of(module: str) -> dict[str, int]:
    """The package's modules `module` imports -> the line of the first such import."""
    path, is_init = MODULES[module]
    edges: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target in MODULES and target != module:
            edges.setdefault(target, line)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.ImportFrom):
                target = _resolve(module, is_init, child)
                for alias in child.names:
                    if f"{target}.{alias.name}" in MODULES:     # from . import x: the submodule x
                        add(f"{target}.{alias.name}", child.lineno)
                    else:
                        add(target, child.lineno)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child.lineno)
            visit(child)
    visit(ast.parse(path.read_text(), str(path)))
    return edges


GRAPH = {m: imports_of(m) for m in MODULES}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a cycle
    through its modules when one is found by walking the component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def _path(graph, start: str, members: set[str]) -> list[str]:
    """One cycle from `start` inside a component, for the failure message."""
    seen = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                return seen[v] + [start]
            if w in members and w not in seen:
                seen[w] = seen[v] + [w]
                todo.append(w)
    return [start]


def test_the_graph_is_read():
    assert {"ptckpt.api", "ptckpt.cli", "ptckpt.dump", "ptckpt.restore", "ptckpt.resources.memory",
            "ptckpt.formats.image", "ptckpt.restorer.stub"} <= set(MODULES)
    assert "ptckpt.dump" in GRAPH["ptckpt.api"], "a function-level import is an edge"
    assert "ptckpt.resources.pids" in GRAPH["ptckpt.restore"]
    assert "ptckpt.formats.model" in GRAPH["ptckpt.resources.memory"], "from ..formats.model import"


def test_every_package_is_read():
    """A subpackage (a directory with an __init__.py) under the package's directories is in
    PACKAGES, so that neither the import graph nor the checks below miss its modules."""
    found = {str(init.parent.relative_to(ROOT)) for directory in set(PACKAGES.values())
             for init in (ROOT / directory).rglob("__init__.py")}
    assert found <= set(PACKAGES.values()), f"not in PACKAGES: {sorted(found - set(PACKAGES.values()))}"


def test_no_import_cycles():
    """Module-level and function-level imports together are acyclic: a lazy import is no
    licence to import upwards (README, Layout)."""
    found = []
    for component in _cycles(GRAPH):
        cycle = _path(GRAPH, component[0], set(component))
        found.append(" -> ".join(f"{a} (line {GRAPH[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}")
    assert not found, "import cycles:\n" + "\n".join(found)


@pytest.mark.parametrize("module", ["ptckpt.dump", "ptckpt.restore", "ptckpt.resources"])
def test_the_cli_reaches_the_library_through_the_api_only(module):
    below = [m for m in GRAPH["ptckpt.cli"] if m == module or m.startswith(module + ".")]
    assert not below, f"ptckpt/cli.py imports {below}: go through ptckpt.api"


def test_the_command_state_imports_nothing_of_ptckpt():
    assert GRAPH["ptckpt.state"] == {}
    for library in ("ptckpt.dump", "ptckpt.restore"):
        assert not {"ptckpt.entry", "ptckpt.cli", "ptckpt.api"} & set(GRAPH[library]), library


def test_campaign_types_stand_apart_from_the_backends():
    assert not {"ptckpt.campaign", "ptckpt.cluster", "ptckpt.report"} & set(GRAPH["ptckpt.campaign_types"])
    assert "ptckpt.campaign" not in GRAPH["ptckpt.cluster"]
    assert "ptckpt.campaign" not in GRAPH["ptckpt.report"]


def test_nothing_imports_dump_restore_or_stop_as_a_package_attribute():
    """``from . import restore`` (or ``from ptckpt import dump``) gives the API's function,
    not the module (the package keeps those names for ptckpt.api): import from the module."""
    bad = []
    for module, (path, _init) in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and _resolve(module, _init, node) == "ptckpt":
                bad += [f"{module}: from {'.' * node.level or 'ptckpt'} import {a.name}" for a in node.names
                        if a.name in ("dump", "restore", "stop")]
    assert not bad


# --- issue 33: short functions, and ptrace behind the tracee layer --------------------------

LONGEST_FUNCTION = 80


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_over_80_lines():
    """Every function and method of ptckpt/, formats/ and restorer/ fits in 80 lines (from its
    ``def`` to its last line, decorators aside): a longer one is split into helpers of one
    job each."""
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for module, (path, _init) in MODULES.items() for node in _functions(path)
            if node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION]
    assert not long, f"functions over {LONGEST_FUNCTION} lines:\n" + "\n".join(long)


LONGEST_STAGE = 60


def test_no_function_of_the_pipelines_over_60_lines():
    """The stages of ptckpt/pipeline/ (and their helpers) are shorter still: 60 lines."""
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for module, (path, _init) in MODULES.items() if module.startswith("ptckpt.pipeline")
            for node in _functions(path) if node.end_lineno - node.lineno + 1 > LONGEST_STAGE]
    assert any(m.startswith("ptckpt.pipeline.") for m in MODULES), "the pipeline modules are read"
    assert not long, f"functions of the pipelines over {LONGEST_STAGE} lines:\n" + "\n".join(long)


TRACEE_LAYER = "ptckpt.tracee"


def _ptrace_uses(path: Path) -> list[str]:
    """What in a module speaks ptrace itself: a name (or attribute, or imported name) that
    is a PTRACE_ constant, a call of a function named ptrace, an import of python-ptrace,
    or a write to a Task's ``stop`` or ``seized``.  Docstrings and comments may name them."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name) and node.id.startswith("PTRACE_"):
            found.append(f"line {line}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("PTRACE_"):
            found.append(f"line {line}: .{node.attr}")
        elif isinstance(node, ast.alias) and (node.asname or node.name).split(".")[-1].startswith("PTRACE_"):
            found.append(f"line {line}: import {node.name}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in ("ptrace", "_ptrace"):
                found.append(f"line {line}: {name}(...)")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"line {line}: imports {n}" for n in names if n == "ptrace" or n.startswith("ptrace.")]
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"line {line}: sets .{t.attr}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr in ("stop", "seized")
                      and not (isinstance(t.value, ast.Name) and t.value.id == "self")]
    return found


def test_the_ptrace_detector_sees_what_it_should(tmp_path):
    import textwrap
    sample = textwrap.dedent('''
        """PTRACE_SEIZE in a docstring is fine."""
        from ptrace.binding import func
        from .tracee import PTRACE_O_TRACESYSGOOD
        X = PTRACE_SINGLESTEP
        _libc.ptrace(9, 1, None, None)
        task.stop = None
        task.seized = True
        ''')
    path = tmp_path / "sample.py"
    path.write_text(sample)
    found = _ptrace_uses(path)
    assert len(found) == 6, found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != TRACEE_LAYER))
def test_only_the_tracee_layer_speaks_ptrace(module):
    """DESIGN.md's layer 1: ptckpt/tracee.py alone names PTRACE_ constants, calls ptrace,
    imports python-ptrace and keeps a Task's stop and seized state; the others ask its
    Task, Session and remote_syscalls."""
    found = _ptrace_uses(MODULES[module][0])
    assert not found, f"{module} speaks ptrace itself (go through ptckpt.tracee):\n" + "\n".join(found)


# --- issue 33: the table of resource kinds (resources/registry.py) --------------------------

STAGE_MODULES = ["ptckpt.dump", "ptckpt.restore"] + sorted(m for m in MODULES if m.startswith("ptckpt.pipeline"))
# A kind's own work: functions named so, of a module that has a row in the registry.
KIND_WORK = ("dump_", "create_", "open_", "restore_", "install_", "reopen_", "put_back_", "make_", "capture_",
             "scan_", "close_")
# What the pipelines and stage helpers still do of a kind themselves, and why.
DONE_OUTSIDE_THE_TABLE = {
    # per process, into its ProcessImage's own fields, inside capture_process_frozen's injection scope
    ("ptckpt.dump", "files", "dump_fds"): "a process's fds: what every row then reads",
    ("ptckpt.dump", "files", "dump_owners"): "a process's fd owners (ProcessImage.owners)",
    ("ptckpt.dump", "locks", "dump_process_locks"): "a process's locks (ProcessImage.locks)",
    ("ptckpt.dump", "aio", "dump_aio_rings_frozen"): "a process's aio rings, read through its memory",
    ("ptckpt.dump", "memory", "dump_vmas"): "the address space, not a kind of the table",
    # the address space and the tree of processes, not kinds of the table
    ("ptckpt.restore", "memory", "restore_vmas_frozen"): "the address space",
    ("ptckpt.restore", "terminals", "make_controlling_tty_frozen"): "the sessions of the tree of stubs",
    # made at other points of the restore than the hand-off
    ("ptckpt.pipeline.restore", "files", "put_back_saved_files"): "before the hand-off, outside --netns",
    ("ptckpt.pipeline.restore", "pidfds", "create_pidfds"): "once every process and zombie exists",
}


def _registry():
    from ptckpt.resources import registry
    return registry


def _calls_of_modules(module: str) -> set[tuple[str, str]]:
    """(resources module, function) of every call `module.function(...)` in `module`, where
    the first name is a resources module it imported."""
    path, is_init = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _resolve(module, is_init, node) in ("ptckpt.resources",
                                                                                  "ptckpt"):
            for alias in node.names:
                if f"ptckpt.resources.{alias.name}" in MODULES:
                    names[alias.asname or alias.name] = alias.name
    return {(names[n.func.value.id], n.func.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id in names}


def test_every_row_has_an_operation_or_a_refusal():
    registry = _registry()
    rows = list(registry.table())
    assert len({row.name for row in rows}) == len(rows), "row names are unique"
    for row in rows:
        assert row.operations or row.refusal, row.name
    for row in registry.ROWS:
        assert f"ptckpt.resources.{row.module}" in MODULES, row
        assert all(f"ptckpt.resources.{m}" in MODULES for m in row.parts), row
        assert row.install is None or row.install_at in registry.INSTALL_POINTS, row
    refused = [row for row in rows if row.refusal]
    assert refused and all(not row.operations for row in refused)


def test_the_orders_of_the_dump_name_every_capturing_row_once():
    registry = _registry()
    capturing = [row.name for row in registry.ROWS if row.capture is not None]
    assert sorted(registry.CAPTURE_ORDER) == sorted(capturing)
    writing = [row.name for row in registry.ROWS if row.records]
    assert sorted(registry.IMAGE_ORDER) == sorted(writing + ["plugins"])
    assert set(writing) <= set(capturing), "a row writes only what it captures"
    owners = [t for row in registry.ROWS for t in row.records]
    assert len(owners) == len(set(owners)), "each image record is one row's"


@pytest.mark.parametrize("module", STAGE_MODULES)
def test_the_stages_reach_the_kinds_through_the_registry(module):
    """The pipelines and the stage helpers (dump.py, restore.py) do no kind's own work but
    through resources/registry.py: they call none of the functions a row's operations call,
    and no other function of a kind's module that captures, makes or installs one, but
    those listed above with the reason they are done outside the table."""
    registry = _registry()
    through = {call for call in _calls_of_modules("ptckpt.resources.registry") if call[1].startswith(KIND_WORK)}
    assert len(through) > 30, "the registry's operations are read"
    kinds_modules = {m for row in registry.ROWS for m in (row.module, *row.parts)}
    calls = _calls_of_modules(module)
    bypassing = sorted(calls & through)
    assert not bypassing, f"{module} calls a row's operation itself (go through resources.registry): {bypassing}"
    own = sorted((m, f) for m, f in calls if m in kinds_modules and f.startswith(KIND_WORK)
                 and (module, m, f) not in DONE_OUTSIDE_THE_TABLE)
    assert not own, f"{module} does a kind's work itself (a row's operation, or DONE_OUTSIDE_THE_TABLE): {own}"


def test_what_is_done_outside_the_table_is_still_so():
    """DONE_OUTSIDE_THE_TABLE lists only calls that are there: moved into the table, a line goes."""
    stale = [key for key in DONE_OUTSIDE_THE_TABLE if key[1:] not in _calls_of_modules(key[0])]
    assert not stale, stale


# --- issue 33: /proc is read through ptckpt/procfs.py --------------------------------------

PROCFS_LAYER = "ptckpt.procfs"


def _proc_paths(path: Path) -> list[tuple[str, int, str]]:
    """(function, line, text) of each /proc path a module names: a string or bytes constant,
    or an f-string whose leading text, starting with "/proc", is a path (no whitespace in
    its literal parts: a message that names a /proc file is not a read).  `function` is the
    qualified name of the innermost def ("Class.method", "outer.inner"), "" at module level.
    A parameter's default "/proc" (a procfs root handed on to procfs.py) is not counted;
    docstrings are not."""
    found: list[tuple[str, int, str]] = []

    def literal(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            return node.value if isinstance(node.value, str) else node.value.decode("latin-1")
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            return "".join(v.value for v in node.values if isinstance(v, ast.Constant))
        return None

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = f"{where}.{node.name}" if where else node.name
        text = literal(node)
        if text is not None:
            if text.startswith("/proc") and not any(c.isspace() for c in text):
                found.append((where, node.lineno, ast.unparse(node)))
            return
        skip = set()
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
            skip.add(id(body[0]))
        if isinstance(node, ast.arguments):
            skip |= {id(d) for d in [*node.defaults, *node.kw_defaults]
                     if isinstance(d, ast.Constant) and d.value == "/proc"}
        for child in ast.iter_child_nodes(node):
            if id(child) not in skip:
                visit(child, where)

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def test_the_proc_detector_sees_what_it_should(tmp_path):
    import textwrap
    sample = textwrap.dedent('''
        """/proc/self/maps in a docstring is fine."""
        def read(pid, procfs_root="/proc"):
            """Nor /proc/PID/stat here."""
            open(f"/proc/{pid}/stat")
            raise ValueError(f"/proc/{pid}/ns/x, a kind of namespace not known")
        class K:
            def m(self):
                def inner():
                    return os.listdir("/proc")
                return b"/proc/self/loginuid\\0", "/dev/null"
        ''')
    path = tmp_path / "sample.py"
    path.write_text(sample)
    assert [(w, t) for w, _line, t in _proc_paths(path)] == [
        ("read", "f'/proc/{pid}/stat'"), ("K.m.inner", "'/proc'"), ("K.m", "b'/proc/self/loginuid\\x00'")]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != PROCFS_LAYER))
def test_only_procfs_reads_proc(module):
    """ptckpt/procfs.py alone knows /proc's files and formats: another module names a /proc
    path only in a (module, function) procfs.ELSEWHERE lists with its reason (a write, a
    file opened again through its link ...)."""
    from ptckpt import procfs
    found = [f"line {line} in {where or 'module level'}: {text}"
             for where, line, text in _proc_paths(MODULES[module][0])
             if (module, where) not in procfs.ELSEWHERE]
    assert not found, (f"{module} reads /proc itself (use a reader of ptckpt.procfs, or list the place "
                       "in procfs.ELSEWHERE with why):\n" + "\n".join(found))


def test_what_else_touches_proc_is_still_there():
    """procfs.ELSEWHERE lists only places that still name a /proc path: one moved behind
    procfs.py loses its line."""
    from ptckpt import procfs
    named = {(module, where) for module, (path, _init) in MODULES.items() for where, _l, _t in _proc_paths(path)}
    stale = sorted(set(procfs.ELSEWHERE) - named)
    assert not stale, stale

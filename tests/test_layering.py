"""The house rules of kvd's tree, read off the code with `ast` (no import is executed).

- `kvd.wire` imports nothing of kvd but itself and `kvd.errors`, and no sockets, asyncio,
  ZeroMQ or torch: both processes use it.
- the daemon never imports the client library, parallel or integrations, nor torch (a GPU pool
  reaches torch through `kvd.memory.cuda` only); the client never imports the daemon.
- `kvd.daemon.store` is pure bookkeeping: no asyncio, no ZeroMQ, nothing else of the daemon.
- no two kvd modules import each other in a circle (imports inside functions and under
  TYPE_CHECKING count: they are dependencies at run time);
- no module is over 450 lines, and at most about 8 plain modules sit directly under kvd/.
- rooms say what they hold: every module's basename is unique in kvd/ (`__init__.py` aside), no
  folder holds more than 12 modules, and `kvd/daemon/`'s top level is the process shell only (the
  local side, the tier, the peers, the transfer machine, the planes and the store have folders).
- the transfer machine (`kvd.daemon.transfer`) and the tier's and disk level's bookkeeping are pure
  like the store: no asyncio, no ZeroMQ, no sockets; so is the local side's core (`kvd.daemon.local`'s
  ledger, events, books, audit and reservation), which may import only the store, the page store, the wire,
  the errors and the table engine.
- test doubles live in `kvd.testing`, and nothing in kvd but `kvd.testing` imports it.
- one table engine: `kvd.statetable` alone defines a table's row, guard or table class, every state
  machine's table is built on it (the transfers, a link's handshake, a local write), and it is pure
  (no asyncio, ZeroMQ, sockets or threads; nothing of kvd but its errors).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvd"
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """Every module `name` imports, anywhere in its body: kvd modules resolved, others as written."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                candidate = f"{source}.{alias.name}"
                found.add(candidate if candidate in MODULES else source)
    return found


IMPORTS = {name: imports_of(name) for name in MODULES}


def kvd_imports(name: str) -> set[str]:
    return {i for i in IMPORTS[name] if i == "kvd" or i.startswith("kvd.")}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def top(name: str) -> str:
    return name.split(".")[0]


def test_the_modules_are_found():
    assert {"kvd.wire.protocol", "kvd.daemon.daemon", "kvd.client.sync", "kvd.daemon.transfer.machine"} <= set(MODULES)


@pytest.mark.parametrize("name", [n for n in MODULES if within(n, "kvd.wire")])
def test_wire_is_pure(name):
    for imported in IMPORTS[name]:
        if within(imported, "kvd"):
            assert within(imported, "kvd.wire") or imported == "kvd.errors", (name, imported)
        else:
            assert top(imported) not in {"zmq", "asyncio", "socket", "torch", "numpy"}, (name, imported)


@pytest.mark.parametrize("name", [n for n in MODULES if within(n, "kvd.daemon")])
def test_the_daemon_never_imports_the_client_nor_torch(name):
    for imported in IMPORTS[name]:
        for banned in ("kvd.client", "kvd.parallel", "kvd.integrations", "kvd.sharded", "kvd.memory.cuda"):
            assert not within(imported, banned), (name, imported)
        assert top(imported) not in {"torch", "numpy", "cupy"}, (name, imported)


@pytest.mark.parametrize("name", [n for n in MODULES if within(n, "kvd.client")])
def test_the_client_never_imports_the_daemon(name):
    for imported in kvd_imports(name):
        assert not within(imported, "kvd.daemon"), (name, imported)


@pytest.mark.parametrize("name", [n for n in MODULES if within(n, "kvd.daemon.store")])
def test_the_store_is_pure_bookkeeping(name):
    for imported in IMPORTS[name]:
        assert top(imported) not in {"asyncio", "zmq", "socket", "torch"}, (name, imported)
        if within(imported, "kvd.daemon"):
            assert within(imported, "kvd.daemon.store"), (name, imported)


@pytest.mark.parametrize("name", [n for n in MODULES if within(n, "kvd.memory") and n != "kvd.memory.cuda"])
def test_memory_reaches_torch_only_through_cuda(name):
    for imported in IMPORTS[name]:
        assert top(imported) not in {"torch", "cupy", "zmq", "asyncio"}, (name, imported)
        if within(imported, "kvd"):
            assert any(within(imported, ok) for ok in ("kvd.memory", "kvd.wire", "kvd.errors", "kvd.units")), \
                (name, imported)


@pytest.mark.parametrize("name", [n for n in MODULES if within(n, "kvd.parallel") or within(n, "kvd.integrations")
                                  or within(n, "kvd.cluster")])
def test_the_libraries_never_import_the_daemon(name):
    for imported in kvd_imports(name):
        assert not within(imported, "kvd.daemon"), (name, imported)
        if within(name, "kvd.parallel"):
            assert not within(imported, "kvd.client"), (name, imported)


def test_no_import_circles():
    graph = {name: {i for i in kvd_imports(name) if i in MODULES and i != name} for name in MODULES}
    cycles, index, low, stack, on_stack, counter = [], {}, {}, [], set(), [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    assert not cycles, f"modules that import each other in a circle: {cycles}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_450_lines(name):
    source = MODULES[name].read_text()
    # an import wrapped one name a line (isort's only wrapping) counts as one line
    wrapped = sum(node.end_lineno - node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.Import, ast.ImportFrom)) and node.end_lineno)
    lines = len(source.splitlines()) - wrapped
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES}: split it along a seam)"


def test_at_most_about_eight_plain_modules_directly_under_kvd():
    plain = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(plain) <= 8, plain


def test_every_module_says_which_process_it_runs_in():
    for name, path in MODULES.items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "process" in doc, f"{name}'s docstring does not say which process it runs in"


MAX_MODULES_PER_FOLDER = 12
DAEMON_SHELL = {"config", "daemon", "exposure", "http", "lifecycle", "logs", "membership", "metrics",
                "socket_path", "startup", "status", "systemd"}
PURE = ("kvd.daemon.transfer", "kvd.daemon.store.page_store", "kvd.daemon.store.tier_events",
        "kvd.daemon.tier.disk.disk_format", "kvd.daemon.tier.disk.disk_index")
PURE_MAY_IMPORT = ("kvd.daemon.transfer", "kvd.daemon.store", "kvd.daemon.store.page_store",
                   "kvd.daemon.store.tier_events", "kvd.daemon.tier.disk.disk_format",
                   "kvd.daemon.tier.disk.disk_index")


def test_every_module_basename_is_unique():
    by_name: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"module names used twice (name what each holds): {clashes}"


@pytest.mark.parametrize("folder", sorted({p.parent for p in PACKAGE.rglob("*.py")}), ids=str)
def test_no_folder_holds_more_than_twelve_modules(folder):
    modules = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_MODULES_PER_FOLDER, f"{folder} holds {len(modules)}: give a concern a folder"


def test_the_daemon_top_level_is_the_process_shell():
    top_level = {p.stem for p in (PACKAGE / "daemon").glob("*.py") if p.name != "__init__.py"}
    assert top_level <= DAEMON_SHELL, f"not the process shell, put them in a room: {sorted(top_level - DAEMON_SHELL)}"


@pytest.mark.parametrize("name", [n for n in MODULES if any(within(n, pure) for pure in PURE)])
def test_the_machines_and_the_bookkeeping_are_pure(name):
    for imported in IMPORTS[name]:
        assert top(imported) not in {"asyncio", "zmq", "socket", "torch", "threading"}, (name, imported)
        if within(imported, "kvd.daemon"):
            assert any(within(imported, ok) for ok in PURE_MAY_IMPORT), (name, imported)


LOCAL_CORE = ("kvd.daemon.local.ledger", "kvd.daemon.local.events", "kvd.daemon.local.books",
              "kvd.daemon.local.audit", "kvd.daemon.local.reservation")
LOCAL_CORE_MAY_IMPORT = (*LOCAL_CORE, "kvd.daemon.store", "kvd.daemon.store.page_store", "kvd.wire", "kvd.errors",
                         "kvd.statetable")


@pytest.mark.parametrize("name", LOCAL_CORE)
def test_the_local_core_is_pure(name):
    """The local side's core (the ledger, its events and records, a write's machine) is bookkeeping: it
    takes events and returns actions, and the shell around it holds the sockets and the loop."""
    for imported in IMPORTS[name]:
        assert top(imported) not in {"asyncio", "zmq", "socket", "torch", "threading"}, (name, imported)
        if within(imported, "kvd"):
            assert any(within(imported, ok) for ok in LOCAL_CORE_MAY_IMPORT), (name, imported)


@pytest.mark.parametrize("name", [n for n in MODULES if not within(n, "kvd.testing")])
def test_only_tests_import_the_test_doubles(name):
    for imported in kvd_imports(name):
        assert not within(imported, "kvd.testing"), (name, imported)


TABLE_ENGINE = "kvd.statetable"
TABLE_MACHINES = ("kvd.daemon.transfer.table", "kvd.daemon.peer.link_state", "kvd.daemon.local.reservation")


def table_dialects(name: str) -> list[str]:
    """The classes of a module that are a state table's parts: named Row or Table, or holding a row's
    fields (state, event, next) or a guard's (says, test)."""
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ClassDef):
            fields = {item.target.id for item in node.body
                      if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
            if node.name in {"Row", "Table"} or {"state", "event", "next"} <= fields or {"says", "test"} <= fields:
                found.append(node.name)
    return found


def test_one_table_engine():
    assert {"Guard", "Row", "Table"} <= set(table_dialects(TABLE_ENGINE))  # (and the story's Transition)
    dialects = {name: found for name in MODULES if name != TABLE_ENGINE and (found := table_dialects(name))}
    assert not dialects, f"a table of its own: build it on {TABLE_ENGINE} instead: {dialects}"
    for machine in TABLE_MACHINES:
        assert TABLE_ENGINE in IMPORTS[machine], machine


def test_the_table_engine_is_pure():
    for imported in IMPORTS[TABLE_ENGINE]:
        assert top(imported) not in {"asyncio", "zmq", "socket", "threading", "time", "torch"}, imported
        if within(imported, "kvd"):
            assert imported == "kvd.errors", imported


@pytest.mark.parametrize("name", [n for n in MODULES if within(n, "kvd.daemon.local")])
def test_the_local_side_never_imports_the_tier(name):
    """The tier is built on the local core (its reservations are the ledger's); the local side hands
    the tier's requests on through the routes it is given, so the rooms stand one above the other."""
    for imported in kvd_imports(name):
        assert not within(imported, "kvd.daemon.tier"), (name, imported)

"""The package's layering rules (DESIGN §2), checked on the source: an AST scan of every module
under ``pyggspec/``, nothing imported.

* only ``pyggspec/ggml/`` imports cffi or the binding (``cffi``, ``_cffi_backend``, a
  ``_cffi*`` module, ``pyggspec.ggml._lib``, ``pyggspec.ggml._native``);
* only ``pyggspec/cli/`` imports ``click``;
* ``pyggspec/models/`` imports nothing from ``pyggspec.sampling`` or ``pyggspec.speculative``;
* the import graph of ``pyggspec`` has no cycles.

Rules one to three count every import statement, wherever it is (inside functions and
``if TYPE_CHECKING:`` blocks too). The cycle check counts imports inside functions (a cycle
that only closes at call time is still a circle between the modules) but not those under
``if TYPE_CHECKING:`` (annotations only, never run). An import of a package's submodule is an
edge to that submodule only: Python runs the package's ``__init__`` first, but that is the
package's own business, not a dependency of the importer on everything the ``__init__``
re-exports. ``from pyggspec.x import name`` where ``name`` is not a submodule is an edge to
``pyggspec.x`` (its ``__init__`` when it is a package).
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "pyggspec"
SKIP_DIRS = {"__pycache__", "_native"}  # _native: the compiled binding's build output


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # what it imports, resolved (a module, or a module's attribute's module)
    path: str  # file, relative to the repository
    line: int
    where: str  # "top level", "in f()", "TYPE_CHECKING"
    type_checking: bool

    def at(self) -> str:
        return f"{self.path}:{self.line} ({self.where})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        if SKIP_DIRS & set(p.relative_to(PKG).parts):
            continue
        out[_module_name(p)] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve_from(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str, path: Path, modules: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    is_pkg = path.name == "__init__.py"
    found: list[Import] = []

    def add(target: str, node: ast.stmt, where: str, tc: bool) -> None:
        found.append(Import(module, target, rel, node.lineno, where, tc))

    def visit(node: ast.AST, where: str, tc: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for n in node.body:
                visit(n, "TYPE_CHECKING", True)
            for n in node.orelse:
                visit(n, where, tc)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = f"in {node.name}()" if where == "top level" else where
            for n in ast.iter_child_nodes(node):
                visit(n, inner, tc)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node, where, tc)
            return
        if isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_pkg, node.level, node.module)
            for a in node.names:
                sub = f"{base}.{a.name}"
                # a submodule is an edge to it; a name defined in the module, an edge to it
                add(sub if sub in modules else base, node, where, tc)
            return
        for n in ast.iter_child_nodes(node):
            visit(n, where, tc)

    visit(tree, "top level", False)
    return found


def _all_imports() -> list[Import]:
    src = _sources()
    names = set(src)
    return [imp for m, p in src.items() for imp in _imports(m, p, names)]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _report(title: str, bad: list[Import], rule: str) -> str:
    lines = [f"{title}: {len(bad)} import(s) break the rule ({rule}):"]
    for imp in sorted(bad, key=lambda i: (i.path, i.line)):
        lines.append(f"  {imp.at()}: {imp.module} imports {imp.target}")
    return "\n".join(lines)


def _is_binding(target: str) -> bool:
    last = target.split(".")[-1]
    return (_under(target, "cffi") or target == "_cffi_backend" or last.startswith("_cffi")
            or _under(target, "pyggspec.ggml._lib") or _under(target, "pyggspec.ggml._native"))


def test_only_ggml_touches_cffi():
    bad = [i for i in _all_imports()
           if _is_binding(i.target) and not _under(i.module, "pyggspec.ggml")]
    assert not bad, _report("cffi outside pyggspec/ggml/", bad,
                            "only pyggspec/ggml/ imports cffi or the binding; elsewhere call "
                            "a function of pyggspec.ggml")


def test_only_cli_imports_click():
    bad = [i for i in _all_imports()
           if _under(i.target, "click") and not _under(i.module, "pyggspec.cli")]
    assert not bad, _report("click outside pyggspec/cli/", bad,
                            "click only under pyggspec/cli/; options become plain values "
                            "(EngineConfig, SamplingParams) before they leave the CLI")


def test_models_import_no_sampling_or_speculative_code():
    bad = [i for i in _all_imports()
           if _under(i.module, "pyggspec.models")
           and (_under(i.target, "pyggspec.sampling") or _under(i.target, "pyggspec.speculative"))]
    assert not bad, _report("model code imports sampling/speculative code", bad,
                            "pyggspec/models/ imports nothing from pyggspec.sampling or "
                            "pyggspec.speculative, TYPE_CHECKING included; a graph calls "
                            "methods of the objects it is handed (plan.build(...))")


# --- cycles ----------------------------------------------------------------------------------
def _graph() -> dict[str, dict[str, Import]]:
    """module -> {imported pyggspec module: the first import statement making that edge}."""
    src = _sources()
    g: dict[str, dict[str, Import]] = {m: {} for m in src}
    for imp in _all_imports():
        if imp.type_checking or imp.target not in src or imp.target == imp.module:
            continue
        g[imp.module].setdefault(imp.target, imp)
    return g


def _sccs(g: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _shortest_path(g: dict[str, dict[str, Import]], src: str, dst: str,
                   within: set[str]) -> list[str]:
    prev: dict[str, str | None] = {src: None}
    q = deque([src])
    while q:
        v = q.popleft()
        if v == dst:
            break
        for w in sorted(g[v]):
            if w in within and w not in prev:
                prev[w] = v
                q.append(w)
    path = [dst]
    while prev[path[-1]] is not None:
        path.append(prev[path[-1]])  # type: ignore[arg-type]
    return path[::-1]


def _cycles(g: dict[str, dict[str, Import]], comp: list[str]) -> list[list[str]]:
    """Short cycles covering every import edge inside one component: for each edge u -> v,
    u -> v then the shortest way back from v to u. Each cycle once (by its rotation)."""
    within = set(comp)
    seen: set[tuple[str, ...]] = set()
    out: list[list[str]] = []
    for u in comp:
        for v in sorted(g[u]):
            if v not in within:
                continue
            cyc = [u] + _shortest_path(g, v, u, within)[:-1]
            i = cyc.index(min(cyc))
            key = tuple(cyc[i:] + cyc[:i])
            if key not in seen:
                seen.add(key)
                out.append(list(key))
    return sorted(out, key=lambda c: (len(c), c))


def _chain(g: dict[str, dict[str, Import]], cyc: list[str]) -> str:
    hops = []
    for a, b in zip(cyc, cyc[1:] + cyc[:1]):
        hops.append(f"    {a}\n      -> {b}   [{g[a][b].at()}]")
    return "\n".join(hops) + f"\n    (back to {cyc[0]})"


def test_no_import_cycles():
    g = _graph()
    comps = _sccs(g)
    if not comps:
        return
    head = (f"{len(comps)} group(s) of pyggspec modules import each other in a circle "
            "(TYPE_CHECKING imports not counted; imports inside functions counted). Each "
            "cycle below lists every hop with the import statement that makes it; cut one "
            "hop per cycle (move the shared piece below both users):")
    lines = [head]
    for comp in comps:
        cycles = _cycles(g, comp)
        lines.append(f"\n* {len(comp)} modules: {', '.join(comp)} ({len(cycles)} cycle(s))")
        for n, cyc in enumerate(cycles, 1):
            lines.append(f"  cycle {n}: {' -> '.join(cyc + cyc[:1])}")
            lines.append(_chain(g, cyc))
    raise AssertionError("\n".join(lines))


# --- the scan itself -------------------------------------------------------------------------
def test_scanner_resolves_imports(tmp_path):
    """The scanner's reading of the forms the rules depend on (so a clean result means
    something): relative imports, submodules vs names, functions, TYPE_CHECKING."""
    names = {"pyggspec.a", "pyggspec.a.b", "pyggspec.a.c", "pyggspec.d"}
    src = tmp_path / "b.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import c\n"
        "from .c import thing\n"
        "from pyggspec.a import b as me, helper\n"
        "import pyggspec.d\n"
        "if TYPE_CHECKING:\n"
        "    import cffi\n"
        "def f():\n"
        "    import click\n")
    imps = _imports("pyggspec.a.b", src, names)
    got = {(i.target, i.where, i.type_checking) for i in imps}
    assert ("pyggspec.a.c", "top level", False) in got  # from . import c (a submodule)
    assert ("pyggspec.a.b", "top level", False) in got  # from pyggspec.a import b
    assert ("pyggspec.a", "top level", False) in got  # helper: a name of pyggspec.a
    assert ("pyggspec.d", "top level", False) in got
    assert ("cffi", "TYPE_CHECKING", True) in got
    assert ("click", "in f()", False) in got
    assert sum(i.target == "pyggspec.a.c" for i in imps) == 2  # "from .c import thing" too
    assert len(_sources()) > 50 and "pyggspec.ggml.buffer" in _sources()


def test_cycle_report_names_every_hop():
    def imp(a: str, b: str, line: int) -> Import:
        return Import(a, b, a.replace(".", "/") + ".py", line, "top level", False)

    edges = [("p.a", "p.b", 1), ("p.b", "p.c", 2), ("p.c", "p.a", 3), ("p.c", "p.b", 4),
             ("p.d", "p.a", 5)]
    g: dict[str, dict[str, Import]] = {m: {} for m in ("p.a", "p.b", "p.c", "p.d")}
    for a, b, line in edges:
        g[a][b] = imp(a, b, line)
    assert _sccs(g) == [["p.a", "p.b", "p.c"]]
    cycles = _cycles(g, ["p.a", "p.b", "p.c"])
    assert cycles == [["p.b", "p.c"], ["p.a", "p.b", "p.c"]]
    text = _chain(g, cycles[0])
    assert "p.b\n      -> p.c   [p/b.py:2 (top level)]" in text and "p/c.py:4" in text

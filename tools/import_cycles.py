"""Print the import cycles of the fedmpi package, and the imports deferred into a
function without a word of why; exit 1 when there is either.

The graph is the one Python follows at import time: the imports a module runs while it
loads (its module body, class bodies and module-level ``if``/``try``/``with`` blocks; not
function bodies, which run later, nor ``if TYPE_CHECKING:`` blocks, which never run).
Relative imports are resolved against the importing module's package. Importing
``a.b.c`` loads the packages ``a`` and ``a.b`` first, so it adds edges to their
``__init__`` modules as well, except to the importer's own packages, which are loading
already by the time it runs; but a name taken from one of those (``from . import
Observer``: not a submodule) is an edge to it, as the name exists only once its
``__init__`` has run that far. ``from a import b`` with ``b`` a submodule is an edge to
``a.b``. Only modules of the package count; the standard library and third parties are
not followed.

A cycle is a set of modules each of which needs another one of the set half-loaded; it
works or breaks by the order in which they happen to be imported. The answer is to move
code to the layer it belongs to, not to defer the import into a function.

An import inside a function hides an edge from this graph, so each one says why it is
there (a cycle it avoids, a slow or optional library): a comment on its line, or on the
line above its block of imports, or, for a module whose functions all import that way
for one reason, a comment at the module's top level that starts ``# deferred imports:``.

    python tools/import_cycles.py [package directory, default fedmpi]
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules(package: Path) -> dict[str, Path]:
    """Every module of ``package`` (a directory), by its dotted name."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def load_time_imports(body: list[ast.stmt]):
    """The Import and ImportFrom nodes that run while the module loads."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from load_time_imports(node.body)
            yield from load_time_imports(node.orelse)
        elif isinstance(node, ast.ClassDef):
            yield from load_time_imports(node.body)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from load_time_imports(getattr(node, field, []) or [])


def _targets(node, name: str, is_package: bool, known) -> tuple[list[str], bool]:
    """The modules of ``known`` that ``node``, in module ``name``, imports by name, and
    whether it takes a name from the first that is not a submodule of it."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names], False
    if node.level:
        package = name if is_package else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module
    submodules = [f"{base}.{alias.name}" for alias in node.names
                  if f"{base}.{alias.name}" in known]
    return [base] + submodules, len(submodules) < len(node.names)


def graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it loads while loading (see the docstring)."""
    known = modules(package)
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        own = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
        out = set()
        for node in load_time_imports(ast.parse(path.read_text(), str(path)).body):
            targets, takes_names = _targets(node, name, is_package, known)
            if takes_names and targets[0] in own:
                out.add(targets[0])
            for target in targets:
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    module = ".".join(parts[:i])
                    if module in known and module not in own and module != name:
                        out.add(module)
        edges[name] = out
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted:
    the sets of modules that import one another, directly or not."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
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
                out.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(out)


def one_cycle(edges: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module: a -> b -> ... -> a."""
    start, members = component[0], set(component)
    previous, frontier = {start: None}, [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    return component


def find_cycles(package: Path = ROOT / "fedmpi") -> list[list[str]]:
    """One cycle (a list of modules, first = last) per tangle of ``package``'s imports."""
    edges = graph(package)
    return [one_cycle(edges, component) for component in cycles(edges)]


MARKER = "# deferred imports:"


def _blocks(function: ast.AST):
    """The runs of consecutive import statements anywhere in ``function``'s body."""
    for node in ast.walk(function):
        for field in ("body", "orelse", "finalbody", "handlers"):
            statements = getattr(node, field, None)
            run: list[ast.stmt] = []
            for stmt in statements if isinstance(statements, list) else []:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    run.append(stmt)
                    continue
                if run:
                    yield run
                run = []
            if run:
                yield run


def unexplained_deferred(package: Path = ROOT / "fedmpi") -> list[str]:
    """``path:line: statement`` of every import inside a function of ``package`` that no
    comment explains (see the docstring), in file order."""
    out = []
    for path in modules(package).values():
        text = path.read_text()
        lines = text.splitlines()
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        comments = {tok.start[0]: tok for tok in tokens if tok.type == tokenize.COMMENT}
        if any(tok.start[1] == 0 and tok.string.startswith(MARKER) for tok in comments.values()):
            continue
        unexplained = set()
        for function in ast.walk(ast.parse(text, str(path))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for block in _blocks(function):
                first, last = block[0].lineno, block[-1].end_lineno
                above = next((n for n in range(first - 1, 0, -1) if lines[n - 1].strip()), 0)
                if above not in comments and not any(n in comments for n in range(first, last + 1)):
                    unexplained.update(stmt.lineno for stmt in block)
        where = path.relative_to(package.parent)
        out += [f"{where}:{n}: {lines[n - 1].strip()}" for n in sorted(unexplained)]
    return out


def main(argv: list[str]) -> int:
    package = Path(argv[0]) if argv else ROOT / "fedmpi"
    found = find_cycles(package)
    for cycle in found:
        print("import cycle: " + " -> ".join(cycle))
    unexplained = unexplained_deferred(package)
    for line in unexplained:
        print(f"deferred import without a reason: {line}")
    if not found and not unexplained:
        print(f"no import cycles in {package.name} ({len(modules(package))} modules), and "
              f"every import inside a function says why")
    return 1 if found or unexplained else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

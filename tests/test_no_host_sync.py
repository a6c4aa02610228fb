"""No unmarked host<->device synchronisation in the code that runs every training step.

On a GPU, reading a device value on the host (``.item()``, ``float(t)``, ``.cpu()``...)
waits for every queued kernel: once per step it stalls the pipeline. This test parses
(``ast``, comments via ``tokenize``) the modules of the per-step path and lists every
call that reads a device value on the host; each one that must stay carries a
``# host sync: <reason>`` comment on a line of its statement (for an ``if``/``for``/
``with``..., of its header up to the call) or on a comment line just above the statement.

Flagged calls:
- ``<expr>.item() / .cpu() / .numpy() / .tolist()`` (any receiver: a numpy ``.tolist()``
  is flagged too; mark it);
- ``torch.nonzero`` / ``.nonzero()`` / ``argwhere`` (the output size is data-dependent)
  and ``bincount`` (CUDA reads the input's max to size its output);
- ``float(e)``, ``int(e)``, ``bool(e)`` where ``e`` may be a tensor, judged from its
  syntax (no types are inferred): a literal, a plain attribute chain (``self.params.rho``),
  a call of a host function (``len``, ``round``, ``str``, ``math.*``, ``np.*``) and a
  parameter of the enclosing function annotated ``int``, ``float``, ``bool`` or ``str``
  are host values; any other name, a subscript, any other call (``x.sum()``) or an
  arithmetic or comparison with such an operand may be a tensor and is flagged. Erring
  towards flagging: a false hit costs a comment, a missed one a stalled GPU.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PER_STEP = ("fedmpi/algorithms/*.py", "fedmpi/data/ssl_augment.py", "fedmpi/data/augment.py",
            "fedmpi/evaluation/*.py", "fedmpi/flat.py",
            "fedmpi/models/*.py", "fedmpi/runtime/clientdata.py")
SYNC_METHODS = {"item", "cpu", "numpy", "tolist", "nonzero", "argwhere", "bincount"}
CONVERSIONS = {"float", "int", "bool"}
HOST_FUNCTIONS = {"len", "round", "str", "repr", "ord", "range"}
HOST_MODULES = {"math", "np", "numpy"}
HOST_ANNOTATIONS = {"int", "float", "bool", "str"}
MARKER = "host sync:"


def _host_call(call: ast.Call) -> bool:
    """A call known to return a host value: a host builtin, or ``math.f`` / ``np.f``."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in HOST_FUNCTIONS
    while isinstance(func, ast.Attribute):
        func = func.value
    return isinstance(func, ast.Name) and func.id in HOST_MODULES


def _attribute_chain(node: ast.AST) -> bool:
    """``a.b.c`` (names and attributes only): a configuration value, not a tensor."""
    if not isinstance(node, ast.Attribute):
        return False
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def may_be_tensor(node: ast.AST, host_names: frozenset = frozenset()) -> bool:
    """The syntactic rule of the module docstring for a conversion's argument;
    ``host_names``: the enclosing functions' parameters annotated as host scalars."""
    def tensor(n: ast.AST) -> bool:
        if isinstance(n, ast.Constant) or _attribute_chain(n):
            return False
        if isinstance(n, ast.Name):
            return n.id not in host_names
        if isinstance(n, ast.Call):
            return not _host_call(n)
        if isinstance(n, ast.BinOp):
            return tensor(n.left) or tensor(n.right)
        if isinstance(n, ast.UnaryOp):
            return tensor(n.operand)
        if isinstance(n, ast.BoolOp):
            return any(tensor(v) for v in n.values)
        if isinstance(n, ast.Compare):
            return any(tensor(v) for v in [n.left, *n.comparators])
        if isinstance(n, ast.IfExp):
            return tensor(n.body) or tensor(n.orelse)
        return True  # a subscript, anything else
    return tensor(node)


def _scope(function: ast.AST, outer: frozenset) -> frozenset:
    """``outer`` updated with ``function``'s parameters: host-annotated ones in, the rest
    (they shadow an outer name) out."""
    args = function.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs,
              *(a for a in (args.vararg, args.kwarg) if a)]
    host = {a.arg for a in params if isinstance(a.annotation, ast.Name)
            and a.annotation.id in HOST_ANNOTATIONS}
    return (outer - {a.arg for a in params}) | host


def sync_calls(tree: ast.AST) -> list[ast.Call]:
    """Every call of ``tree`` that reads a device value on the host (see the docstring)."""
    hits = []

    def visit(node: ast.AST, host_names: frozenset) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            host_names = _scope(node, host_names)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in SYNC_METHODS:
                hits.append(node)
            elif (isinstance(func, ast.Name) and func.id in CONVERSIONS and len(node.args) == 1
                  and not node.keywords and may_be_tensor(node.args[0], host_names)):
                hits.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child, host_names)

    visit(tree, frozenset())
    return sorted(hits, key=lambda n: (n.lineno, n.col_offset))


def marked_lines(source: str) -> set[int]:
    """Lines a ``# host sync: <reason>`` comment covers: its own, and the next one when the
    comment stands alone on its line."""
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").strip()
        if not (text.startswith(MARKER) and text[len(MARKER):].strip()):
            continue
        row = tok.start[0]
        lines.add(row)
        if not tok.line[:tok.start[1]].strip():
            lines.add(row + 1)
    return lines


def _statements(tree: ast.AST) -> dict[int, ast.stmt]:
    """id(node) -> the innermost statement containing it."""
    owner = {}

    def visit(node: ast.AST, stmt: ast.stmt | None) -> None:
        stmt = node if isinstance(node, ast.stmt) else stmt
        owner[id(node)] = stmt
        for child in ast.iter_child_nodes(node):
            visit(child, stmt)

    visit(tree, None)
    return owner


def unmarked(source: str) -> list[tuple[int, str]]:
    """(line, code) of every flagged call whose statement carries no marker."""
    marks = marked_lines(source)
    tree = ast.parse(source)
    owner = _statements(tree)
    out = []
    for call in sync_calls(tree):
        stmt = owner[id(call)]
        end = call.end_lineno if hasattr(stmt, "body") else stmt.end_lineno
        if not marks.intersection(range(stmt.lineno, end + 1)):
            out.append((call.lineno, ast.unparse(call)))
    return out


def per_step_files() -> list[Path]:
    files = sorted({p for pattern in PER_STEP for p in ROOT.glob(pattern)})
    assert files, "no per-step modules found"
    return files


def test_per_step_code_has_no_unmarked_host_sync():
    found = [f"{path.relative_to(ROOT)}:{line}: {code}"
             for path in per_step_files()
             for line, code in unmarked(path.read_text())]
    assert not found, (f"{len(found)} host synchronisation(s) in per-step code: remove them, or "
                       "say why they must stay with '# host sync: <reason>' on the line:\n"
                       + "\n".join(found))


# ---- the checker itself ------------------------------------------------------------------

SAMPLE = '''
def size(h: int, w: float, t, x: torch.Tensor):
    def inner(w):
        return float(w) + float(h)
    return float(h), int(w), float(t), float(x)

def step(x, self, n):
    a = float(x.sum())
    b = float(x)
    c = x.item()
    d = torch.nonzero(x)
    e = float(self.params.rho)
    f = int(len(x))
    g = float(np.mean(n))
    h = bool(x.any()) and 1
    i = float(0.5)
    j = x.cpu()  # host sync: once per client, the runtime's loss
    # host sync: once per evaluation
    k = x.tolist()
    m = int(total /
            n)  # host sync: continued lines count
    o = float(x.sum())  # host sync:
    p = 2 * float(lr[0])
    # host sync: a statement over several lines
    q = torch.stack([x,
                     y]).cpu()
    if float(x.sum()) > 0 and bool(x.any()):  # host sync: the header of a compound statement
        r = x.item()
    with torch.no_grad():  # host sync: a header does not cover the body
        return x.tolist()
'''


def test_checker_flags_tensor_reads_and_honours_markers():
    flagged = [code for _, code in unmarked(SAMPLE)]
    assert flagged == ["float(w)", "float(t)", "float(x)",
                       "float(x.sum())", "float(x)", "x.item()", "torch.nonzero(x)",
                       "bool(x.any())", "float(x.sum())", "float(lr[0])", "x.item()",
                       "x.tolist()"]


def test_checker_sees_every_listed_module():
    names = {str(p.relative_to(ROOT)) for p in per_step_files()}
    assert {"fedmpi/algorithms/local_sgd.py", "fedmpi/data/ssl_augment.py", "fedmpi/flat.py",
            "fedmpi/runtime/clientdata.py", "fedmpi/models/cnn.py",
            "fedmpi/evaluation/supervised.py", "fedmpi/evaluation/ssl.py"} <= names

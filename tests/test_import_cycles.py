"""fedmpi's modules import one another without a cycle (tools/import_cycles.py): a
cycle works or breaks by the order of imports, so it is refused here; and an import
deferred into a function, which hides an edge, says why. The tool is checked on small
packages whose answers are known."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from import_cycles import find_cycles, graph, unexplained_deferred  # noqa: E402


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_fedmpi_has_no_import_cycle():
    assert find_cycles(ROOT / "fedmpi") == []


def test_every_deferred_import_of_fedmpi_says_why():
    assert unexplained_deferred(ROOT / "fedmpi") == []


def test_a_cycle_through_a_package_init_is_found(tmp_path):
    """config.check importing runtime.clock loads runtime/__init__, which loads the loop,
    which imports config: a cycle although neither module names the other."""
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "config/__init__.py": "from .check import validate\n",
        "config/check.py": "from ..runtime.clock import NAMES\n",
        "runtime/__init__.py": "from .loop import run\n",
        "runtime/loop.py": "from ..config import validate\n",
        "runtime/clock.py": "NAMES = ()\n",
    })
    assert find_cycles(pkg) == [["pkg.config", "pkg.config.check", "pkg.runtime",
                                 "pkg.runtime.loop", "pkg.config"]]


def test_imports_that_do_not_run_at_load_time_are_no_edges(tmp_path):
    """In a function (deferred), under ``if TYPE_CHECKING:``: no cycle. A name taken from
    the module's own package (not a submodule) is an edge; a sibling through it is not."""
    pkg = _package(tmp_path, {
        "__init__.py": "from . import a\nVERSION = 1\n",
        "a.py": ("from typing import TYPE_CHECKING\nfrom . import b\n"
                 "if TYPE_CHECKING:\n    from . import c\n"
                 "def f():\n    from . import c\n"),
        "b.py": "X = 1\n",
        "c.py": "from .a import f\n",
        "d.py": "from . import VERSION\n",
    })
    edges = graph(pkg)
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.c"] == {"pkg.a"}
    assert edges["pkg.d"] == {"pkg"}
    assert find_cycles(pkg) == []
    (pkg / "a.py").write_text("from . import b, d\n")   # pkg -> a -> d -> pkg (VERSION)
    assert find_cycles(pkg) == [["pkg", "pkg.a", "pkg.d", "pkg"]]


def test_a_deferred_import_without_a_reason_is_named(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "a.py": ("def f():\n    import json\n    from . import b\n    return b\n\n\n"
                 "def g():\n    # deferred: b is slow\n    import json\n    from . import b\n\n\n"
                 "def h():\n    x = 1\n    from . import b   # deferred: a cycle\n"),
        "b.py": "# deferred imports: every function here imports what it needs\n"
                "def f():\n    import json\n",
    })
    assert unexplained_deferred(pkg) == ["pkg/a.py:2: import json", "pkg/a.py:3: from . import b"]

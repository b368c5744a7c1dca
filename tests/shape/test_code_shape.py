"""The shape the developer guide asks of ``raystudy/`` (docs/architecture.md), checked on the source itself.

- no function or method over 80 lines, no module over 600;
- no import cycle between raystudy's modules (module level, in a function or for type checking alike); an
  in-function import of one of them only where it defers a heavy library (:data:`HEAVY`) that the imported
  module loads and the importing one does not, named in a comment on its line (``import raystudy``, the
  foundation and ``--help`` load neither torch nor Ray);
- every name imported from the module that defines it (no re-export, no shim), every ``__all__`` naming the
  module's own names (a package's only where docs/api.md documents it), every ``choices=`` a list of
  :mod:`raystudy.vocab`;
- no test-only field in a production config (faults are injected through :mod:`raystudy.faults`);
- one place for URIs and atomic renames: :mod:`raystudy.storage` (plus the whole-directory rename of a
  prepared store in :mod:`raystudy.data.store`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from tests.support.processes import REPO
from tests.support.source import package_files, source_of, tree_of

PACKAGE = REPO / "raystudy"
MAX_FUNCTION_LINES = 80
#: ``"path.py:function"`` -> why it may be longer. Empty: every function fits.
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}


def _sources() -> list[Path]:
    files = package_files()
    assert len(files) > 30, f"expected the raystudy package at {PACKAGE}"
    return files


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _function_lengths(path: Path) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, length in lines)`` of every function and method in ``path``."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree_of(path), "")
    return out


def test_function_lengths_are_measured_as_written(tmp_path):
    src = "def f():\n    x = 1\n\n    return x\n\n\nclass C:\n    @staticmethod\n    def m():\n" \
          "        def inner():\n            pass\n        return inner\n"
    (tmp_path / "probe.py").write_text(src)
    # Lines from `def` to the last line of the body (decorators not counted, blank lines inside counted).
    assert _function_lengths(tmp_path / "probe.py") == [("f", 1, 4), ("C.m", 9, 4), ("C.m.inner", 10, 2)]


def test_no_function_over_80_lines():
    long = []
    for path in _sources():
        for name, line, length in _function_lengths(path):
            key = f"{_rel(path)}:{name}"
            if length > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS_ALLOWED:
                long.append(f"{key} (line {line}): {length} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(long)
    stale = [k for k in LONG_FUNCTIONS_ALLOWED
             if not any(f"{_rel(p)}:{n}" == k and n_lines > MAX_FUNCTION_LINES
                        for p in _sources() for n, _, n_lines in _function_lengths(p))]
    assert not stale, f"allow-list entries that are no longer long (remove them): {stale}"


MAX_MODULE_LINES = 600
#: ``"raystudy/path.py"`` -> why it may be longer, until it is split (then the entry goes: a stale one fails).
LONG_MODULES_ALLOWED: dict[str, str] = {
}


def _long_modules(paths: list[Path], root: Path, allowed: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(modules over the limit and not allowed, allowed entries no longer over it)``, paths relative to
    ``root``'s parent; a module's length is its number of lines."""
    lengths = {p.relative_to(root.parent).as_posix(): len(source_of(p).splitlines())
               for p in paths}
    long = [f"{rel}: {n} lines" for rel, n in lengths.items() if n > MAX_MODULE_LINES and rel not in allowed]
    stale = [rel for rel in allowed if lengths.get(rel, 0) <= MAX_MODULE_LINES]
    return long, stale


def test_module_lengths_are_checked(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (pkg / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (pkg / "kept.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 5))
    paths = sorted(pkg.glob("*.py"))
    allowed = {"pkg/kept.py": "being split", "pkg/short.py": "was split"}
    assert _long_modules(paths, pkg, allowed) == ([f"pkg/long.py: {MAX_MODULE_LINES + 1} lines"], ["pkg/short.py"])


def test_no_module_over_600_lines():
    long, stale = _long_modules(_sources(), PACKAGE, LONG_MODULES_ALLOWED)
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern):\n" + "\n".join(long)
    assert not stale, f"allow-list entries that are no longer long (remove them): {stale}"


# ------------------------------------------------------------------------------ import graph

def _module_name(path: Path, root: Path) -> str:
    """``<root>/core/plasticity.py`` -> ``raystudy.core.plasticity``; a package's ``__init__.py`` -> the package."""
    return ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")


def _own_imports(path: Path, root: Path, modules: set[str], *, every: bool = False) -> list[tuple[str, int, bool]]:
    """``(module of the package imported, line, inside a function?)`` of every import in ``path``.

    ``from a.b import c`` imports the module ``a.b.c`` when there is one, else ``a.b`` (a name its
    ``__init__`` defines or re-exports: that ``__init__`` runs); other names resolve to the longest prefix
    that is a module. Imports under ``if TYPE_CHECKING:`` never run and are left out, unless ``every``.
    """
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not every:
                continue
            targets: list[str | None] = []
            if isinstance(child, ast.Import):
                targets = [module_of(a.name) for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else module_of(base)
                           for a in child.names]
            out.extend((t, child.lineno, in_function) for t in dict.fromkeys(targets) if t)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree_of(path), False)
    return out


def _import_graph(root: Path, *, every: bool = False) -> tuple[dict[str, set[str]], list[str]]:
    """The package under ``root``: ``(module -> the modules its module-level imports import, the
    in-function imports of its own modules as "module:line")``; ``every``: the graph counts the in-function
    and the type-checking imports too (a cycle of them is a cycle of the design, deferred or not)."""
    paths = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    in_function: list[str] = []
    for module, path in paths.items():
        for target, line, inside in _own_imports(path, root, set(paths), every=every):
            if inside:
                in_function.append(f"{module}:{line}")
            if target != module and (every or not inside):
                graph[module].add(target)
    return graph, sorted(set(in_function))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every module of
    one imports every other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def test_import_graph_is_built_as_python_runs_it(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import f  # a re-export: importing pkg runs a\n",
        "a.py": "from . import b\nfrom pkg.c import g\ndef f():\n    pass\n",
        "b.py": "import os\nimport pkg\n",  # b -> pkg (its __init__) -> a -> b: a cycle
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
                "def g():\n    from pkg.a import f  # in a function: no edge, counted\n"
                "    class C:\n        def m(self):\n            import pkg.sub.d\n",
        "sub/__init__.py": "",
        "sub/d.py": "from ..c import g\nfrom pkg.sub import e\n",
        "sub/e.py": "from pkg.c import g\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph, in_function = _import_graph(pkg)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b", "pkg.c"}, "pkg.b": {"pkg"}, "pkg.c": set(),
                     "pkg.sub": set(), "pkg.sub.d": {"pkg.c", "pkg.sub.e"}, "pkg.sub.e": {"pkg.c"}}
    assert in_function == ["pkg.c:5", "pkg.c:8"]
    assert _cycles(graph) == [["pkg", "pkg.a", "pkg.b"]]
    every = _import_graph(pkg, every=True)[0]  # c's type-checking and in-function imports count too
    assert every["pkg.c"] == {"pkg.a", "pkg.sub.d"} and every["pkg.sub.d"] == graph["pkg.sub.d"]
    assert _cycles(every) == [["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.sub.d", "pkg.sub.e"]]
    graph["pkg.c"].add("pkg.sub.d")  # c -> d -> c and c -> d -> e -> c: a second cycle of three
    assert _cycles(graph) == [["pkg", "pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.d", "pkg.sub.e"]]


def test_no_import_cycle():
    """No cycle among module-level imports (Python's own), nor once the in-function and type-checking imports
    count too: ``spec -> checks -> spec`` through a ``TYPE_CHECKING`` import is a cycle of the design."""
    for every in (False, True):
        cycles = _cycles(_import_graph(PACKAGE, every=every)[0])
        assert not cycles, ("modules that import each other" + (" (in functions and type checks included)" if every
                            else " at module level") + " (move the shared piece down a layer):\n"
                            + "\n".join(" <-> ".join(c) for c in cycles))


#: The libraries an in-function import of one of raystudy's modules may defer (import name -> the words a
#: comment names it by): what makes ``import raystudy``, the foundation or ``--help`` slow when loaded.
HEAVY: dict[str, tuple[str, ...]] = {
    "torch": ("torch",), "torchvision": ("torchvision",), "timm": ("timm",), "ray": ("ray",),
    "pandas": ("pandas",), "scipy": ("scipy",), "matplotlib": ("matplotlib",), "optuna": ("optuna",),
    "transformers": ("transformers",), "peft": ("peft",),
}


def _libraries_imported(path: Path) -> set[str]:
    """The top-level names of the absolute imports at module level in ``path`` (``torch``, ``raystudy``, ...)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.add(child.module.split(".")[0])
            visit(child)

    visit(tree_of(path))
    return found


def _heavy_at_import(root: Path) -> dict[str, set[str]]:
    """module -> the :data:`HEAVY` libraries importing it loads: its own module-level imports, its packages'
    and those of every raystudy module it imports at module level (type-checking imports left out)."""
    paths = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = _import_graph(root)[0]
    direct = {module: _libraries_imported(path) & set(HEAVY) for module, path in paths.items()}
    loads: dict[str, set[str]] = {}

    def close(module: str, seen: frozenset) -> set[str]:
        if module in loads:
            return loads[module]
        parts = module.split(".")
        out = set(direct[module])
        for dep in graph[module] | {".".join(parts[:i]) for i in range(1, len(parts))} & set(paths):
            if dep not in seen:
                out |= close(dep, seen | {module})
        loads[module] = out
        return out

    return {m: close(m, frozenset()) for m in paths}


def _in_function_imports(root: Path):
    """``(module, imported module, line, comment)`` for every in-function import of the package's own modules
    under ``root``; ``comment``: the text of the comments on the import's lines ("" for none)."""
    paths = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    for module, path in paths.items():
        source = source_of(path)
        comments = _comments(source)
        ends = {n.lineno: n.end_lineno for n in ast.walk(tree_of(path))
                if isinstance(n, (ast.Import, ast.ImportFrom))}
        for target, line, inside in _own_imports(path, root, set(paths)):
            if inside:
                yield module, target, line, " ".join(comments.get(n, "") for n in range(line, ends[line] + 1)).strip()


def _by_place(places: list[str]) -> list[str]:
    return sorted(set(places), key=lambda s: (s.rpartition(":")[0], int(s.rpartition(":")[2])))


def _imports_deferring_nothing(root: Path) -> list[str]:
    """In-function imports of the package's own modules that defer no heavy library, as ``"module:line"``: the
    comment on their lines names none of :data:`HEAVY` that the imported module loads and the importing
    module does not (``# torch (raystudy.core): --help stays light`` in a light module is the reason)."""
    heavy = _heavy_at_import(root)
    out = []
    for module, target, line, comment in _in_function_imports(root):
        named = {lib for lib, words in HEAVY.items() if any(re.search(rf"\b{w}\b", comment.casefold()) for w in words)}
        if not named & (heavy[target] - heavy[module]):
            out.append(f"{module}:{line}")
    return _by_place(out)


def test_imports_deferring_nothing_are_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        "heavy.py": "import torch\n",
        "light.py": "import json\n",
        "through.py": "from pkg import heavy\n",  # loads torch through pkg.heavy
        "a.py": ("def f():\n"
                 "    from pkg import heavy  # torch: --help stays light\n"  # defers torch: fine
                 "    from pkg import through  # torch (pkg.heavy)\n"  # defers torch, one module away: fine
                 "    from pkg import light  # torch: --help stays light\n"  # light loads no torch: flagged
                 "    from pkg import heavy  # pandas\n"  # heavy loads no pandas: flagged
                 "    from pkg import heavy\n"),  # no reason: flagged
        "b.py": "import torch\ndef g():\n    from pkg import heavy  # torch\n",  # b loads torch already: flagged
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert _imports_deferring_nothing(pkg) == ["pkg.a:4", "pkg.a:5", "pkg.a:6", "pkg.b:3"]


def test_in_function_imports_of_own_modules_defer_a_heavy_library():
    """The rule that replaced a hand-kept count: an in-function import of a raystudy module is there to keep a
    heavy library (:data:`HEAVY`) out of a module that does not load it, and says which."""
    bad = _imports_deferring_nothing(PACKAGE)
    assert not bad, ("in-function imports of raystudy modules that defer no heavy library (import them at module "
                     "level, or name on their line the library of HEAVY they keep out of this module):\n"
                     + "\n".join(bad))


def _comments(source: str) -> dict[int, str]:
    """line -> the text of the comment on it, ``noqa`` codes left out (tokenize: a ``#`` in a string is none)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = re.sub(r"noqa(:\s*[A-Z]+[0-9]+(,\s*[A-Z]+[0-9]+)*)?", "", tok.string).strip("# \t")
    return out


def _unexplained_imports(root: Path) -> list[str]:
    """The in-function imports of the package's own modules with no comment on their lines saying why they
    wait (``# torch (raystudy.core): --help stays light``, ``# optional: peft``), as ``"module:line"``."""
    return _by_place([f"{module}:{line}" for module, _, line, comment in _in_function_imports(root) if not comment])


def test_unexplained_imports_are_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "b.py").write_text("def g():\n    pass\n")
    (pkg / "a.py").write_text(
        "from pkg.b import g\n"  # module level: needs no reason
        "def f():\n"
        "    import json\n"  # not one of the package's modules
        "    from pkg.b import g  # torch: --help stays light\n"
        "    from pkg.b import g\n"  # no reason: flagged
        "    from pkg.b import g  # noqa: F811\n"  # a noqa code is no reason: flagged
        "    from pkg import b; x = '# not a comment'\n"  # a # inside a string: flagged
        "    from pkg.b import (\n        g,\n    )  # Ray (see the module docstring)\n"
        "    from . import b  #\n"  # an empty comment: flagged
    )
    assert _unexplained_imports(pkg) == ["pkg.a:5", "pkg.a:6", "pkg.a:7", "pkg.a:11"]


#: what must load neither torch nor Ray (docs/architecture.md): ``import raystudy``, the foundation modules, and
#: the CLI with every sub-command's parser built (``--help`` and ``--version`` are instant)
LIGHT_IMPORTS = ("import raystudy, raystudy.settings, raystudy.vocab, raystudy.storage, raystudy.io, "
                 "raystudy.faults, raystudy.cli; raystudy.cli.build_parser()")


def test_light_entry_points_import_neither_torch_nor_ray():
    code = f"import sys; {LIGHT_IMPORTS}; print(sorted({{'torch', 'ray'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)}).stdout
    assert out.strip() == "[]", (f"{LIGHT_IMPORTS} imports {out.strip()}: import the heavy module inside the "
                                 "function that needs it, with a comment saying so")


def test_in_function_imports_of_own_modules_say_why():
    bare = _unexplained_imports(PACKAGE)
    assert not bare, ("in-function imports of raystudy modules without a comment on their line saying why they wait "
                      "(an optional dependency, or the heavy import they keep out of a light module; else import "
                      "at module level):\n" + "\n".join(bare))


PRODUCTION_CONFIGS = {
    "raystudy.core.finetune": "FinetuneConfig",
    "raystudy.distributed.train": "TrainResources",
    "raystudy.distributed.plasticity": "PlasticityJob",
    "raystudy.study.spec": "StudySpec",
}
TEST_ONLY_NAMES = ("fail_after_step", "hold_after_checkpoint", "crash_at_batch", "inject_failures")


def _is_test_hook(field: str) -> bool:
    return field in TEST_ONLY_NAMES or "inject" in field or "crash" in field or "fail_after" in field


def test_hook_names_are_recognised():
    assert all(_is_test_hook(n) for n in (*TEST_ONLY_NAMES, "inject_nan", "crash_worker", "fail_after_eval"))
    assert not any(_is_test_hook(n) for n in ("max_failures", "trial_retries", "worker_retries", "lr"))


@pytest.mark.parametrize("module", sorted(PRODUCTION_CONFIGS))
def test_no_test_only_field_in_production_configs(module):
    cls = getattr(importlib.import_module(module), PRODUCTION_CONFIGS[module])
    names = [f.name for f in dataclasses.fields(cls)]
    assert len(names) >= 3, f"{cls.__name__}: expected a dataclass with its fields, found {names}"
    hooks = [n for n in names if _is_test_hook(n)]
    assert not hooks, f"{module}.{cls.__name__} has test-only field(s) {hooks}: inject faults via raystudy.faults"


URI_CHECK = re.compile(r"""['"]://['"]\s+(not\s+)?in\b""")
RENAME_ALLOWED = {"raystudy/storage.py", "raystudy/data/store.py"}


def _is_rename(call: ast.Call) -> bool:
    """``os.replace/os.rename(a, b)``, ``shutil.move``, a file system's ``.move(a, b)`` or ``path.rename(p)``.

    pandas' ``rename`` (a string label or ``columns=`` / ``index=``) is not a file rename.
    """
    func = call.func
    if not isinstance(func, ast.Attribute):
        return False
    owner = func.value.id if isinstance(func.value, ast.Name) else None
    if owner == "os" and func.attr in ("replace", "rename") or owner == "shutil" and func.attr == "move":
        return True
    if func.attr == "move" and len(call.args) == 2:
        return True
    return (func.attr == "rename" and len(call.args) == 1 and not call.keywords
            and not (isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)))


def _renames(source: str) -> list[int]:
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and _is_rename(n)]


def test_patterns_find_what_they_should():
    assert URI_CHECK.search('if "://" in str(path):') and URI_CHECK.search("'://' not in p")
    found = _renames("os.replace(tmp, path)\ntmp.rename(out)\nshutil.move(a, b)\nfs.move(tmp, p)\n"
                     "df.rename(columns={'a': 'b'})\ns.rename('ref')\nx.replace('a', 'b')\n")
    assert found == [1, 2, 3, 4]


def test_uri_checks_only_in_storage():
    hits = []
    for path in _sources():
        if _rel(path) != "raystudy/storage.py":
            hits += [f"{_rel(path)}:{i}: {line.strip()}"
                     for i, line in enumerate(source_of(path).splitlines(), 1)
                     if URI_CHECK.search(line.split("#", 1)[0])]
    assert not hits, "use raystudy.storage.is_uri instead of a local '://' check:\n" + "\n".join(hits)


def test_renames_only_in_storage():
    hits = [f"{_rel(path)}:{line}" for path in _sources() if _rel(path) not in RENAME_ALLOWED
            for line in _renames(source_of(path))]
    assert not hits, "write through raystudy.storage (atomic_output / write_*_atomic):\n" + "\n".join(hits)


# ------------------------------------------------------------------------------ modalities

#: The module that tells image and text inputs apart (docs/architecture.md, "Where each concept lives").
MODALITY_MODULE = "raystudy/data/modality.py"
#: A test of the modality by name: the ``hf:`` prefix of a text model, a store kind compared with ``"text"``
#: (or ``"image"``), or the old predicate. Elsewhere the code asks the seam (``modality_of_model``, ...).
MODALITY_TEST = re.compile(r"""startswith\(["']hf:["']\)|["']hf:["']|is_text_model|[!=]=\s*["'](text|image)["']""")


def test_modality_pattern_finds_what_it_should():
    for line in ('if name.startswith("hf:"):', 'x.removeprefix("hf:")', "if kind == 'text':",
                 'text = meta.get("kind") != "text"', "if is_text_model(m):", 'kind == "image"'):
        assert MODALITY_TEST.search(line), line
    for line in ('if "text" not in header:', 'row["text"]', 'columns=["text", "label"]', "model: hf:<dir>"):
        assert not MODALITY_TEST.search(line), line


def test_modality_strings_only_in_the_modality_module():
    assert (PACKAGE.parent / MODALITY_MODULE).is_file()
    hits = [f"{_rel(path)}:{i}: {line.strip()}" for path in _sources() if _rel(path) != MODALITY_MODULE
            for i, line in enumerate(source_of(path).splitlines(), 1)
            if MODALITY_TEST.search(line)]
    assert not hits, f"ask {MODALITY_MODULE} (modality_of_model / modality_of_store / resolve_modality) " \
                     "instead of testing the modality by name:\n" + "\n".join(hits)


#: Flags that say which modality an object is: read only inside the seam; elsewhere the code asks the
#: modality's operations (``data_path``, ``image_caches``, ``input_size``, ``flops_input``, ...).
MODALITY_FLAGS = frozenset({"takes_images", "caches_images"})


def _modality_flag_reads(source: str) -> list[tuple[int, str]]:
    """``(line, flag)`` of every read of a :data:`MODALITY_FLAGS` attribute in ``source``: ``x.takes_images``
    (any expression before the dot) or ``getattr(x, "takes_images")``; found on the syntax tree, so a word in
    a string, a comment or a docstring is not one."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in MODALITY_FLAGS:
            hits.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in MODALITY_FLAGS):
            hits.append((node.lineno, node.args[1].value))
    return sorted(hits)


def test_modality_flag_reads_are_found_on_the_syntax_tree():
    source = ("if modality.takes_images:\n"  # 1: a branch on the flag
              "    x = 1\n"
              "size = None if not modality_of_model(m).takes_images else 224\n"  # 3: on a call's result
              "skip = [s for s in stores if not modality_of_store(read_meta(s)).caches_images]\n"  # 4
              "flag = getattr(modality, 'caches_images', False)\n"  # 5: by name
              "doc = 'takes_images is a flag'  # caches_images in a comment\n"  # 6: words, not reads
              "takes_images = True\n"  # 7: a name bound, not an attribute read
              "other = modality.takes_image\n")  # 8: another attribute
    assert _modality_flag_reads(source) == [(1, "takes_images"), (3, "takes_images"), (4, "caches_images"),
                                            (5, "caches_images")]


def test_modality_flags_read_only_in_the_modality_module():
    hits = [f"{_rel(path)}:{line}: .{flag}" for path in _sources() if _rel(path) != MODALITY_MODULE
            for line, flag in _modality_flag_reads(source_of(path))]
    assert not hits, f"ask the modality's operations ({MODALITY_MODULE}) instead of branching on its flags:\n" \
                     + "\n".join(hits)


# ------------------------------------------------------------------------------ layers

FOUNDATION = ("vocab", "storage", "io", "faults", "settings", "setting_roles", "setting_flags", "precision", "terminal",
              "cpu_kernels")
#: The one core module the analysis may import: the configuration-expression grammar, to read the expressions
#: in trials tables (it loads torch: docs/architecture.md, "Layers").
ANALYSIS_MAY_IMPORT = ("raystudy.core.expressions",)
#: layer -> the layers it may import (docs/architecture.md, "Layers"); nothing imports upward.
ALLOWED_IMPORTS = {
    "foundation": {"foundation"},
    "data": {"foundation", "data"},
    "core": {"foundation", "data", "core"},
    "analysis": {"foundation", "analysis"},
    "distributed": {"foundation", "data", "core", "analysis", "distributed"},
    "study": {"foundation", "data", "core", "analysis", "distributed", "study"},
    "commands": {"foundation", "data", "core", "analysis", "distributed", "study", "commands", "cli"},
    "cli": {"foundation", "commands", "distributed", "cli"},
}
#: layers that never import Ray; ``data`` imports it only inside the functions that stream through it.
NO_RAY = {"foundation", "core", "analysis"}


def _layer(module: str) -> str:
    """``raystudy.core.plasticity`` -> ``core``; the package itself (``raystudy``) -> ``package``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    head = parts[1]
    if head in FOUNDATION:
        return "foundation"
    return "cli" if head in ("cli", "__main__") else head


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level?)`` of every import in ``path`` (relative ones resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    tree = tree_of(path)
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base == "raystudy":  # `from raystudy import storage`: the submodule
                out += [(f"raystudy.{a.name}" if a.name != "__version__" else "raystudy", node.lineno,
                         id(node) in top) for a in node.names]
            else:
                out.append((base, node.lineno, id(node) in top))
    return out


def test_import_resolution():
    probe = PACKAGE / "core" / "plasticity.py"
    found = {m for m, _, _ in _imports(probe)}
    assert "raystudy.core.components" in found or "raystudy.vocab" in found, found
    assert _layer("raystudy.io") == "foundation" and _layer("raystudy.core.finetune.loop") == "core"


def test_layers_import_only_downward():
    bad = []
    for path in _sources():
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        layer = _layer(module.removesuffix(".__init__"))
        if layer == "package":  # raystudy/__init__.py: the facade (load_study is resolved lazily)
            continue
        for imported, line, at_top in _imports(path):
            root = imported.split(".")[0]
            if root == "raystudy":
                if layer == "analysis" and imported in ANALYSIS_MAY_IMPORT:
                    continue
                target = _layer(imported)
                if target != "package" and target not in ALLOWED_IMPORTS[layer]:
                    bad.append(f"{_rel(path)}:{line}: {layer} imports {imported} ({target})")
            elif root == "ray" and (layer in NO_RAY or (layer == "data" and at_top)):
                bad.append(f"{_rel(path)}:{line}: {layer} imports Ray" + (" at module level" if at_top else ""))
    assert not bad, "imports against the layering of docs/architecture.md:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------ docs/architecture.md

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
SCHEMA_BEGIN = "<!-- schemas: generated from raystudy.vocab by `python tests/shape/test_code_shape.py` -->"
SCHEMA_END = "<!-- schemas: end -->"


def render_schemas() -> str:
    """The table-schema section of docs/architecture.md, from :mod:`raystudy.vocab` alone."""
    from raystudy import vocab

    lines = [SCHEMA_BEGIN, "", "| table | required columns (Arrow type) |", "| --- | --- |"]
    for table, schema in vocab.SCHEMAS.items():
        cols = ", ".join(f"`{f.name}` {f.type}" for f in schema)
        lines.append(f"| `{table}.parquet` | {cols} |")
    lines.append(f"| a run's own `curves.parquet` | {', '.join(f'`{c}`' for c in vocab.RUN_CURVE_COLUMNS)} |")
    lines.append("")
    renamed = [f"`{t}.{old}` is read as `{new}`" for t, m in vocab.RENAMED_COLUMNS.items() for old, new in m.items()]
    lines.append(f"Old column names still read: {'; '.join(renamed) or 'none'}.")
    lines += ["", SCHEMA_END]
    return "\n".join(lines)


def test_architecture_doc_lists_the_schemas_of_vocab():
    from raystudy import vocab

    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert SCHEMA_BEGIN in text and SCHEMA_END in text, f"{ARCHITECTURE}: schema markers missing"
    section = text[text.index(SCHEMA_BEGIN):text.index(SCHEMA_END) + len(SCHEMA_END)]
    assert section == render_schemas(), "docs/architecture.md's schemas differ from raystudy.vocab: run " \
                                        "`python tests/shape/test_code_shape.py` and paste its output"
    # Independently of the renderer: every table and column of vocab is named in the section.
    for table, schema in vocab.SCHEMAS.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| `{table}.parquet`"))
        assert [c.split("`")[1] for c in row.split("|")[2].split(", ")] == schema.names


def test_architecture_doc_names_only_modules_that_exist():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    paths = set(re.findall(r"`(raystudy/[\w/]+(?:\.py|/))`", text))
    assert len(paths) > 20, "expected the doc to name the modules where concepts live"
    missing = sorted(p for p in paths if not (PACKAGE.parent / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


if __name__ == "__main__":
    print(render_schemas())


def test_settings_are_not_copied_by_name_matching():
    """Jobs receive the settings groups themselves (raystudy.settings.values of a group), not fields copied
    between dataclasses whose names happen to match: the former ``by_name`` helper is gone."""
    offenders = [f"{_rel(p)}:{node.lineno}" for p in _sources()
                 for node in ast.walk(tree_of(p))
                 if isinstance(node, ast.FunctionDef | ast.Name | ast.Attribute)
                 and getattr(node, "name", getattr(node, "id", getattr(node, "attr", None))) == "by_name"]
    assert not offenders, f"by_name is back: {offenders}"

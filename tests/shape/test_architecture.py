"""The rules of docs/architecture.md about names, checked on the source: one home per name.

- every ``from raystudy.X import name`` (in the package, the tests, the benchmarks and the experiments)
  imports ``name`` from the module that defines it: no re-export, no shim module; code outside the package
  may go through a package's public API, a package ``__init__`` whose ``__all__`` docs/api.md documents;
- every ``__all__`` lists the module's own names (a package's only where docs/api.md documents it);
- every ``choices=`` (a flag's, a setting's) is a list of :mod:`raystudy.vocab`, "no local copy of a tuple
  of names";
- Ray starts only through :func:`raystudy.distributed.cluster.init_ray`;
- the vocabulary the guide names (components) is the one :mod:`raystudy.vocab` holds.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.processes import REPO
from tests.support.source import package_files, source_of, tree_of

ROOT = REPO
PACKAGE = ROOT / "raystudy"
API_DOC = ROOT / "docs" / "api.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: where imports of raystudy's names are checked
CODE_DIRS = ("raystudy", "tests", "benchmarks", "experiments")
#: ``(module, name)`` imported through a module that is not its home, and why. The analysis may import one
#: module of the core, the configuration-expression grammar (tests/shape/test_code_shape.py, ``ANALYSIS_MAY_IMPORT``):
#: the PEFT methods' names reach it through that door.
THROUGH_ALLOWED: dict[tuple[str, str], str] = {
    ("raystudy.core.expressions", "METHODS"): "the analysis' one door into the core (layers)",
}


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _resolve(base: str | None, level: int, package: str) -> str:
    """The absolute module of ``from <level dots><base> import ...`` written in ``package``."""
    if not level:
        return base or ""
    parts = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(parts + ([base] if base else []))


class Names:
    """What each module of the package under ``root / package`` binds at module level: its own definitions
    (``def``, ``class``, assignments) and the names it imports from the package, so that a name's home is
    found by following imports to the module that defines it."""

    def __init__(self, root: Path, package: str = "raystudy"):
        self.root = root
        self.paths = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
        self.defined: dict[str, set[str]] = {}
        self.imported: dict[str, dict[str, tuple[str, str]]] = {}
        self.all: dict[str, list[str]] = {}
        for module, path in self.paths.items():
            self._read(module, path)

    def package_of(self, module: str, path: Path) -> str:
        return module if path.name == "__init__.py" else module.rpartition(".")[0]

    def _read(self, module: str, path: Path) -> None:
        tree = tree_of(path)
        defined, imported = set(), {}
        for node in _module_level(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    self.all[module] = _listed(node.value, tree)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module, node.level, self.package_of(module, path))
                imported |= {a.asname or a.name: (base, a.name) for a in node.names}
        self.defined[module], self.imported[module] = defined, imported

    def home(self, module: str, name: str) -> str | None:
        """The module that defines ``name`` as ``module`` sees it (a submodule: itself), or None if none does."""
        for _ in range(20):
            if f"{module}.{name}" in self.paths:
                return f"{module}.{name}"
            if name in self.defined.get(module, ()):
                return module
            if name not in self.imported.get(module, {}):
                return None
            module, name = self.imported[module][name]
            if module not in self.paths:
                return None
        return None


def _listed(value: ast.expr, tree: ast.Module) -> list[str]:
    """The names of an ``__all__``: a literal list, or ``sorted(_EXPORTS)`` of a lazy package's name map."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "sorted":
        source = ast.unparse(value.args[0])
        value = next(n.value for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == source)
        return sorted(ast.literal_eval(value))
    return list(ast.literal_eval(value))


def _module_level(tree: ast.Module):
    """The statements of ``tree`` that run at import, ``if`` / ``try`` bodies included."""
    for node in tree.body:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            for child in ast.walk(node):
                if child is not node and isinstance(child, ast.stmt):
                    yield child


def public_packages(names: Names, api_doc: str) -> set[str]:
    """The packages whose ``__init__`` is a public API: it has an ``__all__`` and docs/api.md imports from it
    or names one of its names (``raystudy.load_study``, ``from raystudy.data import ...``)."""
    return {m for m, p in names.paths.items() if p.name == "__init__.py" and m in names.all
            and (f"from {m} import " in api_doc or any(f"`{m}.{n}" in api_doc for n in names.all[m]))}


def imports_not_from_home(names: Names, files: list[Path], public: set[str]) -> list[str]:
    """``"file:line: name from X (home Y)"`` for every import of a package name from another module than its
    home; files outside the package may use ``public`` packages; ``"... X has no name"`` for a stale one."""
    out = []
    for path in files:
        inside = path.is_relative_to(names.root / "raystudy")
        module = _module_name(path, names.root) if inside else ""
        package = names.package_of(module, path) if inside else ""
        for node in ast.walk(tree_of(path)):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _resolve(node.module, node.level, package)
            if base not in names.paths or (not inside and base in public):
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in names.paths:  # a submodule: its own home
                    continue
                home = names.home(base, alias.name)
                where = f"{path.relative_to(names.root).as_posix()}:{node.lineno}"
                if home is None:
                    out.append(f"{where}: {base} has no {alias.name}")
                elif home != base and (base, alias.name) not in THROUGH_ALLOWED:
                    out.append(f"{where}: {alias.name} from {base} (home {home})")
    return out


def _files(root: Path) -> list[Path]:
    return sorted(p for d in CODE_DIRS if (root / d).is_dir() for p in (root / d).rglob("*.py"))


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_names_found_outside_their_home_are_reported(tmp_path):
    _write(tmp_path, {
        "raystudy/__init__.py": "",
        "raystudy/vocab.py": "NAMES = ('a',)\n",
        "raystudy/pub/__init__.py": "from raystudy.pub.impl import f\n__all__ = ['f']\n",
        "raystudy/pub/impl.py": "from raystudy.vocab import NAMES\ndef f():\n    pass\n",
        "raystudy/shim.py": "from raystudy.pub.impl import f, NAMES  # noqa: F401\n",
        "raystudy/user.py": ("from raystudy.vocab import NAMES\nfrom raystudy.pub.impl import f\n"
                             "from raystudy.pub import f\n"  # the package's own code: from the home
                             "def g():\n    from raystudy.shim import NAMES, f\n    from raystudy import vocab\n"),
        "tests/test_x.py": ("from raystudy.pub import f\n"  # outside: the public package is fine
                            "from raystudy.pub.impl import NAMES\nfrom raystudy.vocab import GONE\n"),
    })
    names = Names(tmp_path)
    assert names.home("raystudy.shim", "NAMES") == "raystudy.vocab" and names.home("raystudy", "vocab") == \
        "raystudy.vocab"
    public = public_packages(names, "from raystudy.pub import f")
    assert public == {"raystudy.pub"} and public_packages(names, "nothing") == set()
    assert imports_not_from_home(names, _files(tmp_path), public) == [
        "raystudy/shim.py:1: NAMES from raystudy.pub.impl (home raystudy.vocab)",
        "raystudy/user.py:3: f from raystudy.pub (home raystudy.pub.impl)",
        "raystudy/user.py:5: NAMES from raystudy.shim (home raystudy.vocab)",
        "raystudy/user.py:5: f from raystudy.shim (home raystudy.pub.impl)",
        "tests/test_x.py:2: NAMES from raystudy.pub.impl (home raystudy.vocab)",
        "tests/test_x.py:3: raystudy.vocab has no GONE",
    ]


def test_every_name_is_imported_from_its_home():
    names = Names(ROOT)
    public = public_packages(names, API_DOC.read_text(encoding="utf-8"))
    assert {"raystudy.core.finetune", "raystudy.data", "raystudy.analysis"} <= public, public
    bad = imports_not_from_home(names, _files(ROOT), public)
    assert not bad, ("import each name from the module that defines it (no re-export, no shim; outside the "
                     "package, a public package of docs/api.md will do):\n" + "\n".join(bad))
    stale = [k for k in THROUGH_ALLOWED if names.home(*k) in (None, k[0])]
    assert not stale, f"THROUGH_ALLOWED entries no longer imported through (remove them): {stale}"


def missing_module_attributes(names: Names, files: list[Path]) -> list[str]:
    """``"file:line: alias.name (module has no name)"`` for every ``alias.name`` where ``alias`` is a package
    module (``from raystudy.analysis import figures as F``) that binds no ``name``: an attribute an import of
    the name would have caught, left behind when the name moved home."""
    out = []
    for path in files:
        inside = path.is_relative_to(names.root / "raystudy")
        package = names.package_of(_module_name(path, names.root), path) if inside else ""
        tree = tree_of(path)
        modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(node.module, node.level, package)
                modules |= {a.asname or a.name: f"{base}.{a.name}" for a in node.names
                            if f"{base}.{a.name}" in names.paths}
            elif isinstance(node, ast.Import):
                modules |= {a.asname: a.name for a in node.names if a.asname and a.name in names.paths}
        rebound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        rebound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
        modules = {k: v for k, v in modules.items() if k not in rebound}  # a local of the same name elsewhere
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and not node.attr.startswith("__") and names.home(modules[node.value.id], node.attr) is None):
                out.append(f"{path.relative_to(names.root).as_posix()}:{node.lineno}: {node.value.id}.{node.attr} "
                           f"({modules[node.value.id]} has no {node.attr})")
    return out


def test_module_attributes_that_do_not_exist_are_found(tmp_path):
    _write(tmp_path, {
        "raystudy/__init__.py": "",
        "raystudy/style.py": "def markers():\n    pass\n",
        "raystudy/figures.py": "from raystudy.style import markers\ndef draw():\n    pass\n",
        "raystudy/user.py": ("from raystudy import figures as F\nimport raystudy.style as S\n"
                             "F.draw(); F.markers(); S.markers(); F.gone(); S.draw()\n"),
    })
    assert missing_module_attributes(Names(tmp_path), _files(tmp_path)) == [
        "raystudy/user.py:3: F.gone (raystudy.figures has no gone)",
        "raystudy/user.py:3: S.draw (raystudy.style has no draw)",
    ]


def test_every_module_attribute_exists():
    bad = missing_module_attributes(Names(ROOT), _files(ROOT))
    assert not bad, "attributes of package modules that the module does not bind (import from the home):\n" + \
        "\n".join(bad)


def test_every___all___lists_the_module_s_own_names():
    names = Names(ROOT)
    public = public_packages(names, API_DOC.read_text(encoding="utf-8"))
    bad = [f"{m}: {n}" for m, listed in names.all.items() if names.paths[m].name != "__init__.py"
           for n in listed if names.home(m, n) != m]
    assert not bad, "a module's __all__ names what it defines, not what it imports:\n" + "\n".join(bad)
    undocumented = sorted(m for m, p in names.paths.items() if p.name == "__init__.py" and m in names.all
                          and m not in public)
    assert not undocumented, f"packages with an __all__ that docs/api.md does not document: {undocumented}"


def _reexports(path: Path) -> list[int]:
    """Lines importing a package name to be importable from here: kept unused on purpose (``noqa: F401``, not
    as ``_name``, which is a side effect such as registering adapters) or as itself (``name as name``, the
    typing convention of a re-export)."""
    lines = source_of(path).splitlines()
    out = []
    for node in ast.walk(tree_of(path)):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("raystudy")):
            text = "\n".join(lines[node.lineno - 1:node.end_lineno])
            kept = "noqa: F401" in text and not all((a.asname or "").startswith("_") for a in node.names)
            if kept or any(a.asname == a.name for a in node.names):
                out.append(node.lineno)
    return out


def test_reexports_are_found(tmp_path):
    (tmp_path / "m.py").write_text("from raystudy.a import b  # noqa: F401\n"
                                   "from raystudy import c as _c  # noqa: F401\n"
                                   "from . import (  # noqa: F401\n    d,\n)\n"
                                   "from raystudy.e import f\nimport os  # noqa: F401\n"
                                   "from raystudy.g import h as h\nfrom raystudy.g import h as k\n")
    assert _reexports(tmp_path / "m.py") == [1, 3, 8]


def test_no_reexport_in_the_package():
    bad = [f"{p.relative_to(ROOT).as_posix()}:{line}" for p in package_files() for line in _reexports(p)]
    assert not bad, "names imported only to be importable from here (import them from their home):\n" + "\n".join(bad)


def _of_vocabulary(value: ast.expr, names: Names, module: str) -> bool:
    """Whether ``value`` is a list of the vocabulary (``MODES``, ``vocab.MODES``) or a sum of such lists."""
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        return _of_vocabulary(value.left, names, module) and _of_vocabulary(value.right, names, module)
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
        return value.value.id == "vocab" and value.attr in names.defined["raystudy.vocab"]
    return isinstance(value, ast.Name) and names.home(module, value.id) == "raystudy.vocab"


def choices_outside_the_vocabulary(names: Names, files: list[Path]) -> list[str]:
    """``"file:line"`` of every ``choices=`` whose value is not a name bound to a list of ``raystudy.vocab``."""
    out = []
    for path in files:
        module = _module_name(path, names.root)
        for node in ast.walk(tree_of(path)):
            for kw in getattr(node, "keywords", []) if isinstance(node, ast.Call) else []:
                if kw.arg != "choices":
                    continue
                if not _of_vocabulary(kw.value, names, module):
                    out.append(f"{path.relative_to(names.root).as_posix()}:{node.lineno}")
    return out


def test_choices_outside_the_vocabulary_are_found(tmp_path):
    _write(tmp_path, {
        "raystudy/__init__.py": "", "raystudy/vocab.py": "MODES = ('a', 'b')\n",
        "raystudy/other.py": "LOCAL = ('a',)\n",
        "raystudy/cmd.py": ("from raystudy import vocab\nfrom raystudy.vocab import MODES\n"
                            "from raystudy.other import LOCAL\n"
                            "p.add_argument('--m', choices=MODES)\np.add_argument('--v', choices=vocab.MODES)\n"
                            "p.add_argument('--s', choices=MODES + vocab.MODES)\n"
                            "p.add_argument('--l', choices=LOCAL)\np.add_argument('--t', choices=('a', 'b'))\n"
                            "x = setting('a', choices=sorted(MODES))\n"),
    })
    names = Names(tmp_path)
    assert choices_outside_the_vocabulary(names, sorted((tmp_path / "raystudy").rglob("*.py"))) == [
        "raystudy/cmd.py:7", "raystudy/cmd.py:8", "raystudy/cmd.py:9"]


def test_choices_come_from_the_vocabulary():
    names = Names(ROOT)
    bad = choices_outside_the_vocabulary(names, package_files())
    assert not bad, "choices= takes a list of raystudy.vocab (one home per list of allowed values):\n" + "\n".join(bad)


def test_ray_starts_only_through_init_ray():
    calls = [f"{p.relative_to(ROOT).as_posix()}:{n.lineno}" for p in package_files()
             for n in ast.walk(tree_of(p))
             if isinstance(n, ast.Call) and ast.unparse(n.func) == "ray.init"]
    assert len(calls) == 1 and calls[0].startswith("raystudy/distributed/cluster.py:"), \
        f"ray.init outside init_ray (raystudy/distributed/cluster.py): {calls}"


def test_the_guide_names_the_components_of_the_vocabulary():
    from raystudy.vocab import COMPONENTS

    text = ARCHITECTURE.read_text(encoding="utf-8")
    named = re.search(r"a \*component\* is one of `([^`]+)`", text)
    assert named, "docs/architecture.md: 'a *component* is one of `...`' not found"
    assert tuple(c.strip() for c in named.group(1).split(",")) == COMPONENTS


#: dests that name one idea under two names (a study's field for it, a job's): the same flag may set either
SAME_IDEA: tuple[frozenset[str], ...] = (
    frozenset({"configuration", "configurations"}),  # one run's, a study's list
    frozenset({"out", "out_dir"}),
    frozenset({"seed", "seeds"}),  # `raystudy study --seed 0` is `--seeds 0`: the grid of one seed
    frozenset({"workers", "workers_per_trial"}),  # a study's runs: DDP workers per trial
    frozenset({"store", "store_flag"}),
    frozenset({"img_size", "size"}),
)
def cli_flags() -> dict[str, dict[str, set[str]]]:
    """sub-command (``"data prepare"``) -> option string -> the dests it sets there."""
    import argparse

    from raystudy.cli import build_parser

    out: dict[str, dict[str, set[str]]] = {}

    def walk(parser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{prefix} {name}".strip())
            for option in action.option_strings:
                out.setdefault(prefix, {}).setdefault(option, set()).add(action.dest)

    walk(build_parser(), "")
    return out


def flags_with_two_meanings(flags: dict[str, dict[str, set[str]]]) -> dict[str, set[str]]:
    """option string -> its dests across sub-commands, where they are not one idea (:data:`SAME_IDEA`)."""
    dests: dict[str, set[str]] = {}
    for options in flags.values():
        for option, names in options.items():
            dests.setdefault(option, set()).update(names)
    return {o: d for o, d in dests.items() if len(d) > 1 and not any(d <= same for same in SAME_IDEA)}


def test_flags_with_two_meanings_are_found():
    flags = {"a": {"--split": {"split"}, "--out": {"out"}}, "b": {"--split": {"split_rule"}, "--out": {"out_dir"}}}
    assert flags_with_two_meanings(flags) == {"--split": {"split", "split_rule"}}


def test_a_flag_means_one_thing_in_every_sub_command():
    flags = cli_flags()
    assert {"study", "finetune", "plasticity", "probe", "analyze", "data prepare"} <= set(flags)
    two = {o: d for o, d in flags_with_two_meanings(flags).items()}
    assert not two, f"flags that set different things in different sub-commands (rename the odd one out): {two}"
    # the meanings docs/architecture.md ("CLI flags") gives them
    having = {option: sorted(cmd for cmd, options in flags.items() if option in options)
              for option in ("--seeds", "--analysis-seeds", "--threads", "--pretrain-store", "--split-rule")}
    assert having == {"--seeds": ["study"], "--analysis-seeds": ["analyze", "report"], "--threads": ["data prepare"],
                      "--pretrain-store": ["plasticity"], "--split-rule": ["data prepare"]}
    workers = sorted(cmd for cmd, options in flags.items() if "--workers" in options)
    assert workers == ["finetune", "plasticity", "probe", "study"]
    assert all({"--cpus-per-worker", "--gpus-per-worker"} <= set(flags[cmd]) for cmd in workers), \
        "--workers counts Ray workers, each with --cpus-per-worker and --gpus-per-worker"


#: words of the "Where each concept lives" table that are not code names: a spec key, a table, a variable
NOT_CODE = {"final_fit": "a spec key", "plasticity_control": "a table", "RAYSTUDY_FAULTS": "an environment variable"}


def concept_names(text: str) -> list[tuple[str, list[str]]]:
    """``(code name, modules of its row)`` for each name of docs/architecture.md's "Where each concept lives"
    table that looks like code: ``CamelCase``, ``snake_case`` with an underscore, or written as a call."""
    section = text[text.index("## Where each concept lives"):text.index("## Table schemas")]
    out = []
    for line in section.splitlines():
        cells = line.split(" | ")
        if not line.startswith("| ") or len(cells) < 2 or line.startswith(("| concept", "| ---")):
            continue
        modules = [p.removesuffix(".py").removesuffix("/").replace("/", ".")
                   for p in re.findall(r"`(raystudy/[\w/]+(?:\.py|/))`", cells[-1])]
        for name, end in re.findall(r"`([A-Za-z_]\w*)([`(])", line):
            call = end == "("
            camel = re.fullmatch(r"[A-Z][a-z0-9]+[A-Z]\w*", name)
            if (call or "_" in name.strip("_") or camel) and name not in NOT_CODE:
                out.append((name, modules))
    return out


def test_concept_names_are_read_from_the_table():
    text = ("## Where each concept lives\n\n| concept | module |\n| --- | --- |\n"
            "| starting Ray (`init_ray`), `Store`, `LN1`, `TrainResources`, `build_model(\"hf:\")` | "
            "`raystudy/distributed/cluster.py`, `raystudy/data/` |\n\n## Table schemas\n")
    modules = ["raystudy.distributed.cluster", "raystudy.data"]
    assert concept_names(text) == [("init_ray", modules), ("TrainResources", modules), ("build_model", modules)]


def test_the_concept_table_names_what_its_modules_define():
    names = Names(ROOT)
    rows = concept_names(ARCHITECTURE.read_text(encoding="utf-8"))
    assert len(rows) > 20, "expected the table to name the functions and classes where concepts live"
    missing = []
    for name, modules in rows:
        within = [m for m in names.paths for home in modules if m == home or m.startswith(home + ".")]
        if not any(names.home(m, name) for m in within):
            missing.append(f"{name} (in {', '.join(modules)})")
    assert not missing, "docs/architecture.md names what its modules do not define:\n" + "\n".join(missing)

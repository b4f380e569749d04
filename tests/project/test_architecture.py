"""The project's large structure, checked on the source (no imports executed).

Dependencies run one way, bottom up: positional <- models <- data <- configs <- lab <- the
entry points (train.py, eval.py, analyze.py, demo.py, import_checkpoint.py, sweep.py) <- benchmarks. A module imports only
from its own layer or those below; the module graph has no cycle; no module imports a project
module inside a function (the way a cycle hides); no module reads another's private names.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = ("positional", "models", "data", "configs", "lab", "entry", "benchmarks")
ENTRY_POINTS = ("train", "eval", "analyze", "demo", "import_checkpoint", "sweep")


def project_modules() -> dict[str, str]:
    """Dotted module name -> file, for every Python file of the library, entry points and benchmarks."""
    found = {name: os.path.join(ROOT, f"{name}.py") for name in ENTRY_POINTS}
    for package in ("positional", "models", "data", "configs", "lab", "benchmarks"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for file in files:
                if file.endswith(".py"):
                    path = os.path.join(folder, file)
                    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                    found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = project_modules()


def layer(module: str) -> int:
    top = module.split(".")[0]
    return LAYERS.index("entry" if top in ENTRY_POINTS else top)


def resolve(name: str) -> str | None:
    """The project module that `import name` / `from name import ...` loads, or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str):
    """(imported project module, names taken from it, top level?) for each import statement."""
    tree = ast.parse(open(MODULES[module]).read())
    top_level = {id(node) for node in tree.body}
    package = module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if resolve(alias.name):
                    yield resolve(alias.name), [], id(node) in top_level, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = resolve(f"{base}.{alias.name}")
                if target == f"{base}.{alias.name}":  # a submodule
                    yield target, [], id(node) in top_level, node.lineno
                elif resolve(base):
                    yield resolve(base), [alias.name], id(node) in top_level, node.lineno


def graph() -> dict[str, set]:
    return {m: {target for target, *_ in imports(m) if target != m} for m in MODULES}


def test_modules_are_found():
    assert {"positional.attention", "models.lm", "data.pipeline", "train", "eval"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_one_way_at_top_level_with_public_names(module):
    for target, names, top_level, line in imports(module):
        where = f"{os.path.relpath(MODULES[module], ROOT)}:{line}"
        assert layer(target) <= layer(module), f"{where}: {module} imports {target}, a layer above it"
        # Benchmark children import after setting XLA_FLAGS for their simulated devices.
        assert top_level or module.startswith("benchmarks"), (
            f"{where}: {module} imports project module {target} inside a function")
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{where}: {module} imports private name(s) {private} of {target}"


def test_no_private_attribute_of_another_module():
    for module in MODULES:
        tree = ast.parse(open(MODULES[module]).read())
        aliases = {}  # local name -> project module, for `import a.b as c` and `from a import b`
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if resolve(alias.name) == alias.name:
                        aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in MODULES:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                raise AssertionError(f"{module}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")


def test_import_graph_has_no_cycle():
    edges, state, stack = graph(), {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_positional_imports_nothing_above_it():
    for module, targets in graph().items():
        if module.startswith("positional"):
            above = sorted(t for t in targets if not t.startswith("positional"))
            assert not above, f"{module} imports {above}"


def test_data_holds_data_and_imports_no_model():
    """data/ makes examples and batches; what trains a model on them lives above (configs, lab,
    benchmarks), so nothing in data/ imports models/ although the layer order would allow it."""
    for module, targets in graph().items():
        if module.startswith("data"):
            models = sorted(t for t in targets if t.startswith("models"))
            assert not models, f"{module} imports {models}"


def test_kernels_import_no_scheme_file():
    """positional/kernels/ and a scheme folder's kernels (every module of it that calls Pallas:
    PaTH's kernel.py and across.py) take what they need as arguments; a scheme folder's kernel
    may read its own algebra (transport.py)."""
    allowed = {"positional.softmax", "positional.logits", "positional.angles", "positional.linalg", "positional.kernels",
               "positional.path.transport"}
    kernels = [m for m in MODULES if m.startswith("positional.kernels") or "pallas_call(" in open(MODULES[m]).read()]
    assert {"positional.path.kernel", "positional.path.across"} <= set(kernels)
    for module, targets in graph().items():
        if module in kernels:
            assert targets <= allowed | {m for m in MODULES if m.startswith("positional.kernels")}, (
                f"{module} imports {sorted(targets - allowed)}: kernels take what they need as arguments")


# Tests share helpers only through tests/helpers (set-up, input draws, lowering, the scripts run
# in subprocesses), never by importing one another. The one exception runs the conformance
# suite's checks on a scheme the suite leaves out (LM-Infinite's windowed form); it imports a
# module beside it, the one folder pytest puts on the path for it.
TESTS_IMPORTING_TESTS = {"positional/test_lm_infinite": {"test_conformance"}}


def test_tests_do_not_import_tests():
    found = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, "tests")):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for file in sorted(f for f in files if f.startswith("test_") and f.endswith(".py")):
            tree = ast.parse(open(os.path.join(folder, file)).read())
            names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            tests = {name for name in names if name.startswith("test_")}
            if tests:
                found[os.path.relpath(os.path.join(folder, file[:-3]), os.path.join(ROOT, "tests")).replace(os.sep, "/")] = tests
                assert all(os.path.exists(os.path.join(folder, f"{name}.py")) for name in tests), (
                    f"{file} imports {sorted(tests)} from another folder: it resolves only when pytest collected that first")
    assert found == TESTS_IMPORTING_TESTS, "tests share helpers only through tests/helpers: move what they share there"


def project_files():
    """Every Python file of the project: library packages, entry points, benchmarks, tests,
    docs/results scripts (not virtual environments or hidden folders)."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for file in sorted(files):
            if file.endswith(".py"):
                yield os.path.join(folder, file)


def is_sys_path(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def sys_path_patches(path: str) -> list[int]:
    """Lines that change sys.path: a call of one of its methods (sys.path.insert, .append, ...),
    an assignment to it or to an item of it, pytest's monkeypatch.syspath_prepend."""
    lines = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                is_sys_path(node.func.value) or node.func.attr == "syspath_prepend"):
            lines.append(node.lineno)
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for part in ast.walk(target):
                if is_sys_path(part):
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_nothing_patches_sys_path():
    """Imports resolve the same way in every process: the project root is on the path through the
    install (`make`: an editable install, a plain path entry), a script's own folder through Python."""
    found = [f"{os.path.relpath(path, ROOT)}:{line}" for path in project_files() for line in sys_path_patches(path)]
    assert not found, (
        f"{', '.join(found)}: sys.path patched. Import project modules by their package name instead "
        "(from benchmarks.attention import timed; from helpers.tiny_setup import cli in tests, whose folder "
        "pytest puts on the path; a script's siblings by name, its own folder being on the path)")


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """A planted cycle and a function-local import are caught (the checks above are not vacuous)."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import models.b_planted\n")
    b.write_text("def f():\n    import models.a_planted\n")
    monkeypatch.setitem(MODULES, "models.a_planted", str(a))
    monkeypatch.setitem(MODULES, "models.b_planted", str(b))
    with pytest.raises(AssertionError, match="import cycle"):
        test_import_graph_has_no_cycle()
    with pytest.raises(AssertionError, match="inside a function"):
        test_imports_run_one_way_at_top_level_with_public_names("models.b_planted")
    c = tmp_path / "c.py"
    c.write_text("import sys\nsys.path.insert(0, '.')\nsys.path += ['a']\nsys.path[0] = 'b'\n"
                 "def f(monkeypatch):\n    monkeypatch.syspath_prepend('c')\nprint(sys.path)\n")
    assert sys_path_patches(str(c)) == [2, 3, 4, 6]

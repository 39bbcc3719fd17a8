"""The package's shape, checked: no import circles, no upward imports, no private names across
modules, and no plan field compared with a technique's mode string outside ``techniques/``.

The import graph is read from the source (every ``import``, inside functions too, except under
``if TYPE_CHECKING:``), so a cycle dodged by a function-level import still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

from memfit.plans import keys

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "memfit"

# Floors, lowest first: a module may import its own floor or lower ones, never higher.
FLOORS = (
    ("memfit.errors", "memfit.units", "memfit.quiet", "memfit.observer", "memfit.outputs", "memfit.devices",
     "memfit.secrets",
     "memfit.sdpa_backends"),  # what a device is, and which attention kernel it runs
    ("memfit.workload", "memfit.workloads", "memfit.techniques"),  # what to train; how (one module a technique)
    ("memfit.plans",),     # a composition of technique configs
    ("memfit.target",),    # workload x plan x batch x device, resolved once
    ("memfit.step",),      # the one TrainStep
    ("memfit.memory",),    # estimate, measure, reports, budgets
    ("memfit.planner",),
    ("memfit.training",),
    ("memfit.integrations",),  # memfit in the user's loop, Hugging Face's Trainer, Lightning
    ("memfit.report",),    # terminal tables
    ("memfit.cli",),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, tree: ast.Module, known: set[str]) -> list[tuple[str, list[str]]]:
    """(imported memfit module, names taken from it) for every runtime import of module ``name``."""
    package = name if (PACKAGE / Path(*name.split(".")[1:]) / "__init__.py").exists() else name.rpartition(".")[0]
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, []) for a in child.names if a.name.startswith("memfit"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - child.level + 1] + ([base] if base else []))
                if not base.startswith("memfit"):
                    continue
                for alias in child.names:  # ``from memfit.x import y``: y may be a submodule
                    sub = f"{base}.{alias.name}"
                    found.append((sub, []) if sub in known else (base, [alias.name]))
            visit(child)
    visit(tree)
    return found


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, tree in modules.items():
        for target, names in _imports(name, tree, known):
            while target not in known:  # e.g. memfit.memory.cuda.model -> its package exists as a module
                target = target.rpartition(".")[0]
            if target != name:
                graph[name].add(target)
            private += [(name, target, n) for n in names if n.startswith("_") and not n.startswith("__")]
    return graph, private


def _floor(module: str) -> int:
    for i, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is on no floor: add it to FLOORS in {__file__}")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def connect(v):
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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in graph:
        if v not in index:
            connect(v)
    return out


def test_the_import_graph_has_no_cycles():
    graph, _ = _graph()
    graph.pop("memfit")  # the package root only names its public API (lazy attributes)
    for edges in graph.values():
        edges.discard("memfit")
    assert _cycles(graph) == []


def test_no_module_imports_from_a_higher_floor():
    graph, _ = _graph()
    upward = [(m, t) for m, targets in graph.items() if m != "memfit" for t in targets
              if t != "memfit" and _floor(t) > _floor(m)]
    assert upward == []


def test_no_private_name_is_imported_across_modules():
    _, private = _graph()
    assert private == []


def test_outside_techniques_no_plan_field_is_compared_with_a_mode():
    """``plan.precision == "bf16-pure"`` or ``"activations" in plan.offload`` belong in the
    technique's own module: everywhere else, a technique is asked through its config."""
    fields = {k.name for k in keys()}

    def constant(node) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, (str, bool, int)) and node.value is not None
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(constant(e) for e in node.elts)

    def plan_field(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in fields and "plan" in ast.unparse(node.value)

    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "techniques" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(plan_field(o) for o in operands) and any(constant(o) for o in operands):
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def _status_strings(tree: ast.Module) -> list[ast.AST]:
    """Comparisons of a ``status`` with a string, and strings assigned to a ``status``."""
    def is_status(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "status") or (
            isinstance(node, ast.Name) and node.id == "status")

    def is_text(node) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(is_text(e) for e in node.elts)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(is_status(o) for o in operands) and any(is_text(o) for o in operands):
                found.append(node)
        elif isinstance(node, ast.Assign):
            targets = [t for x in node.targets for t in (x.elts if isinstance(x, ast.Tuple) else [x])]
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            pairs = zip(targets, values) if len(targets) == len(values) else ((t, node.value) for t in targets)
            found += [node for t, v in pairs if is_status(t) and is_text(v)]
    return found


def test_the_planner_keeps_no_status_strings():
    """A candidate's status is ``memfit.planner.candidate.Status`` and changes through its methods
    (NOTE [ Candidate status ]): no ``c.status == "too big"`` nor ``c.status = "pruned"`` in the planner."""
    offenders = []
    for path in sorted((PACKAGE / "planner").rglob("*.py")):
        offenders += [f"{path.relative_to(SRC)}:{n.lineno}: {ast.unparse(n)}" for n in _status_strings(
            ast.parse(path.read_text()))]
    assert offenders == []


def _sys_path_edits(tree: ast.Module) -> list[ast.AST]:
    """``sys.path.insert/append/extend/...(...)``, ``sys.path = ...``, ``sys.path += ...`` and
    ``sys.path[...] = ...``: a script that edits the import path runs only from where it was written."""
    def is_sys_path(node) -> bool:
        node = node.value if isinstance(node, ast.Subscript) else node
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            if node.func.attr in {"insert", "append", "extend", "remove", "pop", "clear"}:
                found.append(node)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [node for t in targets if is_sys_path(t)]
    return found


def test_no_code_edits_the_import_path():
    """The package, bench/ and tools/ import by module name (``python -m bench.X``, pytest's
    ``pythonpath``): none edits ``sys.path``."""
    root = SRC.parent
    offenders = []
    for folder in (PACKAGE, root / "bench", root / "tools"):
        for path in sorted(folder.rglob("*.py")):
            offenders += [f"{path.relative_to(root)}:{n.lineno}: {ast.unparse(n)}"
                          for n in _sys_path_edits(ast.parse(path.read_text()))]
    assert offenders == []


def test_the_checks_see_what_they_check():
    """The checks above can fail: a cycle, an upward import and a mode comparison are found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _floor("memfit.cli.main") > _floor("memfit.step") > _floor("memfit.errors")
    tree = ast.parse("import memfit.training.loop\nfrom memfit.step import _private\n")
    found = _imports("memfit.errors", tree, set(_modules()))
    assert ("memfit.training.loop", []) in found and ("memfit.step", ["_private"]) in found
    strings = ast.parse('c.status == "too big"\nc.status, c.reason = "pruned", ""\nif x.status in ("a",): pass\n'
                        'c.status = Status.PRUNED\nc.status is Status.TOO_BIG\n')
    assert sorted(n.lineno for n in _status_strings(strings)) == [1, 2, 3]
    edits = ast.parse('import sys\nsys.path.insert(0, "x")\nsys.path += ["y"]\nsys.path = []\n'
                      'sys.path[0] = "z"\nprint(sys.path)\nsys.path.index("x")\n')
    assert sorted(n.lineno for n in _sys_path_edits(edits)) == [2, 3, 4, 5]

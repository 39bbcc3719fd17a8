"""The package's shape, checked: no import circles, no upward imports, no private names across
modules, no plan field compared with a technique's mode outside ``techniques/``, no status string in
the planner, no edit of the import path, and no file over 450 lines nor class over 300.

The import graph is read from the source: every ``import``, inside functions and under ``if
TYPE_CHECKING:`` too, so a cycle dodged by a function-level or a type-only import still counts.
Each check is a function of the sources; ``test_each_check_fails_on_a_widened_case`` runs it on the
package with one offence added (a mutation of the real tree) and shows that it is found.
"""

from __future__ import annotations

import ast
from pathlib import Path

from memfit.plans import keys

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "memfit"
MAX_FILE_LINES, MAX_CLASS_LINES = 450, 300

# Floors, lowest first: a module may import its own floor or lower ones, never higher. A module is on
# the floor of the longest name here that it is or lies under.
FLOORS = (
    ("memfit.errors", "memfit.units", "memfit.quiet", "memfit.rng_ops", "memfit.observer", "memfit.outputs", "memfit.devices",
     "memfit.hosts", "memfit.secrets", "memfit.sdpa_backends", "memfit.device_queries",
     "memfit.real_values", "memfit.fake_mode", "memfit.untraced_imports"),
    # (what a device and its host are, which attention kernel it runs; the fake mode and what loads outside it)
    ("memfit.workload", "memfit.workloads", "memfit.techniques"),  # what to train; how (one module a technique)
    ("memfit.plans", "memfit.synonyms"),  # a composition of technique configs; other tools' names for its values
    ("memfit.target",),    # workload x plan x batch x device, resolved once
    ("memfit.step",),      # the one TrainStep
    ("memfit.memory",),    # estimate, measure, reports, budgets
    ("memfit.planner",),
    ("memfit.training",),
    ("memfit.integrations",),  # memfit in the user's loop, Hugging Face's Trainer, Lightning
    ("memfit.report",),    # terminal tables
    ("memfit", "memfit.cli"),  # the faces: the package's public names (lazy) and the command line
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, str]:
    """Module name -> its source, for every module of the package."""
    return {_module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, tree: ast.Module, known: set[str]) -> list[tuple[str, list[str]]]:
    """(imported memfit module, names taken from it) for every import of module ``name`` (inside
    functions and under ``if TYPE_CHECKING:`` too)."""
    package = name if f"{name}.__init__" in known or any(k.startswith(name + ".") for k in known) else \
        name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names if a.name.split(".")[0] == "memfit")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "memfit":
                continue
            for alias in node.names:  # ``from memfit.x import y``: y may be a submodule
                sub = f"{base}.{alias.name}"
                found.append((sub, []) if sub in known else (base, [alias.name]))
    return found


def _graph(sources: dict[str, str]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """The import graph (module -> modules it imports) and the private names taken across modules."""
    known = set(sources)
    graph: dict[str, set[str]] = {m: set() for m in sources}
    private = []
    for name, source in sources.items():
        for target, names in _imports(name, ast.parse(source), known):
            while target not in known:  # e.g. memfit.memory.cuda.model -> its package exists as a module
                target = target.rpartition(".")[0]
            if target != name:
                graph[name].add(target)
            private += [(name, target, n) for n in names if n.startswith("_") and not n.startswith("__")]
    return graph, private


def _floor(module: str) -> int:
    matches = [(len(p), i) for i, prefixes in enumerate(FLOORS) for p in prefixes
               if module == p or (p != "memfit" and module.startswith(p + "."))]
    if not matches:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS in {__file__}")
    return max(matches)[1]


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


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, targets in graph.items() for t in targets if _floor(t) > _floor(m))


def test_the_import_graph_has_no_cycles():
    assert _cycles(_graph(_sources())[0]) == []


def test_no_module_imports_from_a_higher_floor():
    assert _upward(_graph(_sources())[0]) == []


def test_no_private_name_is_imported_across_modules():
    assert _graph(_sources())[1] == []


PLAN_KEYS = frozenset(k.name for k in keys())


def _mode_comparisons(tree: ast.Module) -> list[ast.Compare]:
    """Comparisons of a plan key's value with a constant: ``x.<key>``, ``x.get("<key>", ...)`` or
    ``x["<key>"]`` on any receiver, ``==``, ``!=``, ``in`` or ``is`` a constant (``< 1`` with a number
    compares a quantity, not a mode)."""
    def constant(node) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, (str, bool, int)) and node.value is not None
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(constant(e) for e in node.elts)

    def plan_key(node) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr in PLAN_KEYS
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in PLAN_KEYS
        if isinstance(node, ast.Subscript):
            return isinstance(node.slice, ast.Constant) and node.slice.value in PLAN_KEYS
        return False

    def mode_test(node: ast.Compare) -> bool:
        operands = [node.left, *node.comparators]
        if not any(plan_key(o) for o in operands):
            return False
        modes = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)
        texts = [o for o in operands if constant(o) and not (isinstance(o, ast.Constant) and type(o.value) is int)]
        return bool(texts) or (any(isinstance(op, modes) for op in node.ops) and any(constant(o) for o in operands))

    return [n for n in ast.walk(tree) if isinstance(n, ast.Compare) and mode_test(n)]


def _mode_offenders(sources: dict[str, str]) -> list[str]:
    return [f"{name}:{n.lineno}: {ast.unparse(n)}" for name, source in sources.items()
            if not (name == "memfit.techniques" or name.startswith("memfit.techniques."))
            for n in _mode_comparisons(ast.parse(source))]


def test_outside_techniques_no_plan_field_is_compared_with_a_mode():
    """``plan.precision == "bf16-pure"``, ``"activations" in plan.offload`` or ``fixed.get("adapter",
    "none") == "none"`` belong in the technique's own module: everywhere else, a technique is asked
    through its config (``plan.config("adapter").is_default``)."""
    assert _mode_offenders(_sources()) == []


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


def _oversized(sources: dict[str, str]) -> list[str]:
    """Files over ``MAX_FILE_LINES`` lines and classes over ``MAX_CLASS_LINES``."""
    out = []
    for name, source in sources.items():
        lines = source.count("\n") + (not source.endswith("\n") and bool(source))
        if lines > MAX_FILE_LINES:
            out.append(f"{name}: {lines} lines")
        out += [f"{name}.{n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > MAX_CLASS_LINES]
    return out


def test_no_file_is_over_450_lines_and_no_class_over_300():
    """Files stay readable (most between 100 and 400 lines): past the limits, split by concern."""
    assert _oversized(_sources()) == []


def _with(sources: dict[str, str], module: str, code: str) -> dict[str, str]:
    """The package's sources with ``code`` appended to ``module``'s (one offence)."""
    return {**sources, module: sources[module] + "\n" + code}


def test_each_check_fails_on_a_widened_case():
    """Each check, run on the package with one offence added, finds it (and the package alone passes,
    above): an import cycle through a type-only import, an upward import of the package's face, a
    private name, a mode compared on any receiver or through ``.get``/``[...]``, an oversized file and
    an oversized class."""
    sources = _sources()
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from memfit.cli.main import main\n"
    graph = _graph(_with(sources, "memfit.quiet", type_only))[0]
    assert any({"memfit.cli.main", "memfit.quiet"} <= set(cycle) for cycle in _cycles(graph))
    assert ("memfit.quiet", "memfit.cli.main") in _upward(graph)
    graph = _graph(_with(sources, "memfit.integrations.transformers", "import memfit\n"))[0]
    assert _upward(graph) == [("memfit.integrations.transformers", "memfit")]
    graph = _graph(_with(sources, "memfit.planner.walk", "def f():\n    import memfit.cli.main\n"))[0]
    assert ("memfit.planner.walk", "memfit.cli.main") in _upward(graph)
    assert _graph(_with(sources, "memfit.planner.walk", "from memfit.step import _private\n"))[1] == [
        ("memfit.planner.walk", "memfit.step", "_private")]
    for offence in ('self.base.adapter != "none"', 'x = given.get("base_weights", "as-is") == "as-is"',
                    'fixed["precision"] in ("bf16", "fp16")', 'plan.loss_chunks == 0', 'config.offload is True',
                    'ok = report.precision < "bf16"'):
        found = _mode_offenders(_with(sources, "memfit.planner.search", offence))
        assert len(found) == 1 and found[0].startswith("memfit.planner.search:"), (offence, found)
    for quantity in ("n = result.world_size > 1", "n = plan.micro_batch_size >= 2", 'n = x.get("lr", 0) == 1'):
        assert _mode_offenders(_with(sources, "memfit.planner.search", quantity)) == [], quantity
    assert _mode_offenders(_with(sources, "memfit.techniques.adapter", 'plan.adapter == "none"')) == []
    padded = _with(sources, "memfit.errors", "\n" * (MAX_FILE_LINES - sources["memfit.errors"].count("\n")))
    assert _oversized(padded) == ["memfit.errors: 451 lines"]
    big_class = "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES
    assert _oversized(_with(sources, "memfit.planner", big_class)) == [f"memfit.planner.Big: {MAX_CLASS_LINES + 1} lines"]


def test_the_checks_see_what_they_check():
    """The status and import-path checks can fail: each offence below is found."""
    strings = ast.parse('c.status == "too big"\nc.status, c.reason = "pruned", ""\nif x.status in ("a",): pass\n'
                        'c.status = Status.PRUNED\nc.status is Status.TOO_BIG\n')
    assert sorted(n.lineno for n in _status_strings(strings)) == [1, 2, 3]
    edits = ast.parse('import sys\nsys.path.insert(0, "x")\nsys.path += ["y"]\nsys.path = []\n'
                      'sys.path[0] = "z"\nprint(sys.path)\nsys.path.index("x")\n')
    assert sorted(n.lineno for n in _sys_path_edits(edits)) == [2, 3, 4, 5]

"""No import cycle among gspo_megatron's modules: every import (at the top of a file and inside
functions alike; only ``if TYPE_CHECKING:`` blocks are left out) is an edge of a directed graph; this
test fails naming one cycle if the graph has any. Importing ``a.b.c`` counts as importing ``a`` and ``a.b`` too (Python
runs their ``__init__`` first)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "gspo_megatron"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(path: pathlib.Path, name: str, modules: set[str]) -> set[str]:
    """The gspo_megatron modules ``path`` imports, at module level or inside its functions."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def add(target: str) -> None:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            cand = ".".join(parts[:i])
            if cand in modules and cand != name and not name.startswith(cand + "."):
                out.add(cand)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            add(mod)
            for a in node.names:  # `from pkg import submodule`
                add(f"{mod}.{a.name}")
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
        else:
            for child in ast.iter_child_nodes(node):
                visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    modules = set(files)
    return {name: _top_level_imports(path, name, modules) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [m0, m1, ..., m0], or None (iterative depth-first search, three colours)."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    for start in sorted(graph):
        if colour[start] != white:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        colour[start] = grey
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = black
                stack.pop()
            elif colour[nxt] == grey:
                path = [n for n, _ in stack]
                return path[path.index(nxt) :] + [nxt]
            elif colour[nxt] == white:
                colour[nxt] = grey
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_graph_reads_package_and_from_imports():
    g = import_graph()
    assert "gspo_megatron.config.schema" in g["gspo_megatron.config"]
    assert "gspo_megatron.config" in g["gspo_megatron.planner"]
    assert "gspo_megatron.errors" in g["gspo_megatron.models.arch"]
    # a package's own submodules importing it back is not counted (Python handles that order)
    assert "gspo_megatron.config" not in g["gspo_megatron.config.loader"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)

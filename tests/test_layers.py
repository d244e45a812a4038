"""The package's floors hold: no module imports a module of a higher layer.

The layer order is written once, in docs/architecture.md (the fenced ``layers`` block, top floor
first, one floor a line, the top-level modules and packages of ``gspo_megatron`` on it); this test
reads it from there. The import graph is ``test_import_cycles.import_graph``: every import, at module
level and inside functions alike (only ``if TYPE_CHECKING:`` blocks are left out). Within one floor
imports may go either way (the cycle test still forbids circles)."""

import re

from test_import_cycles import PKG, ROOT, import_graph

DOC = ROOT / "docs" / "architecture.md"


def layer_order(text: str) -> list[list[str]]:
    """The floors of the ``layers`` block, bottom first: each a list of top-level names."""
    m = re.search(r"```layers\n(.*?)```", text, re.S)
    assert m, "docs/architecture.md has no ```layers block"
    floors = [line.split("#")[0].split() for line in m.group(1).splitlines()]
    return [f for f in floors if f][::-1]


def floor_of(module: str, floors: list[list[str]]) -> int | None:
    """The floor (0 = bottom) of ``gspo_megatron.<top>...``; None for the root package."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    for i, names in enumerate(floors):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module}: its top-level name {parts[1]!r} is on no floor of docs/architecture.md's layers")


def violations(graph: dict[str, set[str]], floors: list[list[str]]) -> list[str]:
    out = []
    for a, targets in sorted(graph.items()):
        fa = floor_of(a, floors)
        for b in sorted(targets):
            fb = floor_of(b, floors)
            if fa is not None and fb is not None and fb > fa:
                out.append(f"{a} (floor {fa}: {' '.join(floors[fa])}) imports {b} (floor {fb}: {' '.join(floors[fb])})")
    return out


def test_every_top_level_name_has_a_floor_and_appears_once():
    floors = layer_order(DOC.read_text())
    names = [n for f in floors for n in f]
    assert len(names) == len(set(names)), "a name on two floors"
    present = {
        p.stem if p.suffix == ".py" else p.name
        for p in PKG.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    present.discard("__init__")
    assert sorted(present - set(names)) == [], "top-level modules on no floor"
    assert sorted(set(names) - present) == [], "floors naming modules that do not exist"


def test_violations_are_found():
    floors = [["low"], ["high"]]
    g = {"gspo_megatron.low.a": {"gspo_megatron.high.b"}, "gspo_megatron.high.b": {"gspo_megatron.low.a"}}
    assert violations(g, floors) == ["gspo_megatron.low.a (floor 0: low) imports gspo_megatron.high.b (floor 1: high)"]


def test_no_import_runs_up_a_floor():
    bad = violations(import_graph(), layer_order(DOC.read_text()))
    assert not bad, f"{len(bad)} imports run up a floor:\n" + "\n".join(bad)


def test_docs_name_the_floors_as_packages():
    floors = layer_order(DOC.read_text())
    assert floors[0] and floors[-1], "an empty floor"
    for f in floors:
        for n in f:
            assert (PKG / n).is_dir() or (PKG / f"{n}.py").is_file(), n

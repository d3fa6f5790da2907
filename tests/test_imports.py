"""The package's import graph, read from the source (nothing is imported): no module imports another module's
private name, and no two modules import each other, directly or around a longer cycle (deferred imports
inside functions count too: a cycle is a cycle wherever the import sits)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(name: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) of every import of dflash modules in module `name`."""
    path = MODULES[name]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name.startswith("dflash")]
        elif isinstance(node, ast.ImportFrom):
            module = resolve(name, path.name == "__init__.py", node)
            if not module.startswith("dflash"):
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub in MODULES:  # `from dflash import stop`: the module itself
                    found.append((sub, None, node.lineno))
                else:
                    found.append((module, alias.name, node.lineno))
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for module, _, _ in imports_of(name):
            target = module
            while target and target not in MODULES:  # `import dflash.x.y` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # a package's own init is no edge
                edges[name].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_walk_sees_the_package():
    assert {"dflash.train", "dflash.distributed.ranks", "dflash.distributed.stages", "dflash.models.target"} <= set(MODULES)
    edges = graph()
    assert "dflash.train" in edges["dflash.distributed.ranks"]  # a known edge is found
    assert "dflash.stop" in edges["dflash.train"]  # `from dflash import stop` is an edge to the module


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_name_is_imported_from_another_module():
    offenders = [f"{MODULES[name].relative_to(PACKAGE.parent)}:{line} imports {imported} from {module}"
                 for name in MODULES for module, imported, line in imports_of(name)
                 if imported is not None and imported.startswith("_") and module != name]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("edges, cycle", [
    ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set()}, None),
])
def test_the_cycle_finder_finds_cycles(edges, cycle):
    assert find_cycle(edges) == cycle

"""The package's import graph, read from the source (nothing is imported): no module imports another module's
private name, no two modules import each other, directly or around a longer cycle, no two packages either,
and no module imports one of a higher layer (LAYERS). Deferred imports inside functions count too: a cycle
is a cycle, and a climb a climb, wherever the import sits."""

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

# The layers, lowest first. A module imports modules of its own layer or of lower ones, never of a higher one.
# A layer is a set of folders: an entry "dflash.x.*" names the folder dflash/x/ (its __init__, every module in it
# and its subfolders), so a module's layer is its folder's. The top level's own modules are named one by one
# ("dflash.config"): the base everything uses, `inputs` (shared by training and evaluation) and the commands; a new
# top-level module fails the test until it is added here, a new module of a folder takes the folder's layer.
LAYERS: dict[str, list[str]] = {
    # errors, files, the logger, the config schema, devices, torch.compile applied from outside: what everything uses
    "base": ["dflash", "dflash.errors", "dflash.fileio", "dflash.logs", "dflash.config", "dflash.driver",
             "dflash.packaged", "dflash.devices", "dflash.compile"],
    # data (chat JSONL, tokenizer, buckets, prompts) and the models (target, drafter, the target family table)
    "data and models": ["dflash.data.*", "dflash.models.*"],
    # the parts a pipeline is built from: the block pass and its loss, metrics, FLOPs, float8, checkpoints, export
    "components": ["dflash.components.*"],
    # the process runtime of every command: stop signals, the torchrun launcher, ranks' topology, transfers, stages
    # and setup barrier, hang evidence, the supervisor's watchdog, failure classes, run records and trackers,
    # multi-node presence, the doctor
    "runtime": ["dflash.runtime.*"],
    # what the commands run: the trainer and its ranks, evaluation, regeneration, and the run's inputs they share
    "pipelines": ["dflash.inputs", "dflash.training.*", "dflash.evaluation.*", "dflash.regenerate.*"],
    # the command line, `dflash train`'s launch and the operator's client
    "commands": ["dflash.cli", "dflash.__main__", "dflash.launch", "dflash.ops.*"],
}


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


def imported_modules(name: str) -> list[tuple[str, int]]:
    """(imported dflash module, line) of every import in module `name` that is an edge of the graph."""
    found = []
    for module, _, line in imports_of(name):
        target = module
        while target and target not in MODULES:  # `import dflash.x.y` of a name inside a module
            target = target.rpartition(".")[0]
        if target and target != name and not name.startswith(target + "."):  # a package's own init is no edge
            found.append((target, line))
    return found


def graph() -> dict[str, set[str]]:
    return {name: {target for target, _ in imported_modules(name)} for name in MODULES}


def layer_of(name: str, layers: dict[str, list[str]] = LAYERS) -> str | None:
    """The layer of module `name`: its own entry, else the entry of its nearest listed package ("pkg.*", which
    covers the package's own __init__ too)."""
    entries = {entry: layer for layer, names in layers.items() for entry in names}
    if name in entries:
        return entries[name]
    package = name
    while package:
        if f"{package}.*" in entries:
            return entries[f"{package}.*"]
        package = package.rpartition(".")[0]
    return None


def climbs(edges: dict[str, set[str]], layers: dict[str, list[str]] = LAYERS) -> list[tuple[str, str]]:
    """The edges (importer, imported) that go from a lower layer to a higher one."""
    index = {layer: i for i, layer in enumerate(layers)}
    return [(a, b) for a in sorted(edges) for b in sorted(edges[a])
            if index[layer_of(a, layers)] < index[layer_of(b, layers)]]


def unit_of(name: str) -> str:
    """A top-level module is its own unit; the modules of a package (dflash.regenerate.*) are the package's."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else name


def unit_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {unit_of(name): set() for name in edges}
    for a, targets in edges.items():
        units[unit_of(a)] |= {unit_of(b) for b in targets if unit_of(b) != unit_of(a)}
    return units


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
    assert {"dflash.training.trainer", "dflash.training.ranks", "dflash.runtime.stages", "dflash.models.target"} <= set(MODULES)
    edges = graph()
    assert "dflash.training.trainer" in edges["dflash.training.ranks"]  # a known edge is found
    assert "dflash.runtime.failures" in edges["dflash.training.trainer"]  # `from dflash.runtime import failures`


def test_a_folder_is_one_layer_and_the_top_level_is_named_module_by_module():
    """Every entry of LAYERS is a folder ("dflash.x.*", once) or a module of the top level; every folder of the
    package is in LAYERS: `ls dflash` shows the layers."""
    entries = [entry for names in LAYERS.values() for entry in names]
    assert len(entries) == len(set(entries))
    folders = {entry[:-2] for entry in entries if entry.endswith(".*")}
    assert all(entry.count(".") <= 1 for entry in entries if not entry.endswith(".*")), "a module inside a folder"
    assert all(folder.count(".") == 1 for folder in folders), "a subfolder named on its own"
    on_disk = {f"dflash.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert on_disk == folders, f"folders without a layer: {sorted(on_disk - folders)}; named but absent: " \
                               f"{sorted(folders - on_disk)}"


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_layer():
    missing = [f"{MODULES[name].relative_to(PACKAGE.parent)} ({name})" for name in MODULES if layer_of(name) is None]
    assert not missing, ("modules without a layer: " + ", ".join(missing) + "; add each to LAYERS in "
                         "tests/test_imports.py (its own entry, or its package's 'package.*' entry)")


def test_no_import_climbs_to_a_higher_layer():
    edges = {name: targets for name, targets in graph().items() if layer_of(name) and all(map(layer_of, targets))}
    offenders = [f"{MODULES[name].relative_to(PACKAGE.parent)}:{line} ({name}, layer {layer_of(name)!r}) imports "
                 f"{target} (layer {layer_of(target)!r})"
                 for name, imported in climbs(edges) for target, line in imported_modules(name) if target == imported]
    assert not offenders, "imports from a lower layer to a higher one (LAYERS, lowest first):\n" + "\n".join(offenders)


def test_no_two_way_tie_between_packages():
    """dflash.inputs -> dflash.regenerate.* and dflash.regenerate.* -> dflash.inputs would be no module cycle, but
    a two-way tie all the same: packages (and top-level modules) form no cycle either."""
    cycle = find_cycle(unit_graph(graph()))
    assert cycle is None, "packages tied both ways: " + " -> ".join(cycle)


def test_the_layer_rules_find_climbs_and_units():
    layers = {"low": ["p.base", "p.pkg.*"], "high": ["p.app", "p.pkg.entry"]}
    assert layer_of("p.pkg.new", layers) == "low" and layer_of("p.pkg.entry", layers) == "high"
    assert layer_of("p.pkg", layers) == "low"  # the package's __init__
    assert layer_of("p.pkg.sub.deeper", layers) == "low" and layer_of("p.other", layers) is None
    edges = {"p.base": {"p.app"}, "p.app": {"p.pkg.x"}, "p.pkg.x": {"p.pkg.entry"}, "p.pkg.entry": {"p.base"}}
    assert climbs(edges, layers) == [("p.base", "p.app"), ("p.pkg.x", "p.pkg.entry")]
    assert unit_of("dflash.regenerate.runner") == "dflash.regenerate" and unit_of("dflash.inputs") == "dflash.inputs"
    tie = unit_graph({"dflash.inputs": {"dflash.regenerate.run_data"}, "dflash.regenerate.run_data": set(),
                      "dflash.regenerate.runner": {"dflash.inputs"}})
    assert find_cycle(tie) == ["dflash.inputs", "dflash.regenerate", "dflash.inputs"]


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

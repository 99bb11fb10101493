"""The import graph of the package, read statically (ast): the core is plain torch with no host machinery, nothing
imports upward, no modules import each other in a cycle (imports inside functions included), and engines, verifiers
and drafters are constructed in build.py alone.

Layers, lowest first; an import may point only to a lower layer or inside its own part:
  0 core/   1 errors.py, hardware.py   2 kernels/   3 config.py, prompts.py, token_bytes.py, models/, gc_pauses.py,
    structured/   4 build.py
  5 commands/, serve/   6 fleet/   7 train/   8 bench/   9 cli.py
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "s2d_ray"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
LAYERS = {
    "core": 0,
    "errors": 1, "hardware": 1,
    "kernels": 2,
    "config": 3, "prompts": 3, "token_bytes": 3, "models": 3, "gc_pauses": 3, "shm_buffers": 3, "structured": 3,
    "build": 4,
    "commands": 5, "serve": 5,
    "fleet": 6,
    "train": 7,
    "bench": 8,
    "cli": 9,
}
CORE_THIRD_PARTY = {"torch"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted (a submodule when `from package import submodule`)
    line: int
    module_level: bool  # False: inside a function body


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    out: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = module_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend(Import(name, a.name, child.lineno, module_level) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(child, name, path.name == "__init__.py")
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    out.append(Import(name, sub if sub in known else base, child.lineno, module_level))
            visit(child, inner)

    visit(tree, True)
    return out


def graph() -> list[Import]:
    found = modules()
    known = set(found)
    return [imp for name, path in found.items() for imp in _imports_of(name, path, known)]


def part(module: str) -> str | None:
    """The top-level part of the package a module belongs to (None: outside the package)."""
    pieces = module.split(".")
    if pieces[0] != PACKAGE:
        return None
    return pieces[1] if len(pieces) > 1 else ""


def where(imp: Import) -> str:
    path = modules()[imp.source].relative_to(ROOT.parent)
    return f"{path}:{imp.line}: {imp.source} -> {imp.target}"


def test_core_imports_only_torch_the_standard_library_and_itself():
    allowed = set(sys.stdlib_module_names) | CORE_THIRD_PARTY
    bad = sorted({where(i) for i in graph() if part(i.source) == "core"
                  and not (part(i.target) == "core" or i.target.split(".")[0] in allowed)})
    assert not bad, "core/ must import only torch, the standard library and core/ itself:\n" + "\n".join(bad)


def test_no_private_ray_import():
    """Only Ray's public APIs (a private module can change in any release)."""
    bad = sorted(where(i) for i in graph() if i.target.startswith("ray.") and "._private" in i.target + ".")
    assert not bad, "private Ray modules imported:\n" + "\n".join(bad)


def test_every_part_has_a_layer():
    unknown = sorted({part(m) for m in modules()} - set(LAYERS) - {""})
    assert not unknown, f"parts of {PACKAGE} with no layer in the architecture: {unknown}"


def test_imports_point_to_lower_layers():
    bad = set()
    for imp in graph():
        src, dst = part(imp.source), part(imp.target)
        if dst is None or src == dst or src == "" or dst == "":
            continue
        if src not in LAYERS or dst not in LAYERS or LAYERS[dst] >= LAYERS[src]:
            bad.add(f"{where(imp)} (layer {LAYERS.get(src)} -> layer {LAYERS.get(dst)})")
    bad = sorted(bad)
    assert not bad, "imports that do not point to a lower layer:\n" + "\n".join(bad)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or of one that imports itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_module_level_import_cycle():
    imports = [i for i in graph() if i.module_level and part(i.target) is not None]
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.source, set()).add(imp.target)
    bad = []
    for component in cycles(edges):
        members = set(component)
        inside = sorted({where(i) for i in imports if i.source in members and i.target in members})
        bad.append(" <-> ".join(component) + "\n    " + "\n    ".join(inside))
    assert not bad, "module-level import cycles:\n" + "\n".join(bad)


def test_the_graph_reader_resolves_relative_and_submodule_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\nfrom ..top import thing\n")
    (pkg / "sub" / "leaf.py").write_text("import torch\n\ndef f():\n    from .. import top\n")
    known = {"pkg", "pkg.sub", "pkg.sub.leaf", "pkg.top"}
    init = _imports_of("pkg.sub", pkg / "sub" / "__init__.py", known)
    assert [(i.target, i.module_level) for i in init] == [("pkg.sub.leaf", True), ("pkg.top", True)]
    leaf = _imports_of("pkg.sub.leaf", pkg / "sub" / "leaf.py", known)
    assert [(i.target, i.module_level) for i in leaf] == [("torch", True), ("pkg.top", False)]
    assert cycles({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == [["a", "b"]]


def import_cycles(imports: list[Import]) -> list[str]:
    """Every cycle among package modules, imports inside functions included, with the lines that close it."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if part(imp.target) is not None and imp.source != imp.target:
            edges.setdefault(imp.source, set()).add(imp.target)
    found = []
    for component in cycles(edges):
        members = set(component)
        inside = sorted({f"{i.source}:{i.line} -> {i.target}{'' if i.module_level else ' (in a function)'}"
                         for i in imports if i.source in members and i.target in members})
        found.append(" <-> ".join(component) + "\n    " + "\n    ".join(inside))
    return found


def test_no_import_cycle_even_through_function_level_imports():
    bad = import_cycles(graph())
    assert not bad, "import cycles (a function-level import hides one from the module-level check):\n" + "\n".join(bad)


def test_the_cycle_check_sees_a_cycle_closed_inside_a_function(tmp_path):
    """Negative control: a module that imports its importer inside a function is a cycle."""
    pkg = tmp_path / PACKAGE / "serve"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    known = {f"{PACKAGE}.serve", f"{PACKAGE}.serve.a", f"{PACKAGE}.serve.b"}
    imports = [*_imports_of(f"{PACKAGE}.serve.a", pkg / "a.py", known),
               *_imports_of(f"{PACKAGE}.serve.b", pkg / "b.py", known)]
    assert any(not i.module_level and i.target == f"{PACKAGE}.serve.a" for i in imports)
    assert len(import_cycles(imports)) == 1
    assert import_cycles([i for i in imports if i.module_level]) == []  # what the module-level check alone sees


# The classes an engine is made of: constructed in build.py's builders only (core/ defines them).
BUILT_ONLY_IN_BUILD = {"SpecEngine", "TargetVerifier", "SortedDrafter"}


def constructions(source: str) -> list[tuple[int, str]]:
    """(line, class) for every call of a BUILT_ONLY_IN_BUILD class in Python `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in BUILT_ONLY_IN_BUILD:
                out.append((node.lineno, name))
    return out


def test_only_build_constructs_engines_verifiers_and_drafters():
    bad = [f"{path.relative_to(ROOT.parent)}:{line}: {name}(...)"
           for name_, path in modules().items() if part(name_) not in ("core",) and name_ != f"{PACKAGE}.build"
           for line, name in constructions(path.read_text())]
    assert not bad, "construct these through build.py (build_verifier, build_drafter, make_engine, ...):\n" + \
        "\n".join(bad)


def test_the_construction_check_sees_direct_and_qualified_calls():
    found = constructions("from x import TargetVerifier\nv = TargetVerifier(m)\ne = core.engine.SpecEngine(v)\n")
    assert found == [(2, "TargetVerifier"), (3, "SpecEngine")]
    assert constructions("v = build_verifier(m)\n") == []


# What stays out of the algorithm: thread counts, the machine's counters and CPU-count heuristics are a backend's.
# Thread policy, host probes and the grouped-attention sizes tuned on one host (kernels/attention.py: CPU_GROUPED).
HOST_MACHINERY = ("set_num_threads", "get_num_threads", "/proc/", "cpu_count", "sched_getaffinity", "KEY_LEFT_MAX",
                  "GROUP_OVERHEAD_SLOTS", "QUERY_BLOCK", "CPU_GROUPED")


def test_core_holds_no_host_machinery():
    bad = [f"{path.relative_to(ROOT.parent)}: {word}" for name, path in modules().items() if part(name) == "core"
           for word in HOST_MACHINERY if word in path.read_text()]
    assert not bad, "host machinery belongs to a backend in kernels/:\n" + "\n".join(bad)

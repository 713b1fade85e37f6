"""The packages import in one direction (README, "What is here"): zl_common below the compiler
(exporter), the compiler below the runtime (zl_mobile), the runtime below the host (host), and no
module of a package imports back into itself in a circle. Read from the source, lazy imports
inside functions included: a circle that only closes at call time still ties two modules together."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# lower index = lower layer; a package may import only packages at or below its own layer
LAYERS = ["zl_common", "exporter", "zl_mobile", "host"]


def _modules():
    for pkg in LAYERS:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def _imports(name: str, path: Path) -> set[str]:
    """Project modules `name` imports (absolute names), anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in out if m.split(".")[0] in LAYERS}


MODULES = dict(_modules())
GRAPH = {name: {m for m in _imports(name, path) if m in MODULES and m != name} for name, path in MODULES.items()}


@pytest.mark.parametrize("pkg", LAYERS)
def test_no_package_imports_a_higher_layer(pkg):
    rank = LAYERS.index(pkg)
    bad = sorted(f"{mod} imports {dep}" for mod, deps in GRAPH.items() if mod.split(".")[0] == pkg
                 for dep in deps if LAYERS.index(dep.split(".")[0]) > rank)
    assert not bad, "imports against the layering (README, What is here): " + "; ".join(bad)


def _cycles():
    """Strongly connected components with more than one module (Tarjan), ignoring the edges from a
    package's __init__ to its own modules (re-exports, not dependencies)."""
    def deps(m):
        pkg_init = (MODULES[m].name == "__init__.py")
        return [d for d in GRAPH[m] if not (pkg_init and d.startswith(m + "."))
                and not (MODULES[d].name == "__init__.py" and m.startswith(d + "."))]

    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in deps(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles() == [], "modules that import each other (directly or round a circle)"


def test_the_check_sees_a_circle_and_a_reversed_import():
    """The checks above would fail on the layering this project had: exporter/verify.py running
    programs through zl_mobile.program, and host/cli/plan.py <-> host/cli/zl_host.py."""
    GRAPH["exporter.verify"].add("zl_mobile.stage")
    GRAPH["host.phones.emulate"].add("host.cli.zl_host")
    try:
        with pytest.raises(AssertionError, match="exporter.verify imports zl_mobile.stage"):
            test_no_package_imports_a_higher_layer("exporter")
        assert any("host.cli.zl_host" in c and "host.phones.emulate" in c for c in _cycles())
    finally:
        GRAPH["exporter.verify"].discard("zl_mobile.stage")
        GRAPH["host.phones.emulate"].discard("host.cli.zl_host")


def _imported_names(path: Path):
    """(module, name) for every `from module import name` and (module, None) for `import module`."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield from ((node.module or "", a.name) for a in node.names)


def _bench_imports(path: Path) -> list[str]:
    return sorted({f"{m}{'.' + n if n else ''}" for m, n in _imported_names(path)
                   if m.split(".")[0] == "bench"})


def _private_exporter_imports(path: Path) -> list[str]:
    """Names starting with `_` taken from exporter's modules: what a caller outside it must not lean on."""
    return sorted(f"{m}.{n}" for m, n in _imported_names(path)
                  if m.split(".")[0] == "exporter" and n and n.startswith("_") and not n.startswith("__"))


def test_tests_import_no_bench_module():
    """Benchmarks are scripts, not the product: a test that needs their logic means the logic belongs in a
    package (zl_mobile.reference holds the eager trainer the quality study runs); bench/tests/ tests bench/."""
    bad = {str(p.relative_to(REPO)): b for p in sorted((REPO / "tests").rglob("*.py")) if (b := _bench_imports(p))}
    assert not bad, f"tests/ importing bench/: {bad}"


def test_bench_and_tests_import_no_private_name_of_the_exporter():
    """bench/ and tests/ use zl-export's public functions (export_zerolock_chunk, export_manifest,
    ExportedModelSizes, ...): a private one is free to change under them."""
    files = [p for d in ("bench", "tests") for p in sorted((REPO / d).rglob("*.py"))]
    bad = {str(p.relative_to(REPO)): b for p in files if (b := _private_exporter_imports(p))}
    assert not bad, f"private exporter names imported outside exporter/: {bad}"


def test_the_import_checks_see_a_bench_import_and_a_private_exporter_name(tmp_path):
    f = tmp_path / "t.py"
    f.write_text("import bench.quality\nfrom exporter.export import _export_chunk, versions\n"
                 "def g():\n    from bench import per_hour\n    from exporter.cli import _hf_config\n")
    assert _bench_imports(f) == ["bench.per_hour", "bench.quality"]
    assert _private_exporter_imports(f) == ["exporter.cli._hf_config", "exporter.export._export_chunk"]

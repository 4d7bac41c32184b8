"""The package layout stays what the README says: imports run down the README's layers only, folder by folder
(imports inside functions count too), no import cycles among modules, every module named in the README's layout
section, and every module importable."""

import ast
import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "kimi_jax"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: pathlib.Path, modules) -> set[str]:
    """kimi_jax modules that ``path`` imports anywhere in its body (``from a import b`` counts a.b when b is a
    module). The implicit import of a parent package is not an edge: every module would depend on kimi_jax."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
    return {m for m in found if m in modules}


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# The layers of the package, bottom first: a root module or a folder imports only from its own layer or below.
# (The README's layout section lists the same order.) ``import kimi_jax`` reaches the API (the package's lazy
# exports), so it counts as an import of ``api``; the ``python -m kimi_jax.<name>`` aliases sit on top.
LAYERS = ("config", "fields", "text", "cache", "ops", "sharding", "model", "decoding", "weights", "api", "serving",
          "training", "cli", "analysis", "aliases")
ALIASES = ("decode", "serve", "convert", "train")


def _unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    return "aliases" if parts[1] in ALIASES and len(parts) == 2 else parts[1]


def test_imports_run_down_the_layers():
    modules = _modules()
    units = {_unit(m) for m in modules}
    assert units <= set(LAYERS), f"folders or root modules not placed in LAYERS: {units - set(LAYERS)}"
    rank = {u: i for i, u in enumerate(LAYERS)}
    up = [f"{m} -> {n}" for m, p in modules.items() for n in _imports(p, modules)
          if rank[_unit(n)] > rank[_unit(m)]]
    assert not up, "imports up the layers (README, Layout): " + "; ".join(sorted(up))


def test_readme_lists_the_layers():
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("Layers, bottom first:"))
    assert [w.strip(" `.") for w in line.split(":", 1)[1].split(",")] == list(LAYERS)


def test_readme_layout_names_every_module():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    end = layout.find("\n## ", 4)
    layout = layout if end < 0 else layout[:end]
    # a module is named by its file name, or by its folder when the folder is one kernel (ops/<kernel>/)
    missing = [str(p.relative_to(PKG)) for p in _modules().values()
               if p.name != "__init__.py" and p.name not in layout and f"{p.parent.name}/" not in layout]
    assert not missing, f"modules missing from README's layout section: {missing}"


def test_every_module_imports():
    for name in _modules():
        importlib.import_module(name)

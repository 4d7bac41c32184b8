"""The package layout stays what the README says: no import cycles among kimi_jax's modules (imports inside
functions count too), every module named in the README's layout section, and every module importable."""

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

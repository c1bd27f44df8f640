"""The package's import graph, read statically (every import statement, lazy ones included)."""

import ast
import os

PKG = "horovod_twobit"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PKG)


def modules(root=ROOT):
    """Dotted module name -> source path, for every module of the package at ``root``."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(root))[:-3]
                name = rel.replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = \
                    os.path.join(d, f)
    return out


def _resolve(node, name, is_pkg):
    """The absolute module an ``ImportFrom`` names (relative ones resolved)."""
    if not node.level:
        return node.module
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    if node.level > 1:
        base = base[: -(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges(root=ROOT):
    """Module -> set of the package's modules it imports (anywhere in its source)."""
    mods = modules(root)
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(open(path).read(), path)
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(node, name, path.endswith("__init__.py"))
                targets = [mod + "." + a.name if mod + "." + a.name in mods else mod
                           for a in node.names]
            else:
                continue
            out.update(t for t in targets if t in mods and t != name)
        graph[name] = out
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


if __name__ == "__main__":
    for c in cycles(edges()):
        print(" <-> ".join(c))

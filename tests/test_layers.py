"""The package's layers: no import circles (read statically, lazy imports included), dependencies
that point one way, and codecs that do not need Horovod."""

import ast

import import_graph

P = "horovod_twobit."

# Lower layers first; a module may import its own layer's modules and those of the layers
# listed before its own. The bindings, the advisor, the cluster and the benchmarks stand apart.
ORDER = ["wire", "reference", "model", "state"]
BINDING_ORDER = ["codec", "exchange"]  # then the binding's own top: state, face, router, ...


def _layer(mod):
    parts = mod[len(P):].split(".") if mod.startswith(P) else [mod]
    return parts


def test_no_import_circles():
    assert import_graph.cycles(import_graph.edges()) == []


def test_cycles_are_found(tmp_path):
    """The check can fail: a circle through a lazy, relative import is found, and a module
    that only imports a member of the circle is not part of it."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph.edges(str(pkg))
    assert graph["pkg.c"] == {"pkg.a"}
    assert import_graph.cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_layers_point_one_way():
    """wire <- reference, model <- state <- bindings: no lower layer imports a higher one; a
    binding's codec imports no exchange, and neither imports the binding's face or router;
    the bindings never import each other, the advisor, the cluster or the benchmarks."""
    bad = []
    for mod, deps in import_graph.edges().items():
        me = _layer(mod)
        for dep in deps:
            it = _layer(dep)
            if me[0] in ORDER and (it[0] not in ORDER or ORDER.index(it[0]) > ORDER.index(me[0])):
                bad.append((mod, dep))
            if me[0] in ("torch", "tensorflow"):
                if it[0] in ("torch", "tensorflow") and it[0] != me[0]:
                    bad.append((mod, dep))
                if it[0] in ("advisor", "cluster", "benchmarks"):
                    bad.append((mod, dep))
                mine = me[1] if len(me) > 1 and me[1] in BINDING_ORDER else None
                theirs = it[1] if len(it) > 1 else None
                if mine is not None and it[0] == me[0]:
                    if theirs not in BINDING_ORDER[:BINDING_ORDER.index(mine) + 1]:
                        bad.append((mod, dep))
            if it[0] in ("advisor", "benchmarks") and me[0] not in ("advisor", "benchmarks"):
                if mod != P + "advise":
                    bad.append((mod, dep))
    assert bad == []


def test_codecs_do_not_import_horovod():
    """Nothing in a binding's ``codec/`` imports Horovod (a DDP user has none)."""
    mods = import_graph.modules()
    bad = []
    for mod, path in mods.items():
        if ".codec" not in mod or not mod.startswith((P + "torch.codec", P + "tensorflow.codec")):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [(mod, n) for n in names if n == "horovod" or n.startswith("horovod.")]
    assert bad == []


def test_the_top_level_holds_few_modules():
    top = [m for m in import_graph.modules() if m.count(".") == 1
           and not import_graph.modules()[m].endswith("__init__.py")]
    assert len(top) <= 4, top


def test_the_faces_stay_thin():
    """``TwoBitCompressor`` is Horovod's face over a ``TwoBitState`` in both bindings: under 120
    lines each (decorators and docstring included); the state holds the rest."""
    mods = import_graph.modules()
    sizes = {}
    for b in ("torch", "tensorflow"):
        tree = ast.parse(open(mods[P + b + ".compressor"]).read())
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TwoBitCompressor"]
        sizes[b] = cls.end_lineno - cls.lineno + 1 + len(cls.decorator_list)
    assert all(n < 120 for n in sizes.values()), sizes

"""The shape docs/architecture.md promises: no import circle between sibling
modules, no test file past ~1,000 lines, no source folder named so that
tools skip it. Reads the sources only."""

import collections
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = os.path.join(ROOT, "crates")

# Folder names that build tools, editors' search and drawing tools skip.
SKIPPED_NAMES = {"target", "build", "out", "dist", "vendor", "node_modules"}
MAX_TEST_LINES = 1000

PATH_REF = re.compile(r"\b(crate|super)((?:::\w+)+)")
GROUP_REF = re.compile(r"\b(crate|super)((?:::\w+)*)::\{([^{}]*)\}")


def modules():
    """{(crate, module path): file} for every library and binary module."""
    out = {}
    for crate in sorted(os.listdir(CRATES)):
        src = os.path.join(CRATES, crate, "src")
        for dirpath, _, files in os.walk(src):
            for f in files:
                if not f.endswith(".rs"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), src)[:-3].split(os.sep)
                if rel[0] == "bin":
                    continue
                if rel[-1] in ("mod", "lib", "main"):
                    rel = rel[:-1]
                out[(crate, tuple(rel))] = os.path.join(dirpath, f)
    return out


def references(text):
    """(base, [names]) of every crate::/super:: path, groups expanded."""
    text = re.sub(r"//[^\n]*", "", text)
    cut = text.find("#[cfg(test)]\nmod tests")
    if cut >= 0:
        text = text[:cut]
    for m in GROUP_REF.finditer(text):
        for item in m.group(3).split(","):
            item = item.strip()
            if item:
                yield m.group(1), [p for p in m.group(2).split("::") if p] + [item.split("::")[0]]
    for m in PATH_REF.finditer(text):
        yield m.group(1), [p for p in m.group(2).split("::") if p]


def sibling_edges():
    """{(crate, parent): {child: {sibling it uses}}}: a use of module b by
    a file under sibling a (same parent) is an edge a -> b."""
    mods = modules()
    edges = collections.defaultdict(lambda: collections.defaultdict(set))
    for (crate, path), file in mods.items():
        with open(file, encoding="utf-8") as fh:
            text = fh.read()
        for base, parts in references(text):
            cur = [] if base == "crate" else list(path[:-1])
            while parts and parts[0] == "super":
                cur, parts = cur[:-1], parts[1:]
            target = tuple(cur)
            for p in parts:
                if (crate, target + (p,)) not in mods:
                    break
                target += (p,)
            k = 0
            while k < min(len(path), len(target)) and path[k] == target[k]:
                k += 1
            if k < len(path) and k < len(target):
                edges[(crate, path[:k])][path[k]].add(target[k])
    return edges


def cycles(edges):
    found = []
    for (crate, parent), graph in edges.items():
        where = "/".join((crate,) + parent)
        # Tarjan-free: a circle exists iff some module reaches itself.
        for start in graph:
            seen, stack = set(), [(start, [start])]
            while stack:
                node, trail = stack.pop()
                for nxt in graph.get(node, ()):
                    if nxt == start:
                        found.append(f"{where}: {' -> '.join(trail + [start])}")
                    elif nxt not in seen:
                        seen.add(nxt)
                        stack.append((nxt, trail + [nxt]))
    return sorted(set(found))


def test_no_import_circle_between_sibling_modules():
    assert cycles(sibling_edges()) == []


def test_the_circle_finder_sees_a_circle():
    edges = {("c", ()): {"a": {"b"}, "b": {"c"}, "c": {"a"}}}
    assert cycles(edges)
    assert cycles({("c", ()): {"a": {"b"}, "b": set()}}) == []


def test_every_module_is_found():
    mods = modules()
    assert ("rawdisk-nbd", ("server", "export")) in mods
    assert ("rawdisk-storage", ("engine",)) in mods
    edges = sibling_edges()
    # command.rs answers requests through the export layer, not the reverse.
    assert "export" in edges[("rawdisk-nbd", ("server",))]["command"]


def test_no_test_file_past_the_limit():
    long = []
    for dirpath, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        if rel == ".":
            # Cargo's output and git's store: not the repository's files.
            dirs[:] = [d for d in dirs if d not in ("target", ".git")]
        in_tests = rel.split(os.sep)[0] == "tests" or "/tests" in "/" + rel
        for f in files:
            if not in_tests or not f.endswith((".rs", ".py")):
                continue
            with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                n = sum(1 for _ in fh)
            if n > MAX_TEST_LINES:
                long.append(f"{os.path.join(rel, f)}: {n} lines")
    assert long == []


def test_no_source_folder_named_like_a_build_directory():
    bad = []
    for top in ("crates", "tests", "bench", "scripts", "docs", "contrib"):
        for dirpath, dirs, _ in os.walk(os.path.join(ROOT, top)):
            rel = os.path.relpath(dirpath, ROOT)
            bad += [os.path.join(rel, d) for d in dirs if d in SKIPPED_NAMES]
    assert bad == []

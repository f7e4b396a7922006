"""Static import-graph walker: which modules could a worker load, without loading any.

Importing a candidate worker just to inspect it would defeat the point (the
import itself could map libtorch), so modules are located with
``PathFinder.find_spec`` on the worker's own sys.path and their source is read
with ``ast``. Every import statement counts, including ones in function bodies
and try/except blocks: a conditional import is still a path into the address
space. Only ``if TYPE_CHECKING:`` bodies are skipped, because they never run.

Also followed: ``importlib.import_module("x")`` / ``__import__("x")`` with
literal names, and computed names with a literal part
(``f"{base}.runtime.ops_{x}"``), matched against the modules that exist.
Reading one file is `_scan`'s job; this module walks the graph. Hits inside audited
third-party functions (rules.LAZY_IMPORT_WAIVERS) are
returned marked as waived; the caller reports them as notes.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from collections import deque
from dataclasses import dataclass, field
from importlib.machinery import EXTENSION_SUFFIXES, ExtensionFileLoader, PathFinder

from ._scan import ImportSite, _scan_file, scan_source  # noqa: F401  (re-exported)
from .bytecode import cache_path, unfaithful, vouched
from ._witness import see, walk_dirs
from .rules import LazyImportWaiver, ModuleRule, find_waiver, forbidden_module_rule

# Modules we never descend into: they ship with the interpreter, so they
# cannot drag torch in by themselves.
_STDLIB: frozenset[str] = frozenset(sys.stdlib_module_names) | frozenset(sys.builtin_module_names)


@dataclass
class ModuleNode:
    name: str
    # "source", "extension", "namespace", "stdlib", "missing", "opaque"
    kind: str
    file: str | None = None
    search_locations: list[str] | None = None


@dataclass(frozen=True)
class Hop:
    """A module on the path, and the line in it that leads to the next hop."""

    module: str
    file: str | None
    line: int | None
    verb: str  # how this hop reaches the next: "imports" / "is inside package"


@dataclass
class ImportHit:
    forbidden: str  # the module name as written in the source (e.g. "torch.nn")
    rule: ModuleRule
    hops: list[Hop]  # entry ... importer
    scope: str = ""  # function/class the import sits in ("" = module level)
    lazy: bool = False  # inside a function body
    waiver: LazyImportWaiver | None = None  # audited lazy import: a note, not a refusal

    def chain(self, display: PathDisplay) -> list[str]:
        out = []
        for i, hop in enumerate(self.hops):
            where = display(hop.file) if hop.file else "?"
            if hop.line is not None:
                where += f":{hop.line}"
            if i == len(self.hops) - 1 and self.scope:
                where += f", in {self.scope}()" if self.lazy else f", in {self.scope}"
            out.append(f"{hop.module} ({where})")
        out.append(self.forbidden)
        return out

    def describe(self, display: PathDisplay) -> str:
        parts = self.chain(display)
        text = parts[0]
        for hop, nxt in zip(self.hops, parts[1:]):
            text += f" {hop.verb} {nxt}"
        return text


class PathDisplay:
    """Show a file relative to the sys.path entry it was found under (shorter chains)."""

    def __init__(self, sys_path: list[str]) -> None:
        roots = [os.path.abspath(p or os.curdir) for p in sys_path]
        self._roots = sorted({r.rstrip(os.sep) + os.sep for r in roots}, key=len, reverse=True)

    def __call__(self, path: str) -> str:
        if path.startswith("<"):
            return path
        apath = os.path.abspath(path)
        for root in self._roots:
            if apath.startswith(root):
                return apath[len(root):]
        return apath


@dataclass
class WalkResult:
    entry: str
    sys_path: list[str]
    hits: list[ImportHit] = field(default_factory=list)
    modules: dict[str, ModuleNode] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)   # (module, file)

    @property
    def display(self) -> PathDisplay:
        return PathDisplay(self.sys_path)

    def reached_package_roots(self) -> dict[str, list[str]]:
        """Top-level non-stdlib package -> files/dirs to search for native code.

        A package directory is returned whole: any .so inside it ships with the
        package and could be loaded (even via ctypes), so it all gets checked.
        """
        roots: dict[str, list[str]] = {}
        for name, node in self.modules.items():
            top = name.split(".", 1)[0]
            if top in _STDLIB or top == "__main__" or node.kind in ("missing", "stdlib"):
                continue
            top_node = self.modules.get(top)
            if top_node is None:
                continue
            if top_node.search_locations:
                roots.setdefault(top, list(top_node.search_locations))
            elif top_node.file and top_node.kind == "extension":
                roots.setdefault(top, [top_node.file])
        return roots

    def extension_files(self) -> list[str]:
        return sorted(n.file for n in self.modules.values() if n.kind == "extension" and n.file)


# --------------------------------------------------------------------------
# The walk


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(
        os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if paths.get(k)
    )


_STDLIB_DIRS = _stdlib_dirs()


def _in_stdlib_dir(path: str) -> bool:
    # the stdlib's own "test" package and friends are not in stdlib_module_names
    real = os.path.realpath(path)
    return real.startswith(_STDLIB_DIRS) and "site-packages" not in real and "dist-packages" not in real


def _checks_bytecode(origin: str) -> bool:
    """The project's own files and any code outside the interpreter's library (a domain's
    python_path): their caches are compared with their source. The standard library and
    site-packages are the interpreter's, trusted as it is (and ~1000 compiles a walk)."""
    if vouched(origin):
        return True
    real = os.path.realpath(origin)
    return not (_in_stdlib_dir(origin) or f"{os.sep}site-packages{os.sep}" in real
                or f"{os.sep}dist-packages{os.sep}" in real)


class ImportWalker:
    """Breadth-first walk, so the chain reported for each hit is a shortest one."""

    def __init__(self, sys_path: list[str]) -> None:
        self.sys_path = [os.path.abspath(p or os.curdir) for p in sys_path]
        self.nodes: dict[str, ModuleNode] = {}
        self.notes: list[str] = []
        # (module, file) found as code with no source to read (a sourceless .pyc, a
        # module inside an archive): control refuses them (red team 11 row 9)
        self.unreadable: list[tuple[str, str]] = []
        self._package_modules: dict[str, list[str]] = {}
        # FileFinder caches directory listings; files created since the last
        # look (tests, freshly deployed workers) must be seen.
        PathFinder.invalidate_caches()

    # --- locating modules --------------------------------------------------
    def resolve(self, name: str) -> ModuleNode:
        node = self.nodes.get(name)
        if node is None:
            node = self._resolve_uncached(name)
            self.nodes[name] = node
        return node

    def _resolve_uncached(self, name: str) -> ModuleNode:
        top = name.split(".", 1)[0]
        if top in _STDLIB:
            return ModuleNode(name, "stdlib")
        parent, _, last = name.rpartition(".")
        if parent:
            pnode = self.resolve(parent)
            if pnode.kind == "stdlib":
                return ModuleNode(name, "stdlib")
            if not pnode.search_locations:
                return ModuleNode(name, "missing")
            locations = pnode.search_locations
        else:
            locations = self.sys_path
        # The witness (see _witness): each directory searched, and the candidate in it
        # (``loc/last`` as a directory: its __init__ coming or going changes the answer).
        for loc in locations:
            see(loc)
            see(os.path.join(loc, last))
        try:
            spec = PathFinder.find_spec(name, locations)
        except Exception as exc:  # noqa: BLE001 - odd path entries, unreadable dirs: note, keep walking
            self.notes.append(f"could not locate {name}: {exc!r}")
            return ModuleNode(name, "missing")
        if spec is None:
            return ModuleNode(name, "missing")
        if spec.loader is None and spec.origin is None:
            # namespace package; computed by hand because _NamespacePath would
            # consult the *live* sys.modules / sys.path, not the worker's
            dirs = [os.path.join(p, last) for p in locations if os.path.isdir(os.path.join(p, last))]
            return ModuleNode(name, "namespace", None, dirs)
        subs = list(spec.submodule_search_locations) if spec.submodule_search_locations is not None else None
        origin = spec.origin
        if origin:
            see(origin)
        for d in subs or ():
            see(d)
        if origin and not parent and _in_stdlib_dir(origin):
            return ModuleNode(name, "stdlib", origin)
        if isinstance(spec.loader, ExtensionFileLoader) or (
            origin and any(origin.endswith(s) for s in EXTENSION_SUFFIXES)
        ):
            return ModuleNode(name, "extension", origin, subs)
        if origin and origin.endswith(".py") and os.path.isfile(origin):
            if _checks_bytecode(origin):
                # the interpreter runs a valid cache instead of this source: the walk
                # must read what runs (red team 11 row 14)
                see(cache_path(origin))
                cached = unfaithful(origin)
                if cached:
                    self.unreadable.append((name, cached))
            return ModuleNode(name, "source", origin, subs)
        return ModuleNode(name, "opaque", origin, subs)

    def package_modules(self, top: str) -> list[str]:
        """Every module name under top-level package ``top`` (for pattern imports)."""
        cached = self._package_modules.get(top)
        if cached is not None:
            return cached
        out: list[str] = []
        node = self.resolve(top)
        suffixes = (".py", *EXTENSION_SUFFIXES)
        for root in node.search_locations or []:
            for dirpath, filenames in walk_dirs(root, keep=str.isidentifier):
                rel = os.path.relpath(dirpath, root)
                prefix = top if rel == "." else f"{top}.{rel.replace(os.sep, '.')}"
                out.append(prefix)
                for fn in filenames:
                    for suf in suffixes:
                        if fn.endswith(suf):
                            stem = fn[: -len(suf)]
                            if stem != "__init__" and stem.isidentifier():
                                out.append(f"{prefix}.{stem}")
                            break
        self._package_modules[top] = out = sorted(set(out))
        return out

    def _sites_of(self, node: ModuleNode) -> tuple[ImportSite, ...]:
        if node.kind != "source" or not node.file:
            if node.kind == "opaque":
                self.notes.append(f"{node.name}: no source to read ({node.file}); its imports were not walked")
                if node.file and node.file not in ("built-in", "frozen"):
                    self.unreadable.append((node.name, node.file))
            return ()
        try:
            sites, notes = _scan_file(node.file, node.name, node.search_locations is not None)
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            # (nested past the parser's stack: RecursionError/MemoryError, red team 12
            # row 2; a source no one can parse has no imports the interpreter would run
            # from it, unless a cache runs instead: judged by `unfaithful`)
            self.notes.append(f"{node.name}: could not parse {node.file}: "
                              f"{type(exc).__name__}: {exc}"[:300])
            return ()
        self.notes.extend(notes)
        return sites

    def _expand(self, site: ImportSite, importer: str) -> list[tuple[ImportSite, list[str]]]:
        """(site, targets in the order they run) for one import site."""
        if site.how != "pattern":
            return [(site, _prefixes(site.target))]
        top = site.head.split(".", 1)[0] if "." in site.head else importer.split(".", 1)[0]
        rx = re.compile(site.target)
        matched = [m for m in self.package_modules(top) if rx.fullmatch(m)]
        if not matched:
            self.notes.append(f"{importer}:{site.line}: computed import /{site.target}/ matches no module of {top}")
        return [(ImportSite(m, site.line, "dynamic", site.scope, site.lazy), _prefixes(m)) for m in matched]

    # --- walking ---------------------------------------------------------------
    def walk_module(self, entry: str) -> WalkResult:
        return self._walk(entry, self.resolve(entry))

    def walk_file(self, path: str, module: str = "__main__") -> WalkResult:
        path = os.path.abspath(path)
        node = ModuleNode(module, "source", path)
        self.nodes[module] = node
        return self._walk(module, node)

    def walk_code(self, code: str, module: str = "__main__") -> WalkResult:
        """``python -c CODE``."""
        sites, notes = scan_source(code, "<string>", module, False)
        node = ModuleNode(module, "code", "<string>")
        self.nodes[module] = node
        self.notes.extend(notes)
        return self._walk(module, node, initial_sites=sites)

    def _walk(
        self, entry: str, entry_node: ModuleNode, initial_sites: tuple[ImportSite, ...] | None = None
    ) -> WalkResult:
        result = WalkResult(entry, list(self.sys_path))
        # module -> (importer, line, verb): the BFS tree, for rebuilding chains
        came_from: dict[str, tuple[str, int | None, str]] = {}
        seen_hits: set[tuple[str, str, int]] = set()
        queue: deque[str] = deque([entry])
        visited = {entry}

        if entry_node.kind == "missing":
            self.notes.append(f"entry module {entry} not found on the worker's sys.path")
        # Running a.b.c runs a/__init__ and a/b/__init__ first.
        bits = entry.split(".")
        for i in range(len(bits) - 1, 0, -1):
            parent = ".".join(bits[:i])
            if parent not in visited:
                visited.add(parent)
                came_from[parent] = (".".join(bits[: i + 1]), None, "is inside package")
                queue.append(parent)

        def chain_to(module: str) -> list[Hop]:
            rev: list[tuple[str, int | None, str]] = []
            cur = module
            while cur in came_from:
                rev.append(came_from[cur])
                cur = came_from[cur][0]
            return [Hop(m, self.nodes[m].file if m in self.nodes else None, line, verb) for m, line, verb in reversed(rev)]

        while queue:
            current = queue.popleft()
            node = self.nodes.get(current) or self.resolve(current)
            sites = initial_sites if (current == entry and initial_sites is not None) else self._sites_of(node)
            for raw_site in sites:
                for site, targets in self._expand(raw_site, current):
                    for target in targets:
                        if forbidden_module_rule(target, importer=current) is not None:
                            # name the most specific rule for what the source wrote
                            rule = forbidden_module_rule(site.target, importer=current)
                            assert rule is not None
                            waiver = find_waiver(current, site.scope, site.target) if site.lazy else None
                            key = (current, rule.name, site.line if waiver else 0)
                            if key not in seen_hits:
                                seen_hits.add(key)
                                hops = chain_to(current) + [Hop(current, node.file, site.line, "imports")]
                                result.hits.append(ImportHit(site.target, rule, hops, site.scope, site.lazy, waiver))
                            break  # anything below a forbidden package is never reached through it
                        if target in visited:
                            continue
                        tnode = self.resolve(target)
                        if site.how == "from-name" and tnode.kind == "missing":
                            continue  # ``from a import b`` where b is an attribute
                        visited.add(target)
                        came_from[target] = (current, site.line, "imports")
                        if tnode.kind not in ("stdlib", "missing"):
                            queue.append(target)

        result.modules = {k: v for k, v in self.nodes.items() if k in visited}
        result.notes = list(dict.fromkeys(self.notes))
        result.unreadable = [u for u in dict.fromkeys(self.unreadable) if u[0] in visited]
        return result


def _prefixes(name: str) -> list[str]:
    """``import a.b.c`` runs a, a.b and a.b.c, in that order."""
    bits = name.split(".")
    return [".".join(bits[: i + 1]) for i in range(len(bits))]


def walk_module(entry: str, sys_path: list[str]) -> WalkResult:
    """Walk everything ``python -m entry`` could import, statically."""
    return ImportWalker(sys_path).walk_module(entry)


def walk_script(path: str, sys_path: list[str]) -> WalkResult:
    """Walk ``python path``: the script's directory comes first on sys.path."""
    return ImportWalker([os.path.dirname(os.path.abspath(path))] + list(sys_path)).walk_file(path)


def walk_code(code: str, sys_path: list[str]) -> WalkResult:
    """Walk ``python -c code``."""
    return ImportWalker(list(sys_path)).walk_code(code)

"""Reading one source file's imports without running it: every import statement,
including ones in function bodies and try/except blocks (only ``if TYPE_CHECKING:``
bodies are skipped), literal ``importlib.import_module`` / ``__import__`` calls, and
computed names with a literal part. Cached per file version."""

from __future__ import annotations

import ast
import errno
import re
from dataclasses import dataclass

from ._witness import FileId, read_identified, saw


@dataclass(frozen=True)
class ImportSite:
    """One statement (or literal dynamic call) that imports ``target``."""

    target: str
    line: int
    # "import" (statement), "from-name" (``from a import b``: b may be a plain
    # attribute rather than a submodule), "dynamic" (import_module/__import__),
    # "pattern" (computed name; target is a regex)
    how: str
    scope: str = ""  # enclosing def/class qualname; "" = module level
    lazy: bool = False  # inside a function body: runs only when called
    # for how == "pattern": target is a regex; this is its literal head
    # ("" when the name starts with a computed part)
    head: str = ""


# --------------------------------------------------------------------------
# Source scanning (cached per file version: a supervisor checks many workers
# that share site-packages, and tinygrad alone is ~200 files)

# (path, module, is_package) -> (the file's identity when read, its sites and notes);
# one entry per file, replaced when the file changes.
_SCAN_CACHE: dict[tuple[str, str, bool], tuple[FileId, tuple[tuple[ImportSite, ...], tuple[str, ...]]]] = {}


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING"
    return False


def _str_const(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _str_seq(node: ast.expr | None) -> list[str]:
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [s for s in (_str_const(e) for e in node.elts) if s]
    return []


_PATTERN_HOLE = r"[A-Za-z0-9_.]+"


def _name_pattern(node: ast.expr | None) -> tuple[str, str] | None:
    """A regex for a computed module name (f-string or ``"lit" + x``), and its literal head.

    ``f"{base}.runtime.ops_{x}"`` (tinygrad picks its device backend this way)
    becomes ``[A-Za-z0-9_.]+\\.runtime\\.ops_[A-Za-z0-9_.]+``. None when the literal
    text carries no name at all (``f"{path}.{name}"`` would match everything).
    """
    parts: list[str | None] = []  # None = a hole

    def flatten(n: ast.expr) -> bool:
        if isinstance(n, ast.JoinedStr):
            for v in n.values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    parts.append(v.value)
                else:
                    parts.append(None)
            return True
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
            return flatten(n.left) and flatten(n.right)
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            parts.append(n.value)
            return True
        parts.append(None)
        return True

    if node is None or not isinstance(node, (ast.JoinedStr, ast.BinOp)):
        return None
    flatten(node)
    literal = "".join(p for p in parts if p)
    if None not in parts:  # "tor" + "ch": a literal in disguise
        return re.escape(literal), literal
    if not literal.replace(".", "").strip():
        return None
    regex = "".join(_PATTERN_HOLE if p is None else re.escape(p) for p in parts)
    head = parts[0] if parts and parts[0] is not None else ""
    return regex, head


def _resolve_relative(name: str, package: str | None, level: int) -> str | None:
    """``importlib.util.resolve_name`` without raising: None when it would fail."""
    if level == 0:
        return name
    if not package:
        return None
    bits = package.split(".")
    if level - 1 >= len(bits):
        return None
    base = ".".join(bits[: len(bits) - (level - 1)])
    return f"{base}.{name}" if name else base


_STMT_LISTS = ("body", "orelse", "finalbody")


class _Scanner:
    """Collects import sites with their scope.

    Hand-rolled instead of ``ast.NodeVisitor``: a generic visit of every
    expression node costs ~10x more, and only statements can import unless the
    file mentions ``import_module``/``__import__`` (then calls are scanned too).
    """

    def __init__(self, module: str, package: str | None, filename: str, scan_calls: bool) -> None:
        self.module = module
        self.package = package
        self.filename = filename
        self.scan_calls = scan_calls
        self.sites: list[ImportSite] = []
        self.notes: list[str] = []
        # names bound to the importlib module / its import_module / __import__
        self.importlib_names: set[str] = set()
        self.import_module_names: set[str] = set()
        self.dunder_import_names: set[str] = {"__import__"}
        self.builtins_names: set[str] = set()

    # --- alias discovery (first pass, only when calls are scanned) -------------
    def collect_aliases(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "importlib":
                        self.importlib_names.add(a.asname or "importlib")
                    elif a.name == "builtins":
                        self.builtins_names.add(a.asname or "builtins")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in ("importlib", "builtins"):
                for a in node.names:
                    if a.name == "import_module" and node.module == "importlib":
                        self.import_module_names.add(a.asname or a.name)
                    elif a.name == "__import__":
                        self.dunder_import_names.add(a.asname or a.name)

    # --- statements ------------------------------------------------------------
    def walk(self, stmts: list[ast.stmt], scope: str, lazy: bool) -> None:
        for st in stmts:
            self._stmt(st, scope, lazy)

    def _stmt(self, st: ast.stmt, scope: str, lazy: bool) -> None:
        if isinstance(st, ast.Import):
            for alias in st.names:
                self.sites.append(ImportSite(alias.name, st.lineno, "import", scope, lazy))
            return
        if isinstance(st, ast.ImportFrom):
            self._import_from(st, scope, lazy)
            return
        if self.scan_calls:
            self._calls_in(st, scope, lazy)
        if isinstance(st, ast.If):
            if _is_type_checking(st.test):
                self.walk(st.orelse, scope, lazy)  # the body never runs
                return
            test = st.test
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _is_type_checking(test.operand):
                self.walk(st.body, scope, lazy)
                return
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # runs only if called, but it is still a path into the address space
            self.walk(st.body, f"{scope}.{st.name}" if scope else st.name, True)
            return
        if isinstance(st, ast.ClassDef):
            self.walk(st.body, f"{scope}.{st.name}" if scope else st.name, lazy)
            return
        for fld in _STMT_LISTS:
            self.walk(getattr(st, fld, None) or [], scope, lazy)
        for handler in getattr(st, "handlers", None) or []:  # try / try*
            self.walk(handler.body, scope, lazy)
        for case in getattr(st, "cases", None) or []:  # match
            self.walk(case.body, scope, lazy)

    def _import_from(self, st: ast.ImportFrom, scope: str, lazy: bool) -> None:
        base = _resolve_relative(st.module or "", self.package, st.level)
        if base is None:
            self.notes.append(f"{self.filename}:{st.lineno}: relative import beyond top-level package ignored")
            return
        if base:
            self.sites.append(ImportSite(base, st.lineno, "import", scope, lazy))
        for alias in st.names:
            if alias.name != "*":
                sub = f"{base}.{alias.name}" if base else alias.name
                self.sites.append(ImportSite(sub, st.lineno, "from-name", scope, lazy))

    # --- literal dynamic imports -------------------------------------------------
    def _calls_in(self, st: ast.stmt, scope: str, lazy: bool) -> None:
        """Calls in this statement's own expressions (nested statements are walked separately)."""
        for child in ast.iter_child_nodes(st):
            if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                continue
            for node in ast.walk(child):
                if isinstance(node, ast.Call):
                    self._call(node, scope, lazy or isinstance(child, ast.Lambda))

    def _call(self, node: ast.Call, scope: str, lazy: bool) -> None:
        func = node.func
        kind = None
        if isinstance(func, ast.Name):
            if func.id in self.import_module_names:
                kind = "import_module"
            elif func.id in self.dunder_import_names:
                kind = "__import__"
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if func.attr == "import_module" and owner in self.importlib_names:
                kind = "import_module"
            elif func.attr == "__import__" and (owner in self.importlib_names or owner in self.builtins_names):
                kind = "__import__"
        if kind is None:
            return
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        first = node.args[0] if node.args else kwargs.get("name")
        name = _str_const(first)
        if name is None:
            pattern = _name_pattern(first)
            if pattern is not None and pattern[0] == re.escape(pattern[1]):
                name = pattern[1]
            elif pattern is not None:
                # resolved later against the modules that actually exist
                regex, head = pattern
                self.sites.append(ImportSite(regex, node.lineno, "pattern", scope, lazy, head))
            else:
                self.notes.append(
                    f"{self.filename}:{node.lineno}: {kind}() with a computed name is not statically resolvable"
                )
            if name is None:
                return
        if kind == "import_module":
            target: str | None = name
            if name.startswith("."):
                pkg_node = node.args[1] if len(node.args) > 1 else kwargs.get("package")
                pkg = _str_const(pkg_node)
                if pkg is None and isinstance(pkg_node, ast.Name) and pkg_node.id in ("__package__", "__name__"):
                    pkg = self.package if pkg_node.id == "__package__" else self.module
                level = len(name) - len(name.lstrip("."))
                target = _resolve_relative(name[level:], pkg, level)
            if target:
                self.sites.append(ImportSite(target, node.lineno, "dynamic", scope, lazy))
            return
        # __import__(name, globals, locals, fromlist, level)
        level_node = node.args[4] if len(node.args) > 4 else kwargs.get("level")
        level = level_node.value if isinstance(level_node, ast.Constant) and isinstance(level_node.value, int) else 0
        base = _resolve_relative(name, self.package, level)
        if not base:
            return
        self.sites.append(ImportSite(base, node.lineno, "dynamic", scope, lazy))
        for sub in _str_seq(node.args[3] if len(node.args) > 3 else kwargs.get("fromlist")):
            if sub != "*":
                self.sites.append(ImportSite(f"{base}.{sub}", node.lineno, "from-name", scope, lazy))


def _parse_import_region(data: bytes, filename: str) -> ast.Module:
    """Parse only as much of a file as can hold its imports.

    Every way to import (``import``, ``from .. import``, ``__import__``,
    ``import_module``) contains the bytes "import", so nothing after their
    last occurrence can import. Big generated files (tinygrad's autogen
    bindings: 1 MB each) import at the top, and ``ast.parse`` dominates the
    walk. A prefix cut at a line end that parses cleanly has the same
    statements as the full file up to the cut (an unfinished string, bracket,
    or block is a SyntaxError); otherwise the whole file is parsed.
    """
    last = data.rfind(b"import")
    if last < 0:
        return ast.Module(body=[], type_ignores=[])
    if last < len(data) // 4:
        end = last
        for _ in range(6):  # a multi-line ``from x import (...)`` needs a few more lines
            end = data.find(b"\n", end + 1)
            if end < 0:
                break
            try:
                return ast.parse(data[: end + 1], filename=filename)
            except SyntaxError:
                continue
    return ast.parse(data, filename=filename)


def scan_source(
    source: str | bytes, filename: str, module: str, is_package: bool
) -> tuple[tuple[ImportSite, ...], tuple[str, ...]]:
    """Import sites of one module's source, and notes on what could not be resolved."""
    package = module if is_package else (module.rpartition(".")[0] or None)
    if module == "__main__":
        package = None
    raw = source.encode("utf-8", "surrogateescape") if isinstance(source, str) else source
    tree = _parse_import_region(raw, filename)
    scanner = _Scanner(module, package, filename, b"import_module" in raw or b"__import__" in raw)
    if scanner.scan_calls:
        scanner.collect_aliases(tree)
    scanner.walk(tree.body, "", False)
    sites = sorted(scanner.sites, key=lambda s: s.line)
    return tuple(sites), tuple(scanner.notes)


def _scan_file(path: str, module: str, is_package: bool) -> tuple[tuple[ImportSite, ...], tuple[str, ...]]:
    # The identity is taken before the read and recorded in the walk's witness: a
    # file rewritten after this stat is a different file to the next admission.
    ident, data = read_identified(path)
    if data is None:
        raise OSError(errno.EINVAL, "not a readable regular file", path)
    saw(path, ident)
    key = (path, module, is_package)
    cached = _SCAN_CACHE.get(key)
    if cached is None or cached[0] != ident:
        # the very bytes the identity's digest was taken of
        cached = (ident, scan_source(data, path, module, is_package))
        _SCAN_CACHE[key] = cached
    return cached[1]

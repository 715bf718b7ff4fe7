"""The public surface is pinned (as httpx's test_exported_members): the top-level names, one
exception tree in errors.py, and internal modules that export only what other code imports."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from collections import defaultdict
from pathlib import Path

import pyspark_acs
from pyspark_acs import errors

from tests.helpers import ROOT as HELPERS_ROOT

ROOT = Path(HELPERS_ROOT)

EXPECTED_TOP_LEVEL = [
    "AcsError", "AcsOptionError", "AcsTimeoutError", "AppendConflictError", "AppendLockBusyError",
    "CacheError", "CacheTimeoutError", "CacheUnavailableError", "ChecksumMismatchError", "ClosedError",
    "Consumer", "CorruptFileError", "DataLossError", "DefaultSource", "DeploymentError", "ForkError",
    "InvalidNameError", "LaterFileError", "LeaseError", "LeasePoisonedError", "Producer", "RootNotFoundError",
    "StaleEpochError", "StoreError", "StoreFileNotFoundError", "TierUploadError", "TopologyError", "TruncatedBlockError",
    "WriterConflictError", "__version__", "register",
]


def test_exported_members():
    assert sorted(pyspark_acs.__all__) == sorted(EXPECTED_TOP_LEVEL)
    for name in pyspark_acs.__all__:
        value = getattr(pyspark_acs, name)
        if name != "__version__":
            assert value.__module__.startswith("pyspark_acs"), name


def _modules():
    for info in pkgutil.walk_packages(pyspark_acs.__path__, "pyspark_acs."):
        if info.name.endswith("__main__"):
            continue
        yield importlib.import_module(info.name)


def test_every_error_class_lives_in_errors_and_its_drawn_tree():
    """Every AcsError subclass is defined in pyspark_acs/errors.py, exported there and from the
    package, and drawn in the tree of its docstring."""
    elsewhere = []
    for module in _modules():
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, errors.AcsError)
                    and value.__module__ == module.__name__ and module is not errors):
                elsewhere.append(f"{module.__name__}.{name}")
    assert not elsewhere, f"error classes outside pyspark_acs/errors.py: {elsewhere}"
    declared = {n for n, v in vars(errors).items() if inspect.isclass(v) and issubclass(v, errors.AcsError)}
    assert declared == set(errors.__all__)
    assert declared <= set(pyspark_acs.__all__)
    drawn = set(re.findall(r"(?:├──|└──)\s+(\w+)", errors.__doc__)) | {"AcsError"}  # the root
    assert drawn == declared
    for name in declared - {"AcsError"}:  # each is drawn under its parent
        cls = getattr(errors, name)
        assert cls.__bases__[0].__name__ in drawn | {"AcsError"}, name


def _imported_names():
    """Names each pyspark_acs module is imported for by the package's other modules and by
    benchmarks/, examples/, jars-free/ and scripts/ (``from m import x``; ``m.x`` after
    ``import m as alias``); the lazy names of pyspark_acs/__init__.py count too."""
    files = [p for top in ("pyspark_acs", "benchmarks", "examples", "jars-free", "scripts")
             for p in (ROOT / top).rglob("*.py")]

    def name_of(path: Path) -> str:
        rel = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel

    modules = {name_of(p) for p in files if p.parts[len(ROOT.parts)] == "pyspark_acs"}
    needed = defaultdict(set)
    for path in files:
        me = name_of(path)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                    elif source in modules and source != me:
                        needed[source].add(alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                if aliases[node.value.id] != me:
                    needed[aliases[node.value.id]].add(node.attr)
    lazy = ast.literal_eval(re.search(r"_LAZY = (\{.*?\})", (ROOT / "pyspark_acs/__init__.py").read_text(), re.S)[1])
    for name, module in lazy.items():
        needed["pyspark_acs" + module].add(name)
    return needed


def test_internal_modules_export_only_what_other_code_imports():
    """An internal module's ``__all__`` names only what the package's other modules,
    benchmarks/, examples/, jars-free/ and scripts/ import from it (tests may import more):
    tuning constants and helpers stay unexported."""
    needed = _imported_names()
    extra = {}
    for module in _modules():
        if module is pyspark_acs or not hasattr(module, "__all__"):
            continue
        unused = sorted(set(module.__all__) - needed[module.__name__])
        if unused:
            extra[module.__name__] = unused
    assert not extra, f"exported but imported by nobody outside the module: {extra}"


_CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]+$")


def _rewrites(tree: ast.AST):
    """``(line, name)`` of each UPPER_CASE attribute a test sets: ``monkeypatch.setattr`` or
    ``setattr`` on an object or by string path, ``mock.patch(.object)``, or a plain assignment
    to an attribute of an imported module."""
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pyspark_acs"):
            modules.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in ("setattr", "patch", "object", "setitem") or not node.args:
                continue
            texts = [a.value for a in node.args[:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            for text in texts:
                last = text.rpartition(".")[2]
                if _CONSTANT.match(last) and (text == last or text.startswith("pyspark_acs")):
                    yield node.lineno, last
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (isinstance(target, ast.Attribute) and _CONSTANT.match(target.attr)
                        and isinstance(target.value, ast.Name) and target.value.id in modules):
                    yield node.lineno, target.attr


def test_no_test_rewrites_a_module_constant():
    """Tunables a test changes are settings passed down (a frozen object, a constructor
    argument, a clock), never a module global rewritten under the code's feet."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for line, name in _rewrites(ast.parse(path.read_text(encoding="utf-8"))):
            found.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not found, "tests rewrite module constants (pass a setting down instead):\n" + "\n".join(found)


def test_the_rewrite_check_sees_each_form():
    src = '''
import pyspark_acs.read.consumer as consumer_mod
from pyspark_acs.cache import feed
monkeypatch.setattr(consumer_mod, "STUCK_WARN_AFTER_S", 1)
monkeypatch.setattr("pyspark_acs.datasource.sink.COMMIT_APPEND_BYTES", 1)
setattr(consumer_mod, "_SCAN_WINDOW", 2)
mock.patch("pyspark_acs.storage.store.STREAM_LOCK_WAIT_S", 3)
mock.patch.object(consumer_mod, "LISTING_BACKOFF_S", (0, 0))
feed.FEED_MAX_BYTES = 4
monkeypatch.setattr(DurableStore, "list_files", lambda: None)
monkeypatch.setattr(os, "environ", {})
'''
    assert [name for _, name in sorted(_rewrites(ast.parse(src)))] == [
        "STUCK_WARN_AFTER_S", "COMMIT_APPEND_BYTES", "_SCAN_WINDOW", "STREAM_LOCK_WAIT_S", "LISTING_BACKOFF_S",
        "FEED_MAX_BYTES"]


#: Public UPPER_CASE names more than one module may assign: the same word in unrelated senses.
SHARED_CONSTANT_NAMES = {
    # A type variable: each module's generic helpers have their own (it is no value to share).
    "T",
}
_PUBLIC_CONSTANT = re.compile(r"^[A-Z][A-Z0-9_]*$")


def _assigned_constants(tree: ast.Module):
    """``(line, name)`` of each public UPPER_CASE name a module's top level assigns (imports do
    not count)."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = [n for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            targets = [node.target] if getattr(node, "value", None) is not None else []
        else:
            continue
        for target in targets:
            if _PUBLIC_CONSTANT.match(target.id):
                yield node.lineno, target.id


def test_each_module_constant_has_one_definition():
    """A limit or default is defined in one module and imported where else it is used; two
    that differ on purpose have names that say which they are (CACHE_MAX_MESSAGE_BYTES,
    COPY_MAX_MESSAGE_BYTES). protoc's generated modules are left out (regenerated, not edited)."""
    where = defaultdict(list)
    for path in sorted((ROOT / "pyspark_acs").rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for line, name in _assigned_constants(ast.parse(path.read_text(encoding="utf-8"))):
            where[name].append(f"{path.relative_to(ROOT)}:{line}")
    shared = {name: places for name, places in where.items() if len({p.rsplit(":", 1)[0] for p in places}) > 1}
    twice = {name: places for name, places in shared.items() if name not in SHARED_CONSTANT_NAMES}
    assert not twice, f"module constants defined in more than one module (import one definition): {twice}"
    assert SHARED_CONSTANT_NAMES <= set(shared), "an allowed name is no longer shared; drop it from the list"


def test_the_constant_check_sees_assignments_not_imports():
    src = '''
from pyspark_acs.cache.wire import CACHE_MAX_MESSAGE_BYTES
import pyspark_acs.cache.wire as WIRE
LIMIT = 1
A, (B, _C) = 2, (3, 4)
TYPED: int = 5
DECLARED: int
_PRIVATE = 6
lower = 7
def f():
    INNER = 8
'''
    assert [name for _, name in _assigned_constants(ast.parse(src))] == ["LIMIT", "A", "B", "TYPED"]

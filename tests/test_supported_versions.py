"""The lowest Python, torch and numpy that pyproject.toml declares are ones the code runs on.

The suite runs on one Python and torch (``scripts/setup_env.sh``); the lowest are checked statically
here. Every module of both packages parses as the lowest Python (``ast.parse(feature_version=...)``)
and uses none of the newer features that parsing lets through (``PYTHON_FEATURES``): annotations
evaluated at run time (all of a module without ``from __future__ import annotations``, and the
fields of a dataclass whose hints fairseq, omegaconf or ``add_config_flags`` resolve), newer
builtins, methods and standard-library names, unless under ``sys.version_info >= (3, N)``. Every
torch and numpy API of ``LIBRARY_APIS`` exists in the declared lowest version, torch's lowest is
what its newest row needs, and every row is still used, so the table cannot rot: a call of a newer
torch API gets a row.
"""
import ast
import re
import tomllib
from typing import NamedTuple

import pytest

from conftest import REPO
from test_packaging import PACKAGE_DIRS

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
#: the Python the suite runs on (scripts/setup_env.sh); the classifiers run from the lowest to it
TESTED_PYTHON = (3, 11)
#: the lowest Python a torch release is built for (its Requires-Python): the lowest torch must
#: install on the lowest Python
TORCH_LOWEST_PYTHON = {(2, 4): (3, 8)}


def _lower_bound(spec: str, name: str = "") -> tuple:
    match = re.fullmatch(rf"{name}\s*>=\s*(\d+(?:\.\d+)*)", spec.strip())
    assert match, f"{spec!r}: the only bound declared must be a lower one (>=)"
    return tuple(int(part) for part in match.group(1).split("."))


def _dependency_floor(name: str) -> tuple:
    (spec,) = [spec for spec in PROJECT["dependencies"] if re.match(rf"{name}\s*[<>=!~]", spec)]
    return _lower_bound(spec, name)


PYTHON_FLOOR = _lower_bound(PROJECT["requires-python"])
FLOORS = {"torch": _dependency_floor("torch"), "numpy": _dependency_floor("numpy")}


class LibraryApi(NamedTuple):
    package: str
    api: str
    since: tuple  # the first release that has it
    used_as: str  # a regular expression that finds its use in the packages' source


LIBRARY_APIS = (
    LibraryApi("torch", "torch.serialization.add_safe_globals", (2, 4), r"torch\.serialization\.add_safe_globals\("),
    LibraryApi("torch", "torch.serialization.get_safe_globals", (2, 4), r"torch\.serialization\.get_safe_globals\("),
    LibraryApi("torch", "forward (pre-)hooks with_kwargs=True", (2, 0),
               r"register_forward_(pre_)?hook\(.*with_kwargs=True"),
    LibraryApi("torch", "Tensor.untyped_storage", (2, 0), r"\.untyped_storage\(\)"),
    LibraryApi("torch", "torch.load(weights_only=True)", (1, 13), r"torch\.load\(.*weights_only=True"),
    LibraryApi("torch", "torch.autocast(device_type, enabled=False)", (1, 10), r"torch\.autocast\(.*enabled=False"),
    # the allow-list names each numeric dtype's class, which numpy has from 1.20
    LibraryApi("numpy", "per-dtype classes, type(np.dtype(code))", (1, 20), r"type\(np\.dtype\("),
)

DECORATOR = "decorator other than a dotted name or its call (PEP 614)"
BUILTIN_GENERIC = "builtin generic evaluated at run time, list[int] (PEP 585)"
TYPE_UNION = "union of types evaluated at run time, X | None (PEP 604)"
DICT_UNION = "dict union, a | b (PEP 584)"
STARRED_SUBSCRIPT = "starred subscript, a[*b]"
ZIP_STRICT = "zip(strict=)"
TAR_FILTER = "tarfile extraction filter, extractall(filter=)"
KW_ONLY = "dataclass(kw_only=) or slots="
#: what ast.parse(feature_version=...) lets through (syntax it accepts, and names, which it never
#: checks), with the Python that brought it
PYTHON_FEATURES = {
    DECORATOR: (3, 9), BUILTIN_GENERIC: (3, 9), TYPE_UNION: (3, 10), DICT_UNION: (3, 9),
    STARRED_SUBSCRIPT: (3, 11), ZIP_STRICT: (3, 10), "hashlib's usedforsecurity=": (3, 9),
    KW_ONLY: (3, 10), "TemporaryDirectory(ignore_cleanup_errors=)": (3, 10),
    "ArgumentParser(exit_on_error=)": (3, 9), TAR_FILTER: (3, 12),
    # methods, whatever they are called on
    ".removeprefix()": (3, 9), ".removesuffix()": (3, 9), ".is_relative_to()": (3, 9),
    ".with_stem()": (3, 9), ".bit_count()": (3, 10), ".hardlink_to()": (3, 10),
    # standard-library modules and names
    "zoneinfo": (3, 9), "graphlib": (3, 9), "tomllib": (3, 11),
    "functools.cache": (3, 9), "math.lcm": (3, 9), "os.waitstatus_to_exitcode": (3, 9),
    "random.randbytes": (3, 9), "ast.unparse": (3, 9), "importlib.resources.files": (3, 9),
    "argparse.BooleanOptionalAction": (3, 9), "types.GenericAlias": (3, 9), "typing.Annotated": (3, 9),
    "asyncio.to_thread": (3, 9), "itertools.pairwise": (3, 10), "types.NoneType": (3, 10),
    "types.UnionType": (3, 10), "typing.TypeAlias": (3, 10), "typing.ParamSpec": (3, 10),
    "typing.TypeGuard": (3, 10), "sys.orig_argv": (3, 10), "sys.stdlib_module_names": (3, 10),
    "inspect.get_annotations": (3, 10), "contextlib.aclosing": (3, 10), "contextlib.chdir": (3, 11),
    "typing.Self": (3, 11), "typing.assert_never": (3, 11), "enum.StrEnum": (3, 11),
    "hashlib.file_digest": (3, 11), "datetime.UTC": (3, 11),
}
#: features that security releases of older Pythons gained: allowed where the module refuses
#: clearly without them (its source holds the check)
BACKPORTED = {TAR_FILTER: 'hasattr(tarfile, "data_filter")'}
#: (called name, keyword): the feature
_KEYWORDS = {("zip", "strict"): ZIP_STRICT, ("dataclass", "kw_only"): KW_ONLY, ("dataclass", "slots"): KW_ONLY,
             ("field", "kw_only"): KW_ONLY, ("extractall", "filter"): TAR_FILTER,
             ("TemporaryDirectory", "ignore_cleanup_errors"): "TemporaryDirectory(ignore_cleanup_errors=)",
             ("ArgumentParser", "exit_on_error"): "ArgumentParser(exit_on_error=)"}
_GENERIC_BUILTINS = {"list", "dict", "tuple", "set", "frozenset", "type"}
_TYPE_NAMES = _GENERIC_BUILTINS | {"int", "float", "str", "bytes", "bool", "complex", "object"}


def _name(node) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _guard(test) -> tuple:
    """``(3, 9)`` for ``sys.version_info >= (3, 9)``; ``()`` for any other test."""
    if (isinstance(test, ast.Compare) and ast.unparse(test.left) == "sys.version_info"
            and isinstance(test.ops[0], ast.GtE) and isinstance(test.comparators[0], ast.Tuple)):
        return tuple(ast.literal_eval(test.comparators[0]))
    return ()


class _FeatureFinder(ast.NodeVisitor):
    """The features of ``PYTHON_FEATURES`` one module uses: ``found``, ``{(line, feature)}``."""

    def __init__(self, tree: ast.Module, hinted_classes: set):
        self.found, self.hinted_classes, self.guarded = set(), hinted_classes, ()
        self.postponed = any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
                             and "annotations" in {alias.name for alias in node.names} for node in tree.body)
        self.abc_generics = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                             and node.module == "collections.abc" for alias in node.names}
        self.visit(tree)

    def report(self, node, feature: str) -> None:
        if PYTHON_FEATURES[feature] > self.guarded:
            self.found.add((node.lineno, feature))

    def annotation(self, node, evaluated: bool) -> None:
        """Annotations are not visited as expressions: a postponed one is a string at run time."""
        for part in ast.walk(node) if node is not None and evaluated else ():
            if isinstance(part, ast.BinOp) and isinstance(part.op, ast.BitOr):
                self.report(part, TYPE_UNION)
            elif isinstance(part, ast.Subscript) and self.builtin_generic(part):
                self.report(part, BUILTIN_GENERIC)

    def decorators(self, node) -> None:
        for decorator in node.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            while isinstance(target, ast.Attribute):
                target = target.value
            if not isinstance(target, ast.Name):
                self.report(decorator, DECORATOR)

    def visit_FunctionDef(self, node):
        self.decorators(node)
        self.annotation(node.returns, not self.postponed)
        for child in (*node.decorator_list, node.args, *node.body):
            self.visit(child)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self.decorators(node)
        for statement in node.body:  # get_type_hints(cls) evaluates even postponed field annotations
            if isinstance(statement, ast.AnnAssign) and node.name in self.hinted_classes:
                self.annotation(statement.annotation, True)
        self.generic_visit(node)

    def visit_arg(self, node):
        self.annotation(node.annotation, not self.postponed)

    def visit_AnnAssign(self, node):
        self.annotation(node.annotation, not self.postponed)
        for child in (node.target, node.value):
            if child is not None:
                self.visit(child)

    def visit_If(self, node):
        self.visit(node.test)
        outer, self.guarded = self.guarded, max(self.guarded, _guard(node.test))
        for child in node.body:
            self.visit(child)
        self.guarded = outer
        for child in node.orelse:
            self.visit(child)

    def visit_IfExp(self, node):
        self.visit(node.test)
        outer, self.guarded = self.guarded, max(self.guarded, _guard(node.test))
        self.visit(node.body)
        self.guarded = outer
        self.visit(node.orelse)

    def builtin_generic(self, node: ast.Subscript) -> bool:
        return isinstance(node.value, ast.Name) and node.value.id in _GENERIC_BUILTINS | self.abc_generics

    def visit_Subscript(self, node):
        if self.builtin_generic(node):
            self.report(node, BUILTIN_GENERIC)
        if any(isinstance(part, ast.Starred) for part in (node.slice, *getattr(node.slice, "elts", ()))):
            self.report(node, STARRED_SUBSCRIPT)
        self.generic_visit(node)

    def _union(self, node, left, right):
        if any(isinstance(side, (ast.Dict, ast.DictComp)) or (isinstance(side, ast.Call) and _name(side.func) == "dict")
               for side in (left, right)):
            self.report(node, DICT_UNION)
        elif any((isinstance(side, ast.Constant) and side.value is None)
                 or (isinstance(side, ast.Name) and side.id in _TYPE_NAMES) for side in (left, right)):
            self.report(node, TYPE_UNION)

    def visit_BinOp(self, node):
        if isinstance(node.op, ast.BitOr):
            self._union(node, node.left, node.right)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        if isinstance(node.op, ast.BitOr):
            self._union(node, node.target, node.value)
        self.generic_visit(node)

    def visit_Call(self, node):
        for keyword in node.keywords:
            feature = _KEYWORDS.get((_name(node.func), keyword.arg))
            if keyword.arg == "usedforsecurity":
                feature = "hashlib's usedforsecurity="
            if feature:
                self.report(node, feature)
        self.generic_visit(node)

    def visit_Attribute(self, node):
        dotted = ast.unparse(node)
        if dotted in PYTHON_FEATURES:
            self.report(node, dotted)
        if f".{node.attr}()" in PYTHON_FEATURES:
            self.report(node, f".{node.attr}()")
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.split(".")[0] in PYTHON_FEATURES:
                self.report(node, alias.name.split(".")[0])

    def visit_ImportFrom(self, node):
        for name in (node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)):
            if name in PYTHON_FEATURES:
                self.report(node, name)


def _modules() -> dict:
    """``{path relative to the checkout: source}`` of every module of both packages."""
    return {str(path.relative_to(REPO)): path.read_text(encoding="utf-8")
            for folder in PACKAGE_DIRS.values() for path in sorted((REPO / folder).rglob("*.py"))}


def _hinted_classes(trees) -> set:
    """Names of the classes whose annotations are evaluated at run time, postponed or not:
    registered with fairseq (``dataclass=``: fairseq and omegaconf read the field types) or given
    to ``add_config_flags`` / ``get_type_hints``; and their bases."""
    names, bases = set(), {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                given = [keyword.value for keyword in node.keywords if keyword.arg == "dataclass"]
                if _name(node.func) in ("add_config_flags", "get_type_hints", "structured"):
                    given += node.args
                names |= {_name(value) for value in given} - {""}
            elif isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, []).extend(_name(base) for base in node.bases)
    pending = list(names)
    while pending:
        for base in bases.get(pending.pop(), []):
            if base and base not in names:
                names.add(base)
                pending.append(base)
    return names


def _features_used(sources: dict) -> dict:
    """``{path: [(line, feature)]}`` of every feature newer than the declared lowest Python."""
    trees = {path: ast.parse(source) for path, source in sources.items()}
    hinted, newer = _hinted_classes(trees.values()), {}
    for path, tree in trees.items():
        found = sorted((line, feature) for line, feature in _FeatureFinder(tree, hinted).found
                       if PYTHON_FEATURES[feature] > PYTHON_FLOOR
                       and not (feature in BACKPORTED and BACKPORTED[feature] in sources[path]))
        if found:
            newer[path] = found
    return newer


def test_the_classifiers_and_the_lowest_torch_agree_with_the_lowest_python():
    classifiers = [c for c in PROJECT["classifiers"] if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    declared = sorted(tuple(int(n) for n in c.rsplit(" ", 1)[1].split(".")) for c in classifiers)
    assert declared == [(3, minor) for minor in range(PYTHON_FLOOR[1], TESTED_PYTHON[1] + 1)], (
        f"the classifiers name {declared}: each Python from requires-python's {PYTHON_FLOOR} to the tested one")
    assert FLOORS["torch"][:2] in TORCH_LOWEST_PYTHON, f"add torch {FLOORS['torch']} to TORCH_LOWEST_PYTHON"
    assert PYTHON_FLOOR >= TORCH_LOWEST_PYTHON[FLOORS["torch"][:2]], (
        f"torch {FLOORS['torch']} is not released for Python {PYTHON_FLOOR}: a resolver would find no torch there")


def test_every_module_parses_as_the_lowest_python():
    refused = []
    for path, source in _modules().items():
        try:
            ast.parse(source, filename=path, feature_version=PYTHON_FLOOR[:2])
        except SyntaxError as error:
            refused.append(f"{path}:{error.lineno}: {error.msg}")
    assert not refused, f"pyproject.toml declares Python >= {PYTHON_FLOOR}, but:\n" + "\n".join(refused)


def test_no_module_uses_a_feature_newer_than_the_lowest_python():
    newer = _features_used(_modules())
    lines = [f"{path}:{line}: {feature} (Python {'.'.join(map(str, PYTHON_FEATURES[feature]))})"
             for path, found in newer.items() for line, feature in found]
    assert not lines, (f"pyproject.toml declares Python >= {PYTHON_FLOOR}, but the code uses newer features "
                       "(rewrite them, or guard them with sys.version_info):\n" + "\n".join(lines))


@pytest.mark.parametrize("source, feature", [
    ("@handlers[0]\ndef f(): pass\n", DECORATOR),
    ("from __future__ import annotations\nALIASES = dict[str, int]\n", BUILTIN_GENERIC),
    ("def f(x: list[int]): pass\n", BUILTIN_GENERIC),
    ("from collections.abc import Sequence\ndef f() -> Sequence[int]: pass\n", BUILTIN_GENERIC),
    ("def f(x: 'int', y: int | None = None): pass\n", TYPE_UNION),
    ("isinstance(x, int | str)\n", TYPE_UNION),
    ("from __future__ import annotations\nfrom dataclasses import dataclass\n@dataclass\nclass Config:\n"
     "    path: str | None = None\nadd_config_flags(parser, Config)\n", TYPE_UNION),
    ("merged = {k: v for k, v in a.items()} | {'b': 1}\n", DICT_UNION),
    ("options |= dict(b=1)\n", DICT_UNION),
    ("pairs = list(zip(a, b, strict=True))\n", ZIP_STRICT),
    ("import hashlib\nhashlib.md5(usedforsecurity=False)\n", "hashlib's usedforsecurity="),
    ("name = text.removeprefix('x')\n", ".removeprefix()"),
    ("inside = path.is_relative_to(root)\n", ".is_relative_to()"),
    ("import os\ncode = os.waitstatus_to_exitcode(status)\n", "os.waitstatus_to_exitcode"),
    ("from functools import cache\n", "functools.cache"),
    ("import tomllib\n", "tomllib"),
    ("tar.extractall(folder, filter='data')\n", TAR_FILTER),
    ("a[*b]\n", STARRED_SUBSCRIPT),
])
def test_the_feature_finder_finds(source, feature):
    tree = ast.parse(source)
    assert feature in {found for _, found in _FeatureFinder(tree, _hinted_classes([tree])).found}


@pytest.mark.parametrize("source", [
    "from __future__ import annotations\ndef f(x: list[int] | None) -> dict[str, int]: pass\n",
    "from __future__ import annotations\nfrom dataclasses import dataclass\n@dataclass\nclass Row:\n"
    "    names: list[str]\n",
    "import sys, hashlib\nmd5 = hashlib.md5(usedforsecurity=False) if sys.version_info >= (3, 9) else hashlib.md5()\n",
    "flags = os.O_CREAT | os.O_EXCL\nseen = set(a) | {1}\n",
])
def test_the_feature_finder_lets_through(source):
    """Postponed annotations (of a dataclass nothing resolves too), guarded code, other unions."""
    tree = ast.parse(source)
    assert not _FeatureFinder(tree, _hinted_classes([tree])).found


@pytest.mark.parametrize("row", LIBRARY_APIS, ids=lambda row: row.api)
def test_each_library_api_exists_in_the_declared_lowest_version_and_is_used(row):
    assert row.since <= FLOORS[row.package], (
        f"{row.api} needs {row.package} {row.since}; pyproject.toml declares {row.package} >= {FLOORS[row.package]}")
    users = [path for path, source in _modules().items() if re.search(row.used_as, source)]
    assert users, f"no module uses {row.api} any more: remove its row from LIBRARY_APIS"


def test_the_lowest_torch_is_what_the_newest_api_needs():
    newest = max(row.since for row in LIBRARY_APIS if row.package == "torch")
    assert FLOORS["torch"][:2] == newest, (
        f"pyproject.toml declares torch >= {FLOORS['torch']}, but the newest API in LIBRARY_APIS needs {newest}: "
        "declare that, or add the row that needs the higher floor")

"""The Python subset the NKI compiler accepts, checked on a kernel file's source (its AST) before it runs.

AWS's own simulator runs a kernel as plain Python, so "kernels that use unsupported Python constructs will execute
successfully on the simulator but fail to compile for hardware" (aws-neuron-sdk ``nki/guides/nki_simulator.rst``,
"NKI Meta-Programming Support"). mhcrun's simulator refuses them when it loads the file instead. The rules, each
with the document it rests on:

- ``lambda``: the NKI Language Guide (aws-neuron-sdk ``nki/get-started/nki-language-guide.rst``) lists the values
  a kernel may hold (None, bool, int, float, str, tensors; tuples, lists, dicts with string keys, NKIObject
  classes, and module-level functions passed by name, "Composable Kernels"); an anonymous function is none of
  them, and AWS's public DeepSeek-V4 kernels (aws-neuron/nki-library ``experimental/deepseek_v4_csa``) use none.
- comprehensions and generator expressions (list / set / dict / generator): not in the Language Guide's control
  flow (for over ranges, lists and tuples; while; if), absent from the public V4 kernels: write a plain loop.
- functions or classes defined inside a function (closures, directly called inner functions): the Language
  Guide's composition passes module-level functions; closures over mutable state break kernel caching (NKI 0.3.0
  release notes, "Known Issues / Caching": kernel outputs must depend on the arguments alone).
- keyword-only parameters (``*`` in a signature): NKI 0.3.0 release notes, "Breaking Changes".
- ``**kwargs`` and ``*args`` parameters: not in the Language Guide; the public V4 kernels use fixed parameters.
- ``is`` / ``is not``: NKI 0.3.0 release notes, "Breaking Changes" (use ``==`` / ``!=``).
- ``yield`` / ``await`` / ``async``, ``global`` / ``nonlocal``, ``try``: not in the Language Guide's subset.
- imports other than ``nki``, ``nki.language``, ``nki.isa`` (and ``import`` inside a function), and calls into any
  other module: a kernel's runtime operations are the ``nki.isa`` / ``nki.language`` calls (Language Guide,
  "Compilation Model"); everything else must be the file's own module-level functions or the Python built-ins
  the meta-language evaluates (``range``, ``len``, ``min``, ``max``, ...).

One error names the file, the line and the construct (``NkiLanguageError``).
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

from .errors import NkiSimError

NKI_MODULES = frozenset({"nki", "nki.language", "nki.isa"})

# Built-ins the NKI meta-language evaluates at specialization time (Language Guide: values, containers, loops).
ALLOWED_BUILTINS = frozenset({
    "range", "len", "min", "max", "abs", "int", "float", "bool", "str", "tuple", "list", "dict", "print",
    "isinstance", "enumerate", "zip", "reversed", "round", "divmod", "AssertionError", "ValueError",
})  # fmt: skip


class NkiLanguageError(NkiSimError):
    """A kernel source uses Python the NKI compiler does not accept."""


def _dotted(node: ast.AST) -> str | None:
    """'a.b.c' for a Name / Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


class _Checker(ast.NodeVisitor):
    def __init__(self):
        self.problems: list[tuple[int, str]] = []
        self.module_names: set[str] = set()  # module-level functions and classes of the file
        self.nki_aliases: set[str] = set()  # names bound to nki, nki.language, nki.isa
        self.other_imports: set[str] = set()
        self.depth = 0  # function nesting

    def refuse(self, node: ast.AST, what: str) -> None:
        self.problems.append((getattr(node, "lineno", 0), what))

    # ---- module level

    def check_module(self, tree: ast.Module) -> None:
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.module_names.add(node.name)
            elif isinstance(node, ast.AsyncFunctionDef):
                self.refuse(node, f"async function '{node.name}'")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in NKI_MODULES:
                        self.nki_aliases.add(a.asname or a.name.split(".")[0])
                    else:
                        self.other_imports.add(a.asname or a.name.split(".")[0])
                        self.refuse(node, f"import of module '{a.name}' (a kernel file imports only nki, "
                                          "nki.language and nki.isa)")
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level == 0 and mod == "nki" and all(a.name in ("language", "isa") for a in node.names):
                    self.nki_aliases.update(a.asname or a.name for a in node.names)
                else:
                    self.refuse(node, f"import from module '{'.' * node.level}{mod}' (a kernel file imports only "
                                      "nki, nki.language and nki.isa)")
        self.visit(tree)

    # ---- constructs refused anywhere

    def visit_Lambda(self, node):
        self.refuse(node, "lambda (write a module-level function)")
        self.generic_visit(node)

    def _comp(self, node, kind):
        self.refuse(node, f"{kind} (write a plain for loop)")
        self.generic_visit(node)

    def visit_ListComp(self, node):
        self._comp(node, "list comprehension")

    def visit_SetComp(self, node):
        self._comp(node, "set comprehension")

    def visit_DictComp(self, node):
        self._comp(node, "dict comprehension")

    def visit_GeneratorExp(self, node):
        self._comp(node, "generator expression")

    def _function(self, node):
        if self.depth > 0:
            self.refuse(node, f"function '{node.name}' defined inside a function (a closure or inner function; "
                              "define it at module level)")
        a = node.args
        if a.kwonlyargs:
            self.refuse(node, f"keyword-only parameter '{a.kwonlyargs[0].arg}' of '{node.name}'")
        if a.kwarg is not None:
            self.refuse(node, f"'**{a.kwarg.arg}' parameter of '{node.name}'")
        if a.vararg is not None:
            self.refuse(node, f"'*{a.vararg.arg}' parameter of '{node.name}'")
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    def visit_FunctionDef(self, node):
        self._function(node)

    def visit_AsyncFunctionDef(self, node):
        self.refuse(node, f"async function '{node.name}'")
        self._function(node)

    def visit_ClassDef(self, node):
        if self.depth > 0:
            self.refuse(node, f"class '{node.name}' defined inside a function")
        self.generic_visit(node)

    def visit_Compare(self, node):
        for op in node.ops:
            if isinstance(op, (ast.Is, ast.IsNot)):
                self.refuse(node, f"'{'is' if isinstance(op, ast.Is) else 'is not'}' comparison (use == / !=)")
        self.generic_visit(node)

    def visit_Yield(self, node):
        self.refuse(node, "yield (a generator)")
        self.generic_visit(node)

    visit_YieldFrom = visit_Yield

    def visit_Await(self, node):
        self.refuse(node, "await")
        self.generic_visit(node)

    def visit_Global(self, node):
        self.refuse(node, "global statement")

    def visit_Nonlocal(self, node):
        self.refuse(node, "nonlocal statement")

    def visit_Try(self, node):
        self.refuse(node, "try statement")
        self.generic_visit(node)

    visit_TryStar = visit_Try

    def visit_Import(self, node):
        if self.depth > 0:
            self.refuse(node, "import inside a function")

    visit_ImportFrom = visit_Import

    # ---- calls

    def visit_Call(self, node):
        name = _dotted(node.func)
        if name is not None:
            root = name.split(".")[0]
            if root in self.other_imports:
                self.refuse(node, f"call into module '{root}' ({name}); a kernel calls only nki, nki.language, "
                                  "nki.isa and the file's own module-level functions")
            elif "." not in name and root not in self.module_names and hasattr(builtins, root) \
                    and root not in ALLOWED_BUILTINS:
                self.refuse(node, f"call of the Python built-in '{root}', which the NKI meta-language does not have")
        self.generic_visit(node)


def find_problems(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, construct) of every construct outside NKI's subset, in line order."""
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as e:
        raise NkiLanguageError(f"{filename}:{e.lineno}: not valid Python: {e.msg}") from None
    c = _Checker()
    c.check_module(tree)
    return sorted(c.problems)


def check_source(source: str, filename: str) -> None:
    """Raise NkiLanguageError naming file, line and construct for the first construct outside NKI's subset."""
    problems = find_problems(source, filename)
    if problems:
        line, what = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise NkiLanguageError(f"{filename}:{line}: {what} is not in the Python subset the NKI compiler accepts"
                               f"{more}")


def check_file(path: str | Path) -> None:
    p = Path(path)
    check_source(p.read_text(), str(p))

"""Attribute docstrings of a dataclass (the string literal under each field): the one place a configuration
key is documented, read back for `--help` and `hydrafl strategies`; and each field's type by name."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from functools import cache


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Per field name, its docstring (whitespace collapsed), including those declared on base classes."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for statement, following in itertools.pairwise(body):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def field_types(cls: type) -> dict[str, str]:
    """Per field name, its type's name ("int", "float", ...): a string annotation (a module with `from __future__
    import annotations`) or the type itself (a module without), so a config class may be written either way."""
    return {
        f.name: f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        for f in dataclasses.fields(cls)
    }

"""The Prompt Markup Language: schema and prompt trees, parsing and errors. No torch.

``nodes`` (the trees), ``source`` (reading files and strict XML: DOCTYPEs refused, ``src``
confined), ``parser`` (text -> trees), ``whitespace`` (the whitespace rule), ``rules`` (names,
scopes, unions, roles, emptiness and imports: the one rule set the parser, the layout and the
builder share), ``errors`` (``PMLError``, ``PMLErrors``, ``SourceFileError``).

A ``str`` is always PML text (or a plain-text prompt), never a file name; pass a ``pathlib.Path``
to read a file.
"""

from .errors import PMLError, PMLErrors, SourceFileError
from .nodes import ROLES, Module, ModuleRef, Parameter, Prompt, PromptRole, Role, Schema, Text, Union
from .parser import parse_prompt, parse_schema

__all__ = [
    "PMLError", "PMLErrors", "ROLES", "Module", "ModuleRef", "Parameter", "Prompt", "PromptRole", "Role", "Schema",
    "SourceFileError", "Text", "Union", "parse_prompt", "parse_schema",
]

"""The Prompt Markup Language: schema and prompt trees, parsing and errors. No torch."""

from .errors import PMLError
from .nodes import ROLES, Module, ModuleRef, Parameter, Prompt, PromptRole, Role, Schema, Text, Union
from .parser import parse_prompt, parse_schema

__all__ = [
    "PMLError", "ROLES", "Module", "ModuleRef", "Parameter", "Prompt", "PromptRole", "Role", "Schema",
    "Text", "Union", "parse_prompt", "parse_schema",
]

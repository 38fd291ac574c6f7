"""Jinja filters that quote an answer for the syntax of the file it lands in, so that every
answer reads back exactly as typed (cookiecutter.json's `_extensions` loads them).

Jinja's own `tojson` is made for HTML: it writes non-ASCII as \\u escapes, and a character outside
the Basic Multilingual Plane (an emoji) as a surrogate pair, which TOML refuses and YAML and
Python read back as two broken characters. A JSON string written with the characters themselves
is a valid double-quoted string in YAML, in TOML (basic string) and in Python, with the same
value in each: the hook refuses control characters and Unicode line breaks, the only characters
whose escapes would differ.
"""

import json
import re

from cookiecutter.utils import simple_filter

# What can start emphasis, code, a link, HTML, an entity, a table cell, a heading, a list or a
# quote; CommonMark lets a backslash make each of them literal.
MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>&|~#+!-])")


def quoted(value: object) -> str:
    return json.dumps(str(value), ensure_ascii=False)


@simple_filter
def yaml_str(value: object) -> str:
    """A YAML double-quoted scalar: never read as a bool, a number, null or a comment."""
    return quoted(value)


@simple_filter
def toml_str(value: object) -> str:
    """A TOML basic string."""
    return quoted(value)


@simple_filter
def md_text(value: object) -> str:
    """Text that Markdown shows as typed: no emphasis, links, headings or HTML."""
    return MARKDOWN_SPECIAL.sub(r"\\\1", str(value))

"""Refuse any answer that would render a broken or unsafe project.

Runs under cookiecutter's own Python (standard library only). One line for the first problem,
then a non-zero exit, so cookiecutter deletes the directory it was about to fill.
"""

import json
import keyword
import re
import sys

import cookiecutter

# Raw string, and tojson escapes every quote: no answer can end this literal early.
ANSWERS = json.loads(r'''{{ cookiecutter | tojson }}''')  # fmt: skip

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
PACKAGE = re.compile(r"[a-z_][a-z0-9_]*")
PYTHON_VERSION = re.compile(r"3\.(1[1-3])")
# An OCI image reference: [registry[:port]/]path[:tag][@sha256:digest], without spaces or quotes.
IMAGE = re.compile(
    r"(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?"
)
# Jinja delimiters, spelled as character classes so that this file itself renders.
JINJA = re.compile(r"[{][#%{]|[#%}][}]")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Our own dependencies and the standard library: a package of that name would shadow them.
SHADOWED = {"torch", "hydra", "omegaconf", "tests", "test", "src"} | set(sys.stdlib_module_names)
FREE_TEXT_MAX = 200
# 2.6 and older read booleans given on the command line as strings, which render as true.
MIN_COOKIECUTTER = (2, 7)


def check_dns_label(key: str, value: str) -> str | None:
    if len(value) > 63 or not DNS_LABEL.fullmatch(value):
        return (
            f"{key} {value!r} is not a Kubernetes DNS-1123 label: use 1 to 63 lowercase letters, "
            "digits and '-', starting and ending with a letter or digit (e.g. ddp-project)"
        )
    return None


def check_package(key: str, value: str) -> str | None:
    if not PACKAGE.fullmatch(value) or not value.isidentifier():
        return (
            f"{key} {value!r} is not a Python package name: use lowercase ASCII letters, digits and "
            "'_', not starting with a digit (e.g. ddp_project)"
        )
    if keyword.iskeyword(value) or keyword.issoftkeyword(value):
        return f"{key} {value!r} is a Python keyword: choose another name (e.g. {value}_ddp)"
    if value in SHADOWED:
        return (
            f"{key} {value!r} would shadow the module of the same name from the standard library "
            f"or a dependency: choose another name (e.g. {value}_ddp)"
        )
    return None


def check_num_gpus(key: str, value: object) -> str | None:
    text = str(value)
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 16:
        return f"{key} {text!r} is not a whole number of GPUs per node: use an integer from 1 to 16"
    return None


def check_num_nodes(key: str, value: object) -> str | None:
    text = str(value)
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 256:
        return f"{key} {text!r} is not a whole number of nodes: use an integer from 1 to 256"
    return None


def check_python_version(key: str, value: str) -> str | None:
    if not PYTHON_VERSION.fullmatch(value):
        return f"{key} {value!r} is not supported: use one of 3.11, 3.12, 3.13"
    return None


def check_image(key: str, value: str) -> str | None:
    if len(value) > 255 or not IMAGE.fullmatch(value):
        return (
            f"{key} {value!r} is not an image reference: use [registry/]name[:tag][@sha256:digest] "
            "with no spaces or quotes (e.g. ghcr.io/acme/ddp-project:latest)"
        )
    return None


def check_free_text(key: str, value: str) -> str | None:
    """Quotes, '$' and ';' are fine here: every file that uses these values escapes them."""
    if CONTROL.search(value):
        return f"{key} {value!r} contains a newline or control character: use a single line of text"
    if JINJA.search(value):
        return f"{key} {value!r} contains template delimiters: use plain text without braces"
    if len(value) > FREE_TEXT_MAX:
        return f"{key} is {len(value)} characters long: use at most {FREE_TEXT_MAX}"
    return None


CHECKS = {  # in prompt order
    "project": check_dns_label,
    "package": check_package,
    "description": check_free_text,
    "author": check_free_text,
    "python_version": check_python_version,
    "num_gpus": check_num_gpus,
    "num_nodes": check_num_nodes,
    "base_image": check_image,
    "image": check_image,
    "namespace": check_dns_label,
}


def first_problem(answers: dict) -> str | None:
    """The first bad answer, in prompt order: later ones often derive from it (package, image)."""
    for key, check in CHECKS.items():
        value = answers[key]
        message = check(key, value) if isinstance(value, str | int) else f"{key} must be text"
        if message:
            return message
    return None


def version_problem(version: str) -> str | None:
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if numbers < MIN_COOKIECUTTER:
        return f"cookiecutter {version} is too old: this template needs 2.7 or newer (pip install 'cookiecutter>=2.7')"
    return None


def main() -> int:
    message = version_problem(cookiecutter.__version__) or first_problem(ANSWERS)
    if message:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Refuse any answer that would render a broken or unsafe project.

Runs under cookiecutter's own Python (standard library only). One line for the first problem,
then a non-zero exit, so cookiecutter deletes the directory it was about to fill. The checks are
plain functions: ./new-project imports this file unrendered and runs them before cookiecutter.
"""

import json
import keyword
import re
import sys
import unicodedata

import cookiecutter

# The project's k8s/checks.py holds the same name and image rules; this hook cannot load them (it
# runs from a rendered copy, with no path to the template under cruft), so tests/test_hooks.py
# gives both the same hostile names and images and checks that they agree.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# The project names the Job's Service and TrainJob too: those must start with a letter (RFC 1035).
RFC1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
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
# Characters whose meaning changes between YAML, TOML and Python, or that start a new line: control
# characters, surrogates, Unicode line and paragraph separators, a byte-order mark.
UNPRINTABLE_CATEGORIES = {"Cc", "Cs", "Zl", "Zp"}
# Top-level modules that the generated project imports, directly or through its dependencies, the
# project's own top-level names, and the standard library: a package of such a name would shadow
# them. Kept by hand, as this hook cannot import the dependencies; tests/test_hooks.py reads what
# each installed one's RECORD lists, transitively with extras, and names any module missing here.
# Some are from other builds and versions than the tests install: CUDA torch's nvidia and triton.
THIRD_PARTY = {
    "torch", "torchgen", "functorch", "triton", "numpy", "sympy", "mpmath", "networkx", "jinja2",
    "markupsafe", "fsspec", "filelock", "typing_extensions", "setuptools", "pkg_resources",
    "_distutils_hack", "hydra", "omegaconf", "antlr4", "yaml", "_yaml", "ruamel", "packaging", "pynvml",
    "nvidia", "tensorboard", "tensorboard_data_server", "google", "grpc", "absl", "markdown",
    "werkzeug", "PIL", "six", "rich", "pygments", "markdown_it", "mdurl", "matplotlib",
    "mpl_toolkits", "pylab", "contourpy", "cycler", "fontTools", "kiwisolver", "pyparsing",
    "dateutil", "pytest", "_pytest", "py", "pluggy", "iniconfig", "pytest_timeout", "ruff",
    "pydevd_plugins", "importlib_resources", "isympy", "pillow", "tzdata", "example",
    # tokenizers (python -m <package>.prepare) and what it brings: huggingface_hub's
    "tokenizers", "huggingface_hub", "hf_xet", "tqdm", "httpx2", "httpcore2", "truststore",
    # the extras: logger=wandb, logger=mlflow, and the test tools
    "wandb", "mlflow", "xdist", "execnet", "_cffi_backend", "annotated_doc", "annotated_types",
    "anyio", "cachetools", "certifi", "cffi", "charset_normalizer", "click", "cloudpickle",
    "coreweave_evaluations", "cryptography", "databricks", "distro", "dotenv", "fastapi", "git",
    "gitdb", "h11", "httpcore", "httpx", "idna", "importlib_metadata", "opentelemetry",
    "package_readme", "platformdirs", "pyasn1", "pyasn1_modules", "pycparser", "pydantic",
    "pydantic_core", "requests", "smmap", "sniffio", "sqlparse", "starlette", "typing_inspection",
    "urllib3", "uvicorn", "xxhash", "zipp",
    # python -m <package>.export writes safetensors; hparams_search=optuna and what it brings
    "safetensors", "hydra_plugins", "optuna", "alembic", "autopage", "cliff", "cmaes", "cmd2",
    "colorlog", "mako", "prettytable", "prompt_toolkit", "pyperclip", "rich_argparse", "scipy",
    "sqlalchemy", "stevedore", "wcwidth",
}  # fmt: skip
OWN = {"tests", "test", "src", "configs", "conftest", "outputs", "k8s"}
SHADOWED = THIRD_PARTY | OWN | set(sys.stdlib_module_names)
FREE_TEXT_MAX = 200
# The Job's pods are named <project>-<index>-<5 characters>; the generated config's
# deploy.name allows the same 47 (tests/test_hooks.py renders one at the limit and checks it).
PROJECT_MAX = 47
# 2.6 and older read booleans given on the command line as strings, which render as true.
MIN_COOKIECUTTER = (2, 7)


def check_project(key: str, value: str) -> str | None:
    if len(value) > PROJECT_MAX or not RFC1035_LABEL.fullmatch(value):
        return (
            f"{key} {value!r} is not a Kubernetes name of at most {PROJECT_MAX} characters: use "
            "lowercase letters, digits and '-', starting with a letter and ending with a letter or "
            "digit (e.g. ddp-project)"
        )
    return None


def check_namespace(key: str, value: str) -> str | None:
    if len(value) > 63 or not DNS_LABEL.fullmatch(value):
        return (
            f"{key} {value!r} is not a Kubernetes DNS-1123 label of at most 63 characters: use "
            "lowercase letters, digits and '-', starting and ending with a letter or digit"
        )
    return None


def check_package(key: str, value: str, derived: bool = False) -> str | None:
    derived = " (made from project; pass package=... to choose it)" if derived else ""
    if not PACKAGE.fullmatch(value) or not value.isidentifier():
        return (
            f"{key} {value!r}{derived} is not a Python package name: use lowercase ASCII letters, "
            "digits and '_', not starting with a digit (e.g. ddp_project)"
        )
    if keyword.iskeyword(value) or keyword.issoftkeyword(value):
        return f"{key} {value!r}{derived} is a Python keyword: choose another name (e.g. {value}_ddp)"
    if value in SHADOWED:
        return (
            f"{key} {value!r}{derived} would shadow the module of that name, which the project or "
            f"its dependencies import: choose another name (e.g. {value}_ddp)"
        )
    return None


def whole_number_problem(key: str, value: object, what: str, top: int) -> str | None:
    """Digits as typed, no sign, no leading zero: the spelling that YAML, TOML, Python and
    JSON all read as the same integer."""
    text = str(value)
    if not re.fullmatch(r"[1-9][0-9]*", text) or int(text) > top:
        return f"{key} {text!r} is not a number of {what}: use a whole number from 1 to {top}, digits only"
    return None


def check_num_gpus(key: str, value: object) -> str | None:
    return whole_number_problem(key, value, "GPUs per node", 16)


def check_num_nodes(key: str, value: object) -> str | None:
    return whole_number_problem(key, value, "nodes", 256)


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
    """Quotes, '#', ': ', backslashes and any printable Unicode are fine: every file quotes these
    values for its own syntax (local_extensions.py)."""
    bad = [c for c in value if unicodedata.category(c) in UNPRINTABLE_CATEGORIES or c == "\ufeff"]
    if bad:
        name = unicodedata.name(bad[0], "a control character")
        return f"{key} contains U+{ord(bad[0]):04X} ({name}): use a single line of printable text"
    if JINJA.search(value):
        # cookiecutter renders every answer as a template before the hook sees it
        return f"{key} {value!r} contains template delimiters: use plain text without braces"
    if len(value) > FREE_TEXT_MAX:
        return f"{key} is {len(value)} characters long: use at most {FREE_TEXT_MAX}"
    return None


CHECKS = {  # in prompt order
    "project": check_project,
    "package": check_package,
    "description": check_free_text,
    "author": check_free_text,
    "python_version": check_python_version,
    "num_gpus": check_num_gpus,
    "num_nodes": check_num_nodes,
    "base_image": check_image,
    "image": check_image,
    "namespace": check_namespace,
}


def first_problem(answers: dict) -> str | None:
    """The first bad answer, in prompt order: later ones often derive from it (package, image)."""
    derived = answers["package"] == str(answers["project"]).replace("-", "_")
    for key, check in CHECKS.items():
        value = answers[key]
        is_text = isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
        if not is_text:
            message = f"{key} must be text"
        elif key == "package":
            message = check_package(key, value, derived)
        else:
            message = check(key, value)
        if message:
            return message
    return None


def version_problem(version: str) -> str | None:
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if numbers < MIN_COOKIECUTTER:
        return f"cookiecutter {version} is too old: this template needs 2.7 or newer (pip install 'cookiecutter>=2.7')"
    return None


def main() -> int:
    # Raw string, and tojson escapes every quote: no answer can end this literal early.
    answers = json.loads(r'''{{ cookiecutter | tojson }}''')  # fmt: skip
    message = version_problem(cookiecutter.__version__) or first_problem(answers)
    if message:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m {{ cookiecutter.package }}.k8s KEY=VALUE`'s overrides, written into configs/
where the next render, the check and training read them: deploy.* into deploy/default.yaml,
nccl=<profile> into train.yaml, nccl.<field> into that profile's file.

The files stay as their author wrote them (a round trip through ruamel.yaml): comments, order,
indentation and quoting are kept, and a value is replaced whole in the style the old one had,
flow ([a, b]) or block (- a). Every override is placed before any file is written, and then
all files are replaced or none."""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .. import PACKAGE
from .sync import replace_all

# deploy.<field>, nccl=<profile>, nccl.<field>; or an entry of a map, such as deploy.pod_labels.team
# or nccl.env.NCCL_ALGO (the + that adds it optional), which writes the map whole.
OVERRIDE = re.compile(
    r"\+{0,2}(deploy\.[a-z_][a-z0-9_]*|nccl\.[a-z_][a-z0-9_]*|nccl)(\.[^=]+)?=(.*)", re.DOTALL
)


def indentation(text: str) -> tuple[int, int]:
    """The file's mapping indent and how far its block sequences' dashes sit in from their key
    (ruamel's own guess takes the one for the other)."""
    nested = [len(spaces) for spaces in re.findall(r"(?m)^( +)[^\s#-]", text)]
    dash = re.search(r"(?m)^( *)[^\s#-][^\n]*:[ \t]*(?:#[^\n]*)?\n( *)- ", text)
    return min(nested, default=2), len(dash[2]) - len(dash[1]) if dash else 0


def round_trip(text: str) -> tuple[Any, Any]:
    """The document and a ruamel.yaml that writes it back with the file's own indentation."""
    from ruamel.yaml import YAML

    mapping, offset = indentation(text)
    loader = YAML()  # round trip
    loader.preserve_quotes = True
    loader.width = 4096  # a long value stays on its line
    loader.indent(mapping=mapping, sequence=offset + 2, offset=offset)
    loader.representer.add_representer(
        type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null")
    )
    return loader.load(text), loader


def plain(text: str) -> bool:
    """Whether `text` reads back as itself unquoted in YAML 1.1, as OmegaConf and PyYAML read
    (yes, on, 1e3 and 010 do not)."""
    try:
        return (
            yaml.safe_load(f"k: {text}") == {"k": text}
            and text == text.strip()
            and "\n" not in text
        )
    except yaml.YAMLError:
        return False


def styled(value: Any, old: Any, flow: bool | None = None) -> Any:
    """`value` as a node in `old`'s style: a quoted string stays quoted, a flow collection flow
    (a new one too: it keeps the line and its comment); what is inside follows its collection."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString, SingleQuotedScalarString

    if isinstance(value, str):
        if isinstance(old, SingleQuotedScalarString):
            return SingleQuotedScalarString(value)
        quoted = isinstance(old, DoubleQuotedScalarString) or not plain(value)
        return DoubleQuotedScalarString(value) if quoted else value
    if not isinstance(value, Mapping | list):
        return value
    if flow is None:
        flow = not hasattr(old, "fa") or old.fa.flow_style() is not False  # [] and {}: None
    if isinstance(value, Mapping):
        node = CommentedMap((styled(k, None), styled(v, None, flow)) for k, v in value.items())
    else:
        node = CommentedSeq(styled(v, None, flow) for v in value)
    node.fa.set_flow_style() if flow else node.fa.set_block_style()
    return node


def target(
    override: str, composed: Mapping[str, Any], configs: Path
) -> tuple[Path, list[Any], Any]:
    """Where an override goes: the file, the path of keys in it, and the checked value.
    `composed` holds the checked values ({"deploy": {...}, "nccl": {...}, "profile": name})."""
    match = OVERRIDE.fullmatch(override)
    if match and match.group(2):  # an entry: of a map only
        group, _, field = match.group(1).partition(".")
        match = match if field and isinstance(composed[group].get(field), Mapping) else None
    if not match:
        raise ValueError(
            f"{override}: k8s/ is rendered from deploy.*, nccl=<profile> and nccl.<field>; set "
            "other keys in configs/ (they are training's, not the manifests')"
        )
    if match.group(1) == "nccl":
        return configs / "train.yaml", ["defaults", "nccl"], composed["profile"]
    group, field = match.group(1).split(".")
    file = "default.yaml" if group == "deploy" else f"{composed['profile']}.yaml"
    return configs / group / file, [field], composed[group][field]


def shadowed(override: str, configs: Path) -> str | None:
    """The key configs/local/default.yaml (a user's own overrides, composed after configs/<group>/,
    `# @package _global_`) sets that `override` would be written under, or None: written into
    configs/<group>/ it would be composed away at the next render, and k8s/ would lose it."""
    local = configs / "local" / "default.yaml"
    found = yaml.safe_load(local.read_text()) if local.is_file() else None
    if not isinstance(found, Mapping):
        return None
    key = OVERRIDE.fullmatch(override).group(1)  # deploy.<field>, nccl.<field> or nccl
    if key == "nccl":  # the profile: chosen in local's defaults list (- override /nccl: socket)
        entries = [e for e in found.get("defaults") or [] if isinstance(e, Mapping)]
        return (
            "its nccl profile"
            if any(str(k).rstrip().endswith("nccl") for e in entries for k in e)
            else None
        )
    group, field = key.split(".")
    return key if isinstance(found.get(group), Mapping) and field in found[group] else None


def place(document: Any, keys: list[Any], value: Any, path: Path) -> None:
    """Set the value in a loaded document; the defaults list's `- nccl: <profile>` entry for
    nccl=<profile>. A key the file lacks is added at its end, saying who set it."""
    if keys[0] == "defaults":
        entries = [
            e for e in document.get("defaults") or [] if isinstance(e, Mapping) and keys[1] in e
        ]
        if not entries:
            raise ValueError(f"{path}: its defaults list has no `- {keys[1]}: ...` entry to set")
        document, keys = entries[0], keys[1:]
    (key,) = keys
    new = key not in document
    document[key] = styled(value, document.get(key))
    if new:
        document.yaml_add_eol_comment(f"# set by python -m {PACKAGE}.k8s", key, column=24)


def persist(overrides: list[str], composed: Mapping[str, Any], configs: Path) -> list[str]:
    """Write each override into the file the next render reads; returns where, one per override.
    ValueError: one line, and no file is written."""
    documents: dict[Path, tuple[Any, Any]] = {}
    expected: dict[Path, list[tuple[list[Any], Any]]] = {}
    written = []
    for override in overrides:
        path, keys, value = target(override, composed, configs)
        shadow = shadowed(override, configs)
        if shadow:
            raise ValueError(
                f"{override}: configs/local/default.yaml sets {shadow} too, which wins over "
                f"{path}: change it there"
            )
        if path not in documents:
            document, writer = round_trip(path.read_text())
            if not isinstance(document, Mapping):
                raise ValueError(f"{path}: holds no mapping of keys to write {override} into")
            documents[path] = document, writer
        place(documents[path][0], keys, value, path)
        expected.setdefault(path, []).append((keys, value))
        written.append(f"{override} -> {path}")
    texts = {}
    for path, (document, writer) in documents.items():
        out = io.StringIO()
        writer.dump(document, out)
        texts[path] = out.getvalue()
        reread = yaml.safe_load(texts[path])  # as Hydra will read it
        for keys, value in expected[path]:
            found = (
                next(e[keys[1]] for e in reread["defaults"] if isinstance(e, dict) and keys[1] in e)
                if keys[0] == "defaults"
                else reread[keys[0]]
            )
            if found != value:
                raise ValueError(
                    f"{path}: {'.'.join(keys)} would read back as {found!r}, not {value!r}"
                )
    replace_all(texts)
    return written

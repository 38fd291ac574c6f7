"""Text from a GPT checkpoint: a prompt continued a token at a time, printed when done.

    python -m {{ cookiecutter.package }}.generate prompt="Once upon a time" max_new_tokens=200
    python -m {{ cookiecutter.package }}.generate ckpt=outputs/<run> prompt="The" temperature=0
    python -m {{ cookiecutter.package }}.generate prompt="The" temperature=1.0 top_k=40 seed=7
    python -m {{ cookiecutter.package }}.generate prompt_ids=1,2,3   # ids in, ids out

ckpt=latest (the default): the newest checkpoint in outputs/; temperature=0: greedy. The model
is the checkpoint's own (its config; a file, a run dir, latest, or a .dcp folder), with
its EMA weights when it keeps them (weights=model: the trained ones). Text goes through the
tokenizer its run saved (<run dir>/tokenizer.json, else the one in its data.path folder); a model
of bytes (a token file made without a tokenizer, data.vocab_size <= 256) reads and writes UTF-8.
The model sees the last data.seq_len tokens: a longer prompt, and the text as it grows, are cut.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import PACKAGE
from .config.error import ConfigError, require
from .config.options import TokensConfig
from .config.registry import option_of, stored_groups
from .core.exits import Exit
from .model import build_model
from .run.sampling import sample
from .run.saved import (
    TOKENIZER,
    chosen_weights,
    find_checkpoint,
    load_weights,
    model_and_data,
    run_dir_of,
    tokenizer_of,
)

HELP = ("-h", "--help")
MOST_NEW_TOKENS = 100_000  # a forward pass each: more is a typo, not a request
BYTES = 256  # a model of bytes: a token file of UTF-8 bytes, with no tokenizer
KEYS = {
    "ckpt": "a checkpoint file or .dcp folder, a run dir, or latest (the default)",
    "prompt": "the text to continue",
    "prompt_ids": "token ids to continue, comma-separated: ids are printed, no tokenizer read",
    "max_new_tokens": f"tokens to add, 1 to {MOST_NEW_TOKENS} (default 100)",
    "temperature": "0 picks the likeliest token (greedy); higher, more varied (default 0.8)",
    "top_k": "sample among the k likeliest tokens only (default: all)",
    "seed": "the sampling's random seed (default 0: the same text each time)",
    "weights": "ema or model (default: ema when the checkpoint keeps EMA weights)",
}
USAGE = f"write key=value, with a key of: {', '.join(KEYS)}"


@dataclass
class Request:
    ckpt: str = "latest"
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 100
    temperature: float = 0.8
    top_k: int | None = None
    seed: int = 0
    weights: str = ""
    told: dict[str, str] = field(default_factory=dict)  # model=<name>: saved.model_and_data


def integer(key: str, value: str, least: int, most: int | None = None) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{key}={value}: not an integer") from None
    require(number >= least, key, value, f"must be at least {least}")
    require(most is None or number <= most, key, value, f"must be at most {most}")
    return number


def parse(args: list[str]) -> Request:
    """The request the arguments make, each value checked alone (top_k against the model's
    vocabulary once it is read)."""
    request = Request()
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"{arg}: {USAGE}")
        if key == "ckpt":
            request.ckpt = value
        elif key == "prompt":
            require(value != "", "prompt", '""', "empty; give the text to continue")
            request.prompt = value
        elif key == "prompt_ids":
            words = value.split(",")
            require(all(w.strip() for w in words), key, value, "write ids as 1,2,3")
            request.prompt_ids = [integer(key, w, 0) for w in words]
        elif key == "max_new_tokens":
            request.max_new_tokens = integer(key, value, 1, MOST_NEW_TOKENS)
        elif key == "temperature":
            try:
                temperature = float(value)
            except ValueError:
                raise ConfigError(f"temperature={value}: not a number") from None
            require(
                math.isfinite(temperature) and temperature >= 0,
                key,
                value,
                "must be a number >= 0 (0: greedy)",
            )
            request.temperature = temperature
        elif key == "top_k":
            request.top_k = integer(key, value, 1)
        elif key == "seed":
            request.seed = integer(key, value, 0, 2**63 - 1)
        elif key == "weights":
            require(value in ("ema", "model"), key, value, "must be ema or model")
            request.weights = value
        elif key in stored_groups():
            request.told[key] = value
        else:
            raise ConfigError(f"{key}: no such key; {USAGE}")
    if request.prompt is not None and request.prompt_ids is not None:
        raise ConfigError("prompt and prompt_ids: give one of them")
    if request.prompt is None and request.prompt_ids is None:
        raise ConfigError('no prompt: give prompt="text to continue" (or prompt_ids=1,2,3)')
    return request


@dataclass
class Codec:
    """Text to token ids and back."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def codec_for(path: Path, state: dict[str, Any], data: TokensConfig) -> Codec | None:
    """The checkpoint's tokenizer (saved.tokenizer_of), or bytes for a model of bytes; None for
    a model whose tokens no text maps to."""
    found = tokenizer_of(path, state)
    if found is None:
        trained_on_a_file = (state["config"].get("data") or {}).get("path")
        if data.vocab_size <= BYTES and trained_on_a_file:
            return Codec(
                lambda text: list(text.encode()), lambda ids: bytes(ids).decode(errors="replace")
            )
        return None
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(found))
    except ImportError:
        raise ConfigError(f"{found}: reading it needs the tokenizers package") from None
    except Exception as err:  # tokenizers raises its own errors (an Exception) on a bad file
        raise ConfigError(f"{found}: not a tokenizer: {' '.join(str(err).split())[:200]}") from None
    size = tokenizer.get_vocab_size()
    require(
        size <= data.vocab_size,
        str(found),
        f"{size} tokens",
        f"more than the model's data.vocab_size={data.vocab_size}: not the tokenizer it was "
        "trained with",
    )
    return Codec(lambda text: tokenizer.encode(text).ids, tokenizer.decode)


def prompt_ids(
    request: Request, codec: Codec | None, path: Path, state: dict[str, Any], vocab: int
) -> list[int]:
    if request.prompt_ids is not None:
        top = max(request.prompt_ids)
        require(top < vocab, "prompt_ids", top, f"must be below the model's vocab_size={vocab}")
        return request.prompt_ids
    if codec is None:
        trained_on = (state["config"].get("data") or {}).get("path")
        why = (
            f"no {TOKENIZER} in {run_dir_of(path)} or in its data folder ({trained_on}) maps "
            "text to its tokens"
            if trained_on
            else "it was trained on synthetic tokens (data.path=null), which no text maps to"
        )
        raise ConfigError(
            f"prompt: the model of {path}: {why}; give prompt_ids=1,2,3, ids below {vocab}"
        )
    ids = codec.encode(request.prompt)
    require(bool(ids), "prompt", repr(request.prompt), "the tokenizer makes no tokens of it")
    return ids


def usage() -> str:
    keys = "\n".join(f"  {key:<15} {what}" for key, what in KEYS.items())
    return (
        f"usage: python -m {PACKAGE}.generate [ckpt=<file|run dir|latest>] prompt=<text> "
        f"[key=value ...]\n\n{__doc__.strip()}\n\nkeys:\n{keys}"
    )


def main() -> int:
    if any(arg in HELP for arg in sys.argv[1:]):  # before anything is read
        print(usage())
        return Exit.OK
    new: list[int] = []
    try:
        request = parse(sys.argv[1:])
        path, state, note = find_checkpoint(request.ckpt, doing="generating from")
        if note:
            print(note, file=sys.stderr)
        model_cfg, data = model_and_data(path, state, request.told)
        if not isinstance(data, TokensConfig):
            raise ConfigError(
                f"ckpt={path}: generate continues token sequences; this checkpoint's model is "
                f"{option_of(type(model_cfg)).what} over {option_of(type(data)).what}"
            )
        if request.top_k is not None:
            require(
                request.top_k <= data.vocab_size,
                "top_k",
                request.top_k,
                f"more than the model's {data.vocab_size} tokens; give at most "
                f"{data.vocab_size}, or leave top_k out to sample among them all",
            )
        codec = codec_for(path, state, data) if request.prompt is not None else None
        prompt = prompt_ids(request, codec, path, state, data.vocab_size)
        which, weights = chosen_weights(path, state, request.weights)
        model = build_model(model_cfg, data)
        load_weights(model, weights, path, which)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device).eval()
        generator = torch.Generator(device).manual_seed(request.seed)
        for token in sample(
            model,
            prompt,
            request.max_new_tokens,
            context=data.seq_len,
            temperature=request.temperature,
            top_k=request.top_k,
            generator=generator,
        ):
            new.append(token)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return Exit.CONFIG_ERROR
    except KeyboardInterrupt:
        if new:  # what was made so far is printed: it was paid for
            print(show(prompt, new, codec), flush=True)
        print(
            f"generate: stopped by Ctrl-C after {len(new)} new token(s)"
            + ("" if new else "; nothing generated"),
            file=sys.stderr,
        )
        return Exit.INTERRUPTED
    print(show(prompt, new, codec))
    return Exit.OK


def show(prompt: list[int], new: list[int], codec: Codec | None) -> str:
    """The prompt and what followed it: as text, or as ids in the form prompt_ids takes."""
    ids = prompt + new
    return codec.decode(ids) if codec is not None else ",".join(map(str, ids))


if __name__ == "__main__":
    sys.exit(main())

"""The schemas of the model and data options, each registered with @option (config.registry):
the data every option has (DataConfig), data=synthetic's and data=tokens', model=mlp's and
model=gpt's. A YAML file in configs/model/ or configs/data/ names its schema in `defaults`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import MISSING

from .changeable import EVALUATE_SETS, FREE_ON_RESUME
from .error import ConfigError, require
from .registry import option
from .token_files import TOKENIZER, FolderProblem, check_folder, read_meta, split_sequences


@dataclass
class DataConfig:
    """What every data option has: how many samples, and how they reach the GPU."""

    num_samples: int = MISSING
    batch_size: int = field(default=MISSING, metadata=EVALUATE_SETS)
    num_workers: int = field(default=MISSING, metadata=FREE_ON_RESUME | EVALUATE_SETS)
    pin_memory: bool = field(default=MISSING, metadata=FREE_ON_RESUME | EVALUATE_SETS)
    on_device: bool = field(default=MISSING, metadata=FREE_ON_RESUME)

    def __post_init__(self) -> None:
        require(self.num_samples >= 1, "data.num_samples", self.num_samples, "must be at least 1")
        require(self.batch_size >= 1, "data.batch_size", self.batch_size, "must be at least 1")
        require(
            0 <= self.num_workers <= 64, "data.num_workers", self.num_workers, "must be 0 to 64"
        )
        require(
            not (self.on_device and self.num_workers > 0),
            "data.num_workers",
            self.num_workers,
            "must be 0 with data.on_device=true (the batches are cut on the GPU)",
        )

    def training_samples(self) -> tuple[int, str]:
        """Samples training draws from, and the key that says how many."""
        return self.num_samples, f"data.num_samples={self.num_samples}"

    def held_out_samples(self) -> tuple[int, str]:
        """Samples evaluation reads (data.build_dataset(held_out=True)), and the key that says
        how many."""
        return self.num_samples // HELD_OUT, f"data.num_samples={self.num_samples}"

    def tokenizer_file(self) -> Path | None:
        """The tokenizer file of data read from text, which a run keeps a copy of; None here."""
        return None


@option("data", "synthetic", "labelled points", stored_as="points_schema")
@dataclass
class PointsConfig(DataConfig):
    """configs/data/synthetic.yaml: labelled points from a fixed random teacher."""

    num_features: int = MISSING
    num_classes: int = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.num_features >= 1, "data.num_features", self.num_features, "must be at least 1"
        )
        require(self.num_classes >= 2, "data.num_classes", self.num_classes, "must be at least 2")


@option("data", "tokens", "token sequences", stored_as="tokens_schema")
@dataclass
class TokensConfig(DataConfig):
    """configs/data/tokens.yaml: token sequences for next-token prediction, synthetic or read
    from a data folder (data.path) that `python -m <package>.prepare` made from text."""

    seq_len: int = MISSING
    vocab_size: Optional[int] = MISSING
    path: Optional[str] = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.seq_len >= 1, "data.seq_len", self.seq_len, "must be at least 1")
        if self.path is None:
            require(
                self.vocab_size is not None,
                "data.vocab_size",
                "null",
                "means the tokenizer's, and synthetic tokens have none; give a number, or a "
                "data.path",
            )
        else:
            try:
                meta = check_folder(self)
            except FolderProblem as problem:
                raise ConfigError(f"data.path={self.path}: {problem}") from None
            tokenizer = meta["vocab_size"]
            if self.vocab_size is None:  # the tokenizer's, resolved once: the run records it
                self.vocab_size = tokenizer
            require(
                self.vocab_size >= tokenizer,
                "data.vocab_size",
                self.vocab_size,
                f"is below the {tokenizer} ids of data.path={self.path}'s {TOKENIZER}; use at "
                f"least {tokenizer}, or null for the tokenizer's",
            )
        require(self.vocab_size >= 2, "data.vocab_size", self.vocab_size, "must be at least 2")

    def sequences(self, split: str) -> int:
        """The data folder's sequences in a split: train, or val (held out)."""
        return split_sequences(read_meta(Path(self.path)), split, self.seq_len)

    def training_samples(self) -> tuple[int, str]:
        if self.path is None:
            return super().training_samples()
        return self.sequences("train"), f"data.path={self.path} (its train shards)"

    def held_out_samples(self) -> tuple[int, str]:
        if self.path is None:
            return super().held_out_samples()
        return self.sequences("val"), f"data.path={self.path} (its val shards)"

    def tokenizer_file(self) -> Path | None:
        """The tokenizer the data's ids come from, which a run keeps a copy of."""
        return None if self.path is None else Path(self.path) / TOKENIZER


@option("model", "mlp", "an MLP", stored_as="mlp_schema", reads=PointsConfig)
@dataclass
class MlpConfig:
    """configs/model/mlp.yaml: an MLP classifier over data=synthetic's points."""

    hidden_dim: int = MISSING
    depth: int = MISSING

    def __post_init__(self) -> None:
        require(self.hidden_dim >= 1, "model.hidden_dim", self.hidden_dim, "must be at least 1")
        require(self.depth >= 1, "model.depth", self.depth, "must be at least 1")


@option("model", "gpt", "a GPT", stored_as="gpt_schema", reads=TokensConfig)
@dataclass
class GptConfig:
    """configs/model/gpt.yaml: a decoder-only transformer over data=tokens."""

    n_layer: int = MISSING
    n_head: int = MISSING
    d_model: int = MISSING

    def __post_init__(self) -> None:
        require(self.n_layer >= 1, "model.n_layer", self.n_layer, "must be at least 1")
        require(self.n_head >= 1, "model.n_head", self.n_head, "must be at least 1")
        require(
            self.d_model >= 1 and self.d_model % self.n_head == 0,
            "model.d_model",
            self.d_model,
            f"must be a positive multiple of model.n_head={self.n_head}",
        )


HELD_OUT = 10  # one part in this many is held out for evaluation

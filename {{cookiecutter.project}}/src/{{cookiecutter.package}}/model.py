"""The models: an MLP classifier and a GPT-style decoder. Swap in your own; the trainer needs only
an nn.Module whose output's last dimension holds the class (or next-token) logits."""

import torch
from torch import nn

from {{ cookiecutter.package }}.config import GptConfig, MlpConfig, PointsConfig, TokensConfig


def mlp(cfg: MlpConfig, data: PointsConfig) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = data.num_features
    for _ in range(cfg.depth):
        layers += [nn.Linear(width, cfg.hidden_dim), nn.GELU()]
        width = cfg.hidden_dim
    layers.append(nn.Linear(width, data.num_classes))
    return nn.Sequential(*layers)


class Gpt(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks with causal self-attention
    (PyTorch's fused attention kernels), and a linear head over the vocabulary."""

    def __init__(self, cfg: GptConfig, data: TokensConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(data.vocab_size, cfg.d_model)
        self.positions = nn.Embedding(data.seq_len, cfg.d_model)
        block = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.n_head, 4 * cfg.d_model, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(block, cfg.n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(cfg.d_model, data.vocab_size, bias=False)
        mask = nn.Transformer.generate_square_subsequent_mask(data.seq_len)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.tokens(tokens) + self.positions.weight[:length]
        mask = self.causal_mask[:length, :length]
        return self.head(self.blocks(hidden, mask=mask, is_causal=True))


def build_model(cfg: MlpConfig | GptConfig, data: PointsConfig | TokensConfig) -> nn.Module:
    """check.ConfigCheck has made sure the model and data options fit together."""
    return Gpt(cfg, data) if isinstance(cfg, GptConfig) else mlp(cfg, data)

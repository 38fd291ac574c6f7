"""The models: an MLP classifier and a GPT-style decoder. Add your own beside them
(docs/extending.md gives each edit): the trainer needs only an nn.Module whose output's last
dimension holds the class (or next-token) logits, registered with @builds(its schema); a
flops_per_token() method gives its MFU."""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config.options import DataConfig, GptConfig, MlpConfig, PointsConfig, TokensConfig
from .config.registry import builder_of, builds


def matmul_parameters(model: nn.Module) -> int:
    """The parameters that take part in matmuls, with their biases: all but embedding lookups."""
    looked_up = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    return sum(p.numel() for p in model.parameters() if id(p) not in looked_up)


@builds(MlpConfig)
class Mlp(nn.Sequential):
    """Linear layers with GELU between them; one sample is one token of FLOPs accounting."""

    tokens_per_sample = 1

    def __init__(self, cfg: MlpConfig, data: PointsConfig) -> None:
        layers: list[nn.Module] = []
        width = data.num_features
        for _ in range(cfg.depth):
            layers += [nn.Linear(width, cfg.hidden_dim), nn.GELU()]
            width = cfg.hidden_dim
        layers.append(nn.Linear(width, data.num_classes))
        super().__init__(*layers)

    def flops_per_token(self) -> int:
        """A training step's FLOPs per sample: 2 per weight forward, 4 backward."""
        return 6 * matmul_parameters(self)


class Block(nn.Module):
    """Pre-norm, as GPT-2: causal self-attention, then a 4x-wide MLP, each added to the residual.
    Attention is one F.scaled_dot_product_attention call with is_causal=True: PyTorch's flash
    kernel on a GPU, no mask in memory, faster than the nn.TransformerEncoder it replaced
    (docs/performance.md)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)  # queries, keys and values in one matmul
        self.projection = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        heads = self.qkv(self.attention_norm(x)).view(
            batch, length, 3, self.heads, width // self.heads
        )
        q, k, v = heads.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, length, head width)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


@builds(GptConfig)
class Gpt(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks with causal self-attention, a
    final layer norm and a linear head over the vocabulary (untied from the token embedding)."""

    def __init__(self, cfg: GptConfig, data: TokensConfig) -> None:
        super().__init__()
        self.shape = (cfg.n_layer, cfg.d_model, data.seq_len)
        self.tokens_per_sample = data.seq_len
        self.tokens = nn.Embedding(data.vocab_size, cfg.d_model)
        self.positions = nn.Embedding(data.seq_len, cfg.d_model)
        self.blocks = nn.Sequential(*(Block(cfg.d_model, cfg.n_head) for _ in range(cfg.n_layer)))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, data.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(tokens) + self.positions.weight[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(hidden)))

    def flops_per_token(self) -> int:
        """A training step's FLOPs per token, nanoGPT's estimate_mfu count: 6 per matmul parameter
        (the head's included; the embeddings are lookups), and attention's scores and weighted
        sum, 12 x layers x width x context, which no parameter counts."""
        layers, width, context = self.shape
        return 6 * matmul_parameters(self) + 12 * layers * width * context


def build_model(cfg: Any, data: DataConfig) -> nn.Module:
    """The model option's builder, given its schema and the data's. config.compose.ConfigCheck has
    made sure the model and data options fit together (validate.check_combinations)."""
    return builder_of(cfg)(cfg, data)

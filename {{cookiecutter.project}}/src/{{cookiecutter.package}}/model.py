"""The model: an MLP classifier. Swap in your own; train.py only needs an nn.Module."""

from torch import nn

from {{ cookiecutter.package }}.config import DataConfig, ModelConfig


def build_model(cfg: ModelConfig, data: DataConfig) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = data.num_features
    for _ in range(cfg.depth):
        layers += [nn.Linear(width, cfg.hidden_dim), nn.GELU()]
        width = cfg.hidden_dim
    layers.append(nn.Linear(width, data.num_classes))
    return nn.Sequential(*layers)

"""New tokens from a next-token model, one at a time, as nanoGPT's generate: greedy when the
temperature is 0, else sampled from the softmax of the logits over the temperature, kept to the
top_k likeliest when top_k is given. Any model whose output is (batch, length, vocabulary)
logits will do."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: list[int],
    count: int,
    *,
    context: int,
    temperature: float,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[int]:
    """`count` tokens after `prompt`, each yielded as it is chosen (a caller stopped midway keeps
    those so far). The model sees at most the last `context` tokens: those it was trained on."""
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt[-context:]], dtype=torch.long, device=device)
    for _ in range(count):
        logits = model(tokens)[0, -1].float()
        if temperature == 0:
            token = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth_largest = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            token = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        tokens = torch.cat([tokens, token.view(1, 1)], dim=1)[:, -context:]
        yield int(token)

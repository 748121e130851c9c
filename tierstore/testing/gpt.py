"""A small GPT-style language model (causal attention, MLP, layer norm, dropout, tied embedding) for
exercising workloads end to end: the activation tests, the benchmarks and ``tierstore train``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attention.transpose(1, 2).reshape(batch, length, width)))
        return x + self.dropout(self.down(F.gelu(self.up(self.norm2(x)))))


class GPT(nn.Module):
    """``checkpointed``: indices of blocks run under :func:`torch.utils.checkpoint.checkpoint`
    (their activations are recomputed in backward instead of saved)."""

    def __init__(
        self,
        vocab: int = 256,
        width: int = 128,
        layers: int = 4,
        heads: int = 4,
        length: int = 64,
        dropout: float = 0.1,
        *,
        checkpointed: frozenset[int] = frozenset(),
        reentrant: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)
        self.checkpointed = checkpointed
        self.reentrant = reentrant

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for index, block in enumerate(self.blocks):
            recompute = index in self.checkpointed
            x = checkpoint(block, x, use_reentrant=self.reentrant) if recompute else block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def byte_corpus(nbytes: int = 1 << 20) -> torch.Tensor:
    """Text that ships with Python (the standard library's own source files), as byte tokens."""
    import sysconfig
    from pathlib import Path

    chunks: list[bytes] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= nbytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:nbytes]), dtype=torch.uint8).long()


def batch_of(corpus: torch.Tensor, step: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (tokens, next-token targets) batch for ``step``."""
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, corpus.numel() - length - 1, (batch,), generator=generator)
    rows = torch.stack([corpus[s : s + length + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def apollo_groups(model: nn.Module, projection: dict[str, object]) -> list[dict[str, object]]:
    """Parameter groups as APOLLO's own training scripts make them: the blocks' linear weights get
    the low-rank ``projection`` (``rank``, ``scale``...), everything else (embeddings, the tied
    head, norms, biases) plain AdamW."""
    projected = [p for name, p in model.named_parameters() if name.startswith("blocks.") and p.dim() == 2]
    chosen = {id(p) for p in projected}
    return [
        {"params": projected, **projection},
        {"params": [p for p in model.parameters() if id(p) not in chosen]},
    ]

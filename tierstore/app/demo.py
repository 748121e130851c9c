"""The demo workload: a small GPT-style language model, text to train it on, and the loop that
``tierstore train`` runs with the model's optimizer state and saved activations offloaded through
one store.

The DeepSpeed example, the activation tests and the benchmarks train the same model. Everything
here needs only tierstore's runtime dependencies: ``tierstore train`` is the main job of a bare
``pip install tierstore``.
"""

from __future__ import annotations

import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..activations import ActivationOffload
from ..config import load_config
from ..optimizer import APOLLO_MINI, OffloadedAdamW, OffloadedAPOLLO, StagedOptimizer
from ..store import TierStore


class Linear(nn.Linear):
    """``nn.Linear`` whose matmul may run in another dtype than its weights.

    Args:
        inputs, outputs, bias: as for ``nn.Linear``.
        compute: the dtype to multiply in, or None for the input's own. On CPUs without native
            bf16, torch's bf16 GEMM is up to 270x slower than fp32 for some layouts (backward's
            ``grad @ weight``), which would make a bf16 run all compute; ``torch.float32`` here
            keeps bf16 parameters, gradients and what the optimizer moves, with fp32 products.
    """

    def __init__(
        self, inputs: int, outputs: int, bias: bool = True, compute: torch.dtype | None = None
    ) -> None:
        super().__init__(inputs, outputs, bias=bias)
        self.compute = compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute is None or self.compute == x.dtype:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.to(self.compute)
        return F.linear(x.to(self.compute), self.weight.to(self.compute), bias).to(x.dtype)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x MLP, each residual.

    Args:
        width: the model width (split evenly over the heads).
        heads: attention heads.
        dropout: dropout probability on each residual branch (0 leaves the branches as they are).
        compute: the dtype the linear layers multiply in (see `Linear`).
    """

    def __init__(self, width: int, heads: int, dropout: float, compute: torch.dtype | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = Linear(width, 3 * width, compute=compute)
        self.proj = Linear(width, width, compute=compute)
        self.norm2 = nn.LayerNorm(width)
        self.up = Linear(width, 4 * width, compute=compute)
        self.down = Linear(4 * width, width, compute=compute)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attention.transpose(1, 2).reshape(batch, length, width)))
        return x + self.dropout(self.down(F.gelu(self.up(self.norm2(x)))))


class GPT(nn.Module):
    """A GPT-style language model whose forward returns the next-token loss.

    Args:
        vocab: token ids are below this.
        width: the model width.
        layers: transformer blocks.
        heads: attention heads per block (``width`` must divide by it).
        length: the longest sequence (learned positions).
        dropout: dropout probability in the blocks.
        checkpointed: indices of blocks run under `torch.utils.checkpoint.checkpoint` (their
            activations are recomputed in backward instead of saved).
        reentrant: checkpoint with the reentrant implementation instead of the default one.
        tied_head: as GPT-2: the output head shares the token embedding's weight, and both
            embeddings start from N(0, 0.02). False gives the head its own weight and keeps torch's
            default initialisation (the DeepSpeed example's model, whose losses its tests compare).
        compute: the dtype the linear layers multiply in (see `Linear`).
    """

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
        tied_head: bool = True,
        compute: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout, compute) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = Linear(width, vocab, bias=False, compute=compute)
        if tied_head:
            self.head.weight = self.embed.weight
            nn.init.normal_(self.embed.weight, std=0.02)
            nn.init.normal_(self.position.weight, std=0.02)
        self.checkpointed = checkpointed
        self.reentrant = reentrant

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, skip_last_block: bool = False
    ) -> torch.Tensor:
        """The mean cross-entropy of predicting ``targets`` from ``tokens`` (both batch x length);
        ``skip_last_block`` leaves the last block out (its parameters get no gradient)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for index, block in enumerate(self.blocks[:-1] if skip_last_block else self.blocks):
            recompute = index in self.checkpointed
            x = checkpoint(block, x, use_reentrant=self.reentrant) if recompute else block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def byte_corpus(nbytes: int = 1 << 20) -> torch.Tensor:
    """The first ``nbytes`` of text that ships with Python (the standard library's own source
    files, in name order), as byte tokens (vocabulary 256)."""
    chunks: list[bytes] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= nbytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:nbytes]), dtype=torch.uint8).long()


def batch_of(corpus: torch.Tensor, step: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` sequences of ``length`` tokens drawn from ``corpus`` and their next-token
    targets, the same for the same ``step`` on every run."""
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


def run_training(
    config: dict[str, Any],
    *,
    layers: int,
    width: int,
    length: int,
    batch: int,
    steps: int,
    sub_group_size: int,
    budget: int,
    activation_budget: int,
    optimizer_name: str = "adamw",
) -> dict[str, Any]:
    """Train a `GPT` on `byte_corpus` with its fp32 optimizer state and the activations saved for
    backward both spilled to the config's tiers through one store (which caches nothing itself);
    print one line per step on stderr and return the report.

    Args:
        config: the store config (a mapping [`load_config`][] accepts); its DRAM cache budget is
            replaced by 0, its memory budget by ``budget + activation_budget``.
        layers, width, length: the model's blocks, width (64 per head) and sequence length.
        batch: sequences per step.
        steps: optimizer steps.
        sub_group_size: elements per optimizer sub-group.
        budget: the optimizer's DRAM bytes (read-ahead ring, gradient buffer, kept sub-groups).
        activation_budget: activation bytes held in memory at once ([`ActivationOffload`][],
            lifetime plan).
        optimizer_name: ``"adamw"`` for [`OffloadedAdamW`][], ``"apollo-mini"`` for
            [`OffloadedAPOLLO`][] as APOLLO-Mini on the blocks' matrices.
    """
    settings = load_config(config)
    torch.manual_seed(0)
    # fp32 on the CPU: bf16 attention kernels run an order of magnitude slower there.
    model = GPT(vocab=256, width=width, layers=layers, heads=max(1, width // 64), length=length)
    corpus = byte_corpus()
    # One DRAM ledger for both workloads: the store holds exactly their two budgets.
    store_settings = settings.model_copy(
        update={
            "cache": settings.cache.model_copy(update={"budget": 0}),
            "memory_budget": budget + activation_budget,
        }
    )
    report: dict[str, Any] = {
        "optimizer": optimizer_name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dram_budget_bytes": budget,
        "activation_budget_bytes": activation_budget,
        "tokens_per_step": batch * length,
        "steps": [],
    }
    with TierStore.from_config(store_settings) as store:
        optimizer = _offloaded_optimizer(optimizer_name, model, store, sub_group_size, budget)
        state_bytes = sum(4 * optimizer.state_numel(sg) for sg in optimizer.subgroups)
        report["fp32_state_bytes"] = state_bytes
        report["state_over_budget"] = round(state_bytes / budget, 2)
        offload = ActivationOffload(store, budget=activation_budget, min_bytes="256KiB", plan="lifetime")
        report["subgroups"] = len(optimizer.subgroups)
        report["memory"] = store.stats()["memory"]
        for step in range(steps):
            tokens, targets = batch_of(corpus, step, batch, length)
            entry = {"step": step + 1, **_train_step(model, optimizer, offload, store, tokens, targets)}
            report["steps"].append(entry)
            print(_step_line(entry), file=sys.stderr)
        offload.close()
        report["activation_stats"] = offload.stats()
        report["activation_plan"] = offload.plan_explain()
    losses = [entry["loss"] for entry in report["steps"]]
    report["loss_decreased"] = losses[-1] < losses[0] if len(losses) > 1 else None  # one step: no trend
    return report


def training_failure(report: dict[str, Any]) -> str | None:
    """Why a finished `run_training` failed its own check, or None: the loss must fall from the
    first step to the last (a one-step run has no trend, and passes)."""
    if report["loss_decreased"] is not False:
        return None
    steps = report["steps"]
    return f"the loss did not decrease over {len(steps)} steps ({steps[0]['loss']} to {steps[-1]['loss']})"


def _offloaded_optimizer(
    name: str, model: GPT, store: TierStore, sub_group_size: int, budget: int
) -> StagedOptimizer:
    """The optimizer ``name`` (see `run_training`) over ``model``, its state in ``store``."""
    if name == "apollo-mini":
        groups = apollo_groups(model, APOLLO_MINI)
        return OffloadedAPOLLO(
            groups, store, lr=1e-3, sub_group_size=sub_group_size, dram_budget=budget, max_grad_norm=1.0
        )
    return OffloadedAdamW(
        model.parameters(),
        store,
        lr=1e-3,
        sub_group_size=sub_group_size,
        dram_budget=budget,
        max_grad_norm=1.0,
    )


def _train_step(
    model: GPT,
    optimizer: StagedOptimizer,
    offload: ActivationOffload,
    store: TierStore,
    tokens: torch.Tensor,
    targets: torch.Tensor,
) -> dict[str, Any]:
    """One step on (``tokens``, ``targets``) with the activations offloaded: its loss, times,
    resident activation bytes and each tier's GB/s over the step."""
    before = {t.name: t.bytes_read + t.bytes_written for t in store.tiers}
    started = time.perf_counter()
    with offload:
        loss = model(tokens, targets)
    model.zero_grad(set_to_none=True)
    loss.backward()
    backward_done = time.perf_counter()
    optimizer.step()
    finished = time.perf_counter()
    activations = offload.stats()
    seconds = finished - started
    return {
        "loss": round(float(loss.detach()), 5),
        "step_s": round(seconds, 3),
        "forward_backward_s": round(backward_done - started, 3),
        "optimizer_step_s": round(finished - backward_done, 3),
        "peak_resident_activation_bytes": activations["step_peak_resident_bytes"],
        "keep_in_memory_activation_bytes": activations["step_saved_bytes"],
        "activation_plan": "lifetime" if activations.get("predicted_step_s") else "profiling",
        "gb_per_s": {
            t.name: round((t.bytes_read + t.bytes_written - before[t.name]) / seconds / 1e9, 3)
            for t in store.tiers
        },
    }


def _step_line(entry: dict[str, Any]) -> str:
    """One step of the report as the line ``tierstore train`` prints."""
    return (
        f"step {entry['step']}: loss {entry['loss']:.4f}  step {entry['step_s']:.2f} s "
        f"(fwd+bwd {entry['forward_backward_s']:.2f}, optimizer {entry['optimizer_step_s']:.2f})  "
        f"activations resident {entry['peak_resident_activation_bytes'] / 2**20:.1f} MiB of "
        f"{entry['keep_in_memory_activation_bytes'] / 2**20:.1f} MiB saved "
        f"({entry['activation_plan']})  "
        + "  ".join(f"{name} {gbps} GB/s" for name, gbps in entry["gb_per_s"].items())
    )

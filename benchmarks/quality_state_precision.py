"""Quality run: OffloadedAdamW's state precisions against torch's fused AdamW, the same training.

Two byte-level language models, the demo GPT (``tierstore.app.demo``) and a Hugging Face
``LlamaForCausalLM`` built from a config, are trained on English text that ships with Python (the
standard library's ``pydoc_data.topics``, split into a training and a held-out validation part)
by ``torch.optim.AdamW(fused=True)`` and by ``OffloadedAdamW`` with each ``state_precision``, the
state on an NVMe (O_DIRECT) tier under a DRAM budget below it: the same initialisation, batches,
order and hyper-parameters. Each run records its training loss per step and a validation loss
every ``--eval-every`` steps; the final losses (training: mean of the last :data:`TAIL` steps;
validation: the last evaluation) are compared with torch's fp32 AdamW's (target: within 1%), and a
run whose loss turns non-finite or climbs well above its best is flagged as diverged. The
parameters are fp32, their own master weights in every format, so here the formats differ in the
moments they store.

A fine-tuning run then shows why a bf16 master weight needs compensation: the GPT trained by
torch's AdamW, cast to bf16 parameters, is fine-tuned on Python source code with a small learning
rate by torch's AdamW on the bf16 parameters directly (no master weight: updates below bf16's
resolution are rounded away), by OffloadedAdamW with fp32 master weights and by OffloadedAdamW
with the compensated bf16 master weight.

Writes the runs (JSON) and their loss curves (PNG) and prints one line per model and optimizer.
About 13 minutes on 2 cores with the defaults::

    .venv/bin/python -m benchmarks.quality_state_precision \\
        --output benchmarks/results/state_precision_quality.json \\
        --plot benchmarks/results/state_precision_quality.png
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import pydoc_data.topics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tierstore.backends import open_backend
from tierstore.optimizer import OffloadedAdamW
from tierstore.optimizer.state_precision import PRESETS
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from tierstore import Tier, TierStore
from tierstore.app.demo import GPT, batch_of, byte_corpus

from .common import data_directory, log, positive_int

FORMATS = tuple(PRESETS)
"""OffloadedAdamW's ``state_precision`` presets, each trained (fp32, the default, first)."""
COMPENSATED_MASTER = next(name for name, preset in PRESETS.items() if preset.master == "bf16-compensated")
"""The preset whose bf16 master weight carries a compensation term (the fine-tuning run's)."""
REFERENCE = "torch-adamw"
"""The peer every format is compared with: ``torch.optim.AdamW(fused=True)``, fp32 state."""
NO_MASTER = "torch-adamw-bf16"
"""The fine-tuning run's peer: ``torch.optim.AdamW(fused=True)`` on the bf16 parameters, no master."""
TAIL = 50
"""Training steps averaged into the final training loss."""
DIVERGENCE = 1.1
"""A validation loss this many times the best one before it flags the run as diverged."""
TARGET = 1.01
"""A format's final losses over torch's fp32 AdamW's must be at most this."""

Batch = tuple[torch.Tensor, torch.Tensor]
LossFunction = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


# -- data ------------------------------------------------------------------------------------------
def english_corpus() -> torch.Tensor:
    """The help topics of Python's ``pydoc`` (English prose, ~460 KB), in topic order, as byte
    tokens (vocabulary 256)."""
    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[name] for name in sorted(topics)).encode()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def split(corpus: torch.Tensor, validation_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's leading part for training and its trailing ``validation_fraction`` held out."""
    cut = int(corpus.numel() * (1 - validation_fraction))
    return corpus[:cut], corpus[cut:]


def validation_batches(corpus: torch.Tensor, args: argparse.Namespace) -> list[Batch]:
    """``--eval-batches`` fixed batches of the held-out text (the same for every run)."""
    # Seeds past any training step's, so no validation batch repeats a training batch's draw.
    return [batch_of(corpus, 1 << 30 | index, args.batch, args.length) for index in range(args.eval_batches)]


# -- models ----------------------------------------------------------------------------------------
def gpt_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The demo GPT's own next-token loss."""
    loss: torch.Tensor = model(tokens, targets)
    return loss


def llama_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of a causal LM's logits (the targets already shifted)."""
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_gpt(args: argparse.Namespace, compute: torch.dtype | None = None) -> nn.Module:
    """The demo GPT, ``--layers`` blocks of ``--width``, no dropout (runs differ only by optimizer).

    Args:
        args: the benchmark's arguments.
        compute: the dtype its linear layers multiply in (fp32 for bf16 weights on a CPU).
    """
    return GPT(
        width=args.width,
        layers=args.layers,
        heads=args.width // 32,
        length=args.length,
        dropout=0.0,
        compute=compute,
    )


def build_llama(args: argparse.Namespace) -> nn.Module:
    """A Llama from its config, the GPT's size: ``--layers`` layers of ``--width``, grouped-query
    attention, untied head."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.width,
        intermediate_size=args.width * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.width // 16,
        num_key_value_heads=args.width // 32,
        max_position_embeddings=args.length,
        tie_word_embeddings=False,
        attn_implementation="sdpa",  # type: ignore[call-arg]  # a keyword of PretrainedConfig's
    )
    return LlamaForCausalLM(config)


MODELS: dict[str, tuple[Callable[[argparse.Namespace], nn.Module], LossFunction]] = {
    "gpt": (build_gpt, gpt_loss),
    "llama": (build_llama, llama_loss),
}
"""Each model's builder and loss, by the name the results use."""


# -- training --------------------------------------------------------------------------------------
def evaluate(model: nn.Module, loss_of: LossFunction, batches: list[Batch]) -> float:
    """The mean loss over fixed validation batches, in eval mode and without gradients."""
    model.eval()
    with torch.no_grad():
        total = sum(float(loss_of(model, tokens, targets)) for tokens, targets in batches)
    model.train()
    return total / len(batches)


def offloaded(precision: str, args: argparse.Namespace, lr: float) -> Callable[..., Any]:
    """A factory of OffloadedAdamW with ``precision`` state in a fresh store under ``--dir``."""

    def make(params: Iterable[torch.Tensor], directory: Path) -> OffloadedAdamW:
        backend = open_backend({"type": "nvme", "path": str(directory)})
        store = TierStore([Tier("nvme", backend)], cache_budget=0)
        return OffloadedAdamW(
            params,
            store,
            lr=lr,
            weight_decay=args.weight_decay,
            sub_group_size=args.sub_group_size,
            dram_budget=args.dram_budget,
            state_precision=precision,
        )

    return make


def torch_adamw(args: argparse.Namespace, lr: float) -> Callable[..., Any]:
    """A factory of the peer, ``torch.optim.AdamW(fused=True)`` with the same hyper-parameters."""

    def make(params: Iterable[torch.Tensor], directory: Path) -> torch.optim.AdamW:
        return torch.optim.AdamW(params, lr=lr, weight_decay=args.weight_decay, fused=True)

    return make


def train(
    label: str,
    model: nn.Module,
    loss_of: LossFunction,
    make_optimizer: Callable[..., Any],
    data: tuple[torch.Tensor, list[Batch]],
    steps: int,
    args: argparse.Namespace,
    directory: Path,
) -> dict[str, Any]:
    """Train ``model`` for ``steps`` steps on the batches of ``data``'s training text; the loss
    curves, final losses, whether it diverged, and its wall and CPU time.

    Args:
        label: the run's name in the progress lines.
        model: the model, initialised as every run it is compared with.
        loss_of: its loss on a batch.
        make_optimizer: called with the parameters and a directory for the state.
        data: the training text and the fixed validation batches.
        steps: optimizer steps.
        args: the benchmark's arguments (batch, length, evaluation period).
        directory: an empty directory for the optimizer's state.
    """
    corpus, held_out = data
    optimizer = make_optimizer(model.parameters(), directory)
    losses: list[float] = []
    validation: list[tuple[int, float]] = [(0, round(evaluate(model, loss_of, held_out), 5))]
    diverged: str | None = None
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        for step in range(1, steps + 1):
            tokens, targets = batch_of(corpus, step, args.batch, args.length)
            loss = loss_of(model, tokens, targets)
            model.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
            optimizer.step()
            losses.append(round(float(loss.detach()), 5))
            if not math.isfinite(losses[-1]):
                diverged = f"non-finite training loss at step {step}"
                break
            if step % args.eval_every == 0 or step == steps:
                best = min(value for _, value in validation)
                validation.append((step, round(evaluate(model, loss_of, held_out), 5)))
                if not math.isfinite(validation[-1][1]):
                    diverged = f"non-finite validation loss at step {step}"
                    break
                if diverged is None and validation[-1][1] > DIVERGENCE * best:
                    diverged = f"validation loss {validation[-1][1]:.4f} at step {step}, best {best:.4f}"
                log(f"{label} step {step}: loss {losses[-1]:.4f}, validation {validation[-1][1]:.4f}")
    finally:
        if isinstance(optimizer, OffloadedAdamW):
            store = optimizer.store
            optimizer.close()
            store.close()
    tail = losses[-TAIL:]
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1),
        "final_loss": round(sum(tail) / len(tail), 5),
        "final_validation_loss": validation[-1][1],
        "diverged": diverged,
        "losses": losses,
        "validation": validation,
    }


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each run's final losses, their ratios to the reference's, and whether it meets the target."""
    reference = runs[REFERENCE]
    summary = {}
    for name, run in runs.items():
        loss_ratio = run["final_loss"] / reference["final_loss"]
        validation_ratio = run["final_validation_loss"] / reference["final_validation_loss"]
        summary[name] = {
            "final_loss": run["final_loss"],
            "final_validation_loss": run["final_validation_loss"],
            "final_loss_over_torch": round(loss_ratio, 4),
            "final_validation_loss_over_torch": round(validation_ratio, 4),
            "same_losses_as_torch": run["losses"] == reference["losses"],
            "diverged": run["diverged"],
            "within_target": run["diverged"] is None and max(loss_ratio, validation_ratio) <= TARGET,
        }
    return summary


def compare_fine_tuning(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each fine-tuning run's validation loss, before and after, and how much of the fp32 master
    weights' improvement it achieves (near 0 where the updates were rounded away)."""

    def gained(run: dict[str, Any]) -> float:
        return float(run["validation"][0][1] - run["final_validation_loss"])

    by_fp32 = gained(runs["fp32"])
    return {
        name: {
            "start_validation_loss": run["validation"][0][1],
            "final_validation_loss": run["final_validation_loss"],
            "final_loss": run["final_loss"],
            "improvement_over_fp32_masters": round(gained(run) / by_fp32, 4) if by_fp32 > 0 else None,
            "diverged": run["diverged"],
        }
        for name, run in runs.items()
    }


def pretraining(
    model_name: str,
    args: argparse.Namespace,
    data: tuple[torch.Tensor, list[Batch]],
    directory: Path,
) -> tuple[dict[str, dict[str, Any]], dict[str, torch.Tensor]]:
    """Train ``model_name`` with the reference and every chosen format; the runs, and the
    reference's trained weights."""
    build, loss_of = MODELS[model_name]
    optimizers = {REFERENCE: torch_adamw(args, args.lr)}
    optimizers.update({precision: offloaded(precision, args, args.lr) for precision in args.formats})
    runs, trained = {}, {}
    for name, make_optimizer in optimizers.items():
        torch.manual_seed(args.seed)
        model = build(args)
        label = f"{model_name} {name}"
        runs[name] = train(label, model, loss_of, make_optimizer, data, args.steps, args, directory / label)
        if name == REFERENCE:
            trained = {key: value.detach().clone() for key, value in model.state_dict().items()}
    return runs, trained


def fine_tuning(
    weights: dict[str, torch.Tensor], args: argparse.Namespace, directory: Path
) -> dict[str, dict[str, Any]]:
    """Fine-tune the trained GPT, cast to bf16 parameters, on Python source code with
    ``--finetune-lr``: torch's AdamW on the bf16 parameters (no master weight) against
    OffloadedAdamW with fp32 master weights and with the compensated bf16 master weight."""
    train_text, held_out = split(byte_corpus(args.finetune_bytes), args.validation_fraction)
    data = (train_text, validation_batches(held_out, args))
    optimizers = {
        NO_MASTER: torch_adamw(args, args.finetune_lr),
        "fp32": offloaded("fp32", args, args.finetune_lr),
        COMPENSATED_MASTER: offloaded(COMPENSATED_MASTER, args, args.finetune_lr),
    }
    runs = {}
    for name, make_optimizer in optimizers.items():
        model = build_gpt(args, compute=torch.float32)
        model.load_state_dict(weights)
        model.to(torch.bfloat16)
        label = f"fine-tuning bf16 {name}"
        runs[name] = train(
            label, model, gpt_loss, make_optimizer, data, args.finetune_steps, args, directory / label
        )
    return runs


# -- output ----------------------------------------------------------------------------------------
def metadata(args: argparse.Namespace) -> dict[str, Any]:
    """Date, settings and the machine."""
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "plot", "dir")},
        "reference": "torch.optim.AdamW(fused=True), fp32 state",
        "final_loss_is_mean_of_last": TAIL,
        "divergence": f"a non-finite loss, or a validation loss above {DIVERGENCE}x the best before it",
        "target": f"final training and validation loss at most {TARGET}x torch's fp32 AdamW's",
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }


def summary_line(model_name: str, name: str, result: dict[str, Any]) -> str:
    """One printed line: a run's final losses and their ratios to the reference's (or, for the
    fine-tuning, its validation loss before and after)."""
    if "improvement_over_fp32_masters" in result:
        share = result["improvement_over_fp32_masters"]
        return (
            f"{model_name:<11} {name:<22} validation {result['start_validation_loss']:.4f} -> "
            f"{result['final_validation_loss']:.4f} ("
            + ("the fp32 master weights did not improve" if share is None else f"{share:.4f}x")
            + " the fp32 master weights' improvement)"
            + (f"  DIVERGED ({result['diverged']})" if result["diverged"] else "")
        )
    verdict = f"DIVERGED ({result['diverged']})" if result["diverged"] else "within target"
    if not result["within_target"] and not result["diverged"]:
        verdict = "OUTSIDE TARGET"
    return (
        f"{model_name:<11} {name:<22} loss {result['final_loss']:.4f} "
        f"({result['final_loss_over_torch']:.4f}x torch)  validation {result['final_validation_loss']:.4f} "
        f"({result['final_validation_loss_over_torch']:.4f}x torch)  {verdict}"
    )


def smoothed(values: list[float], span: int) -> list[float]:
    """The exponential moving average of ``values`` over about ``span`` steps, bias-corrected (as
    Adam's moments) so that the first values are not pulled towards zero."""
    decay = 1 - 2 / (span + 1)
    out, average = [], 0.0
    for count, value in enumerate(values, 1):
        average = decay * average + (1 - decay) * value
        out.append(average / (1 - decay**count))
    return out


def plot(document: dict[str, Any], path: Path) -> None:
    """One row per model and one for the fine-tuning: the training loss (smoothed), the
    validation loss, and the smoothed training loss over the row's reference (torch's fp32
    AdamW; for the fine-tuning, the fp32 master weights)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["runs"]
    figure, axes = plt.subplots(len(rows), 3, figsize=(16, 3.6 * len(rows)), squeeze=False)
    for (row_name, runs), (training, held_out, ratio) in zip(rows.items(), axes, strict=True):
        reference_name = "fp32" if row_name == "fine-tuning" else REFERENCE
        reference = smoothed(runs[reference_name]["losses"], TAIL)
        for name, run in runs.items():
            label = {REFERENCE: "torch AdamW(fused=True)", NO_MASTER: "torch AdamW on bf16, no master"}.get(
                name, f"tierstore {name}"
            )
            losses = smoothed(run["losses"], TAIL)
            steps = range(1, len(losses) + 1)
            training.plot(steps, losses, label=label, linewidth=1)
            at, values = zip(*run["validation"], strict=True)
            held_out.plot(at, values, label=f"{label} ({run['final_validation_loss']:.3f})", linewidth=1)
            over = [ours / theirs for ours, theirs in zip(losses, reference, strict=False)]  # to a divergence
            ratio.plot(range(1, len(over) + 1), over, label=label, linewidth=1)
        training.set_title(f"{row_name}: training loss (moving average over ~{TAIL} steps)")
        held_out.set_title(f"{row_name}: validation loss")
        if reference_name == REFERENCE:
            ratio.set_title(f"{row_name}: training loss over torch's (target: below the line)")
            ratio.axhline(TARGET, color="grey", linestyle=":", linewidth=1)
        else:
            ratio.set_title(f"{row_name}: training loss over fp32 masters'")
        for axis in (training, held_out, ratio):
            axis.set_xlabel("step")
            axis.legend(fontsize=8)
        training.set_ylabel("nats per byte")
        held_out.set_ylabel("nats per byte")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def names_of(known: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: a non-empty comma-separated list of names among ``known``."""
    known = tuple(known)

    def parse(text: str) -> list[str]:
        chosen = [part.strip() for part in text.split(",") if part.strip()]
        if not chosen or any(name not in known for name in chosen):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(known)} (got {text!r})")
        return chosen

    return parse


def main() -> int:
    assert __doc__ is not None
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=2000, help="steps of each training run")
    parser.add_argument(
        "--finetune-steps", type=positive_int, default=500, help="steps of each fine-tuning run"
    )
    parser.add_argument(
        "--formats", type=names_of(FORMATS), default=list(FORMATS), help="state precisions to train"
    )
    parser.add_argument(
        "--models",
        type=names_of(MODELS),
        default=list(MODELS),
        help="models to train (the fine-tuning runs when the GPT is among them)",
    )
    parser.add_argument("--width", type=positive_int, default=64, help="both models' width")
    parser.add_argument("--layers", type=positive_int, default=2, help="both models' blocks")
    parser.add_argument("--length", type=positive_int, default=64, help="tokens (bytes) per sequence")
    parser.add_argument("--batch", type=positive_int, default=8, help="sequences per batch")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--finetune-lr",
        type=float,
        default=1e-5,
        help="the fine-tuning's learning rate: Adam's steps of about this size are below half a "
        "bf16 ulp of most weights, which torch's AdamW on bf16 parameters then rounds away",
    )
    parser.add_argument(
        "--finetune-bytes", type=positive_int, default=1 << 20, help="bytes of source code to fine-tune on"
    )
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch's CPU threads: these models gain nothing from a second one, and OpenMP's "
        "spin-waiting threads run many times slower on cores another process also uses",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validation-fraction", type=float, default=0.1, help="of each text, held out")
    parser.add_argument("--eval-every", type=positive_int, default=100, help="steps between validations")
    parser.add_argument("--eval-batches", type=positive_int, default=16, help="batches per validation")
    parser.add_argument("--sub-group-size", type=positive_int, default=16384, help="OffloadedAdamW's")
    parser.add_argument(
        "--dram-budget",
        type=positive_int,
        default=1 << 20,
        help="OffloadedAdamW's, in bytes (below its state)",
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="directory for the state (default: ./bench-data)"
    )
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--plot", type=Path, required=True)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    train_text, held_out = split(english_corpus(), args.validation_fraction)
    data = (train_text, validation_batches(held_out, args))
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    with data_directory(args.dir, "quality-state-precision-") as directory:
        trained: dict[str, dict[str, torch.Tensor]] = {}
        for model_name in args.models:
            runs[model_name], trained[model_name] = pretraining(model_name, args, data, directory)
        if "gpt" in trained:
            runs["fine-tuning"] = fine_tuning(trained["gpt"], args, directory)
    summary = {
        row: compare_fine_tuning(row_runs) if row == "fine-tuning" else compare(row_runs)
        for row, row_runs in runs.items()
    }
    document = {
        "benchmark": "state_precision_quality",
        "metadata": {**metadata(args), "seconds": round(time.perf_counter() - started)},
        "summary": summary,
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    plot(document, args.plot)
    for row, results in summary.items():
        for name, result in results.items():
            print(summary_line(row, name, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A Hugging Face ``Trainer`` run with DeepSpeed ZeRO-3 and its optimizer offloaded to NVMe, with
no tierstore code in it: the DeepSpeed config decides. With a ``tierstore`` section and
``TIERSTORE_DEEPSPEED=1`` in the environment, tierstore holds the optimizer state; without the
section (or the variable) it is stock DeepSpeed's own NVMe offload.

    TIERSTORE_DEEPSPEED=1 python -m tierstore.integrations.deepspeed.trainer_example \\
        --config ds_config.json --output-dir out --steps 6

The model is a 2-layer GPT-2 built from its config (random init, nothing downloaded), trained on
the bytes of the standard library's source files (vocabulary 256), on CPU with gloo, in one
process (the rank variables default to one rank). ``--json`` writes the loss of every step.
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
from pathlib import Path
from typing import Any

import torch

LENGTH = 128
SEQUENCES = 64


def corpus() -> list[dict[str, torch.Tensor]]:
    """``SEQUENCES`` byte sequences of ``LENGTH`` from the standard library's sources, in a fixed
    order (the same on every run of this Python)."""
    data = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data += path.read_bytes()
        if len(data) >= SEQUENCES * LENGTH:
            break
    tokens = torch.frombuffer(bytes(data[: SEQUENCES * LENGTH]), dtype=torch.uint8).long()
    return [{"input_ids": row, "labels": row} for row in tokens.view(SEQUENCES, LENGTH)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="DeepSpeed config (JSON file)")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", type=Path, help="resume from this checkpoint folder")
    parser.add_argument("--json", type=Path, help="write the losses and the optimizer's class here")
    args = parser.parse_args(argv)
    # DeepSpeed finds one rank from these (otherwise it looks for MPI)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29517")
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )

    losses: dict[int, float] = {}

    class RecordLosses(TrainerCallback):
        def on_log(
            self, args: Any, state: TrainerState, control: TrainerControl, logs: Any = None, **kwargs: Any
        ) -> None:
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=LENGTH))
    training = TrainingArguments(
        output_dir=str(args.output_dir),
        deepspeed=args.config,
        use_cpu=True,
        ddp_backend="gloo",
        bf16=True,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=corpus(), callbacks=[RecordLosses()])
    trainer.train(resume_from_checkpoint=str(args.resume) if args.resume else None)
    result = {
        "losses": {str(step): loss for step, loss in sorted(losses.items())},
        "optimizer": type(trainer.model_wrapped.optimizer).__name__,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

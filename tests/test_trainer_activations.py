"""Activation offload switched on by configuration under Hugging Face ``Trainer``
(``TIERSTORE_ACTIVATIONS``, tierstore.integrations.huggingface): a Trainer script with no
tierstore code trains bit-identically with and without it, and the offloader did the work."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
import transformers
import transformers.trainer
from tierstore.integrations import huggingface

from tierstore import ConfigError

from .helpers import small_llama_config

PTH = Path(huggingface.__file__).with_name("tierstore-activations.pth")
CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    else "gradient_checkpointing"
)
"""The name of Trainer's switch for gradient checkpointing in this transformers release."""


def train(output_dir: Path) -> list[float]:
    """A Trainer script as a user writes it: a small Llama from its config, gradient checkpointing
    on, 3 steps on CPU; the loss of each step."""
    losses: list[float] = []

    class RecordLosses(transformers.TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(small_llama_config())
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 128, (24, 64), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in rows]
    checkpointing: dict[str, Any] = {CHECKPOINTING: True}
    arguments = transformers.TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **checkpointing,
    )
    trainer = transformers.Trainer(
        model=model, args=arguments, train_dataset=data, callbacks=[RecordLosses()]
    )
    trainer.train()
    return losses


def test_trainer_offloads_by_configuration_alone_and_trains_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    expected = train(tmp_path / "stock")
    settings = tmp_path / "activations.toml"
    settings.write_text(
        '[activations]\nbudget = "4MiB"\nmin_bytes = "16KiB"\nplan = "all"\nscope = "checkpoint-inputs"\n\n'
        f'[[tiers]]\nname = "nvme"\nbackend = {{ type = "nvme", path = "{tmp_path / "tier"}" }}\n'
    )
    monkeypatch.setenv(huggingface.VARIABLE, str(settings))
    monkeypatch.setattr(
        transformers.trainer, "DEFAULT_CALLBACKS", list(transformers.trainer.DEFAULT_CALLBACKS)
    )
    huggingface.install()  # what the .pth line does at start-up (tested below)
    with caplog.at_level(logging.INFO, logger="tierstore.activations"):
        got = train(tmp_path / "offloaded")
    assert got == expected and len(got) == 3
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tierstore activations:")]
    stats = json.loads(line.split(":", 1)[1])
    assert stats["steps"] == 3 and stats["spilled_bytes"] == 3 * 2 * 4 * 64 * 64 * 4  # the layers' inputs
    assert stats["outside_checkpoint_bytes"] > 0 and stats["resident_bytes"] == 0


def test_the_pth_line_installs_the_callback_only_when_the_variable_is_set(tmp_path: Path) -> None:
    """The line that the install puts into site-packages (tested from a site directory of its
    own: the checkout's editable install may predate it)."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(PTH, site / PTH.name)
    probe = (
        f"import site; site.addsitedir({str(site)!r}); import transformers.trainer as t; "
        "print(any(c.__name__ == 'ActivationsCallback' for c in t.DEFAULT_CALLBACKS))"
    )
    for value, expected in (("1", "True"), ("0", "False")):
        environment = {**os.environ, huggingface.VARIABLE: value}
        run = subprocess.run(
            [sys.executable, "-c", probe],
            env=environment,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip().splitlines()[-1] == expected


def test_settings_are_checked_and_name_what_is_wrong(tmp_path: Path) -> None:
    assert huggingface.settings("1").options.plan == "lifetime"  # every default
    assert huggingface.settings("1").store["tiers"]  # the embedded default store
    bad = tmp_path / "bad.toml"
    bad.write_text('[activations]\nbudget = "lots"\n')
    with pytest.raises(ConfigError, match=r"activations\.budget"):
        huggingface.settings(str(bad))
    with pytest.raises(ConfigError, match=huggingface.VARIABLE):
        huggingface.settings(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match=huggingface.VARIABLE):
        huggingface.settings("yes please")


def test_a_deepspeed_config_that_offloads_activations_too_is_refused() -> None:
    callback = huggingface.activations_callback()()
    args = SimpleNamespace(deepspeed={"tierstore": {"activations": {"budget": "1GiB"}}})
    with pytest.raises(ConfigError, match="keep one of them"):
        callback.on_train_begin(args, None, None, model=torch.nn.Linear(2, 2))
    assert callback.offload is None

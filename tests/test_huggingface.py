"""tierstore switched on by config alone under Hugging Face ``Trainer`` (and so Accelerate):
real transformers, Accelerate and DeepSpeed ZeRO-3 on CPU (gloo), one process per run.

Every run is ``trainer_example`` (a Trainer script with no tierstore code) in a new process with
``TIERSTORE_DEEPSPEED=1``; whether tierstore holds the optimizer state is decided by the config's
``tierstore`` section only. The runs are shared by the tests (one module-scoped set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import deepspeed
import deepspeed.runtime.zero.stage3 as stage3
import torch
from tierstore.integrations import deepspeed as ts_deepspeed
from tierstore.integrations.deepspeed.config import parse_section

from tests.test_deepspeed import BF16_TOLERANCE, deepspeed_aio_missing
from tierstore import ConfigError, UnsupportedVersionError

from .helpers import free_port, run_child

pytestmark = pytest.mark.skipif(
    deepspeed_aio_missing(), reason="DeepSpeed's own NVMe offload (the baseline) needs Debian's libaio-dev"
)

# Trainer fills the "auto" values. 300k-element sub-groups: the ~450k-parameter model has two,
# one at least DeepSpeed's 1 MiB swap threshold (swapped to files) and one below (kept in memory).
STOCK_CONFIG: dict[str, Any] = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "pin_memory": False, "buffer_count": 4},
        "offload_param": {"device": "none"},
        "sub_group_size": 300000,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "bf16": {"enabled": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
SECTION = {"dram_budget": "16MiB"}


def trainer(
    workdir: Path,
    name: str,
    *,
    tierstore: bool,
    save_steps: int = 0,
    resume: Path | None = None,
    enabled: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run the Trainer script for 6 steps (its own NVMe and output folders under ``name``), with
    ``TIERSTORE_DEEPSPEED`` set to 1 if ``enabled``, else 0."""
    config = json.loads(json.dumps(STOCK_CONFIG))
    config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(workdir / name / "nvme")
    if tierstore:
        config["tierstore"] = SECTION
    (workdir / name).mkdir()
    (workdir / name / "ds.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "tierstore.integrations.deepspeed.trainer_example"]
    command += ["--config", str(workdir / name / "ds.json"), "--output-dir", str(workdir / name / "out")]
    command += ["--steps", "6", "--save-steps", str(save_steps), "--json", str(workdir / name / "run.json")]
    if resume is not None:
        command += ["--resume", str(resume)]
    environment = {
        **os.environ,
        "TIERSTORE_DEEPSPEED": "1" if enabled else "0",
        "MASTER_PORT": str(free_port()),
    }
    return run_child(command, env=environment, timeout=600)


def result(workdir: Path, name: str, run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return dict(json.loads((workdir / name / "run.json").read_text()))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, deepspeed_ops: None) -> Any:
    """The Trainer runs' directory, on tmpfs when there is one (O_DIRECT works there on this
    kernel); DeepSpeed's ops are built by then."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.mktemp("hf")
    directory = base / f"tierstore-hf-{os.getpid()}"
    directory.mkdir()
    yield directory
    subprocess.run(["rm", "-rf", str(directory)], check=True)


@pytest.fixture(scope="module")
def runs(workdir: Path) -> dict[str, dict[str, Any]]:
    """6 steps with a checkpoint at step 3, with and without the tierstore section."""
    return {
        name: result(workdir, name, trainer(workdir, name, tierstore=name == "tierstore", save_steps=3))
        for name in ("stock", "tierstore")
    }


def losses(run: dict[str, Any]) -> list[float]:
    return list(run["losses"].values())


def test_trainer_losses_match_deepspeeds_own_nvme_offload(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["tierstore"]["optimizer"] == "TierStoreZeroOptimizer"
    assert list(runs["tierstore"]["losses"]) == [str(step) for step in range(1, 7)]
    assert losses(runs["tierstore"]) == pytest.approx(losses(runs["stock"]), rel=BF16_TOLERANCE)
    assert losses(runs["tierstore"])[-1] < losses(runs["tierstore"])[0]


def test_a_config_without_the_section_runs_stock_deepspeed(runs: dict[str, Any], workdir: Path) -> None:
    """Same script, same environment (tierstore enabled), no section: no tierstore object."""
    assert runs["stock"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert not list((workdir / "stock").rglob("tierstore*"))
    assert list((workdir / "stock" / "nvme" / "zero_stage_3" / "optimizer").rglob("*.tensor.swp"))


def test_trainer_resumes_exactly_in_a_new_process(runs: dict[str, Any], workdir: Path) -> None:
    checkpoint = workdir / "tierstore" / "out" / "checkpoint-3"
    resumed = result(workdir, "resumed", trainer(workdir, "resumed", tierstore=True, resume=checkpoint))
    assert resumed["optimizer"] == "TierStoreZeroOptimizer"
    assert resumed["losses"] == {step: runs["tierstore"]["losses"][step] for step in ("4", "5", "6")}


def test_stock_deepspeed_refuses_a_tierstore_checkpoint(runs: dict[str, Any], workdir: Path) -> None:
    """Stock DeepSpeed's NVMe load would ignore tierstore's state and go on from fresh masters
    and moments with exit code 0: it must stop and say why."""
    checkpoint = workdir / "tierstore" / "out" / "checkpoint-3"
    run = trainer(workdir, "stock-loads-tierstore", tierstore=False, resume=checkpoint, enabled=False)
    assert run.returncode != 0
    assert "ConfigError: tierstore: this checkpoint's optimizer state was written by tierstore" in run.stderr
    assert not (workdir / "stock-loads-tierstore" / "run.json").exists()


def test_a_stock_nvme_checkpoint_is_imported_when_tierstore_is_switched_on(
    runs: dict[str, Any], workdir: Path
) -> None:
    """DeepSpeed's own checkpoint at step 3 (one sub-group in its swap files, one in its ZeRO file,
    Adam's step counts and the scheduler's learning rate in the ZeRO file), resumed with tierstore:
    the losses are those of the uninterrupted stock run."""
    checkpoint = workdir / "stock" / "out" / "checkpoint-3"
    swapped = {p.name for p in (checkpoint / "global_step3" / "offloaded_tensors" / "rank00").iterdir()}
    assert any(name.startswith("exp_avg_sq-") for name in swapped)
    (zero_file,) = (checkpoint / "global_step3").glob("*optim_states.pt")
    zero = torch.load(zero_file, weights_only=False)["optimizer_state_dict"]
    assert sorted(flat.numel() > 0 for flat in zero["fp32_flat_groups"]) == [False, True]
    imported = result(workdir, "imported", trainer(workdir, "imported", tierstore=True, resume=checkpoint))
    assert imported["optimizer"] == "TierStoreZeroOptimizer"
    stock_tail = [runs["stock"]["losses"][step] for step in ("4", "5", "6")]
    assert losses(imported) == pytest.approx(stock_tail, rel=1e-3)


def test_enable_is_idempotent_and_disable_restores_deepspeeds_functions() -> None:
    own_initialize, own_optimizer = deepspeed.initialize, stage3.DeepSpeedZeroOptimizer_Stage3
    try:
        ts_deepspeed.enable()
        routed = deepspeed.initialize
        assert routed is not own_initialize and ts_deepspeed.is_enabled()
        ts_deepspeed.enable()
        assert deepspeed.initialize is routed
    finally:
        ts_deepspeed.disable()
    assert deepspeed.initialize is own_initialize and not ts_deepspeed.is_enabled()
    assert stage3.DeepSpeedZeroOptimizer_Stage3 is own_optimizer
    ts_deepspeed.disable()
    assert deepspeed.initialize is own_initialize


def test_an_auto_value_tierstore_cannot_resolve_names_the_field(tmp_path: Path) -> None:
    """Through the enabled ``deepspeed.initialize`` (as Accelerate calls it): refused before any
    engine is built. In the section, "auto" means the field's default."""
    config = {
        **STOCK_CONFIG,
        "train_micro_batch_size_per_gpu": 1,
        "tierstore": {"dram_budget": "auto", "activations": {"budget": "auto"}},
    }
    config["zero_optimization"] = {
        **STOCK_CONFIG["zero_optimization"],
        "offload_optimizer": {"device": "nvme", "nvme_path": "auto"},
    }
    model = torch.nn.Linear(4, 4)
    ts_deepspeed.enable()
    try:
        with pytest.raises(ConfigError, match=r"zero_optimization\.offload_optimizer\.nvme_path: 'auto'"):
            deepspeed.initialize(config_params=config, model=model, model_parameters=model.parameters())
        config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path)
        config["tierstore"] = {"tiers": [{"name": "nvme", "backend": "auto"}]}
        with pytest.raises(ConfigError, match=r"tierstore\.tiers\.0\.backend: 'auto'"):
            deepspeed.initialize(config_params=config, model=model, model_parameters=model.parameters())
    finally:
        ts_deepspeed.disable()
    section = parse_section({"tierstore": {"dram_budget": "auto", "activations": {"budget": "auto"}}})
    assert section.dram_budget is None and section.activations is not None
    assert section.activations.budget == 512 << 20


def test_transformers_and_accelerate_versions_are_checked() -> None:
    assert ts_deepspeed.check_huggingface_versions({"transformers": "5.23.0", "accelerate": "1.15.0"}) == {
        "transformers": "5.23.0",
        "accelerate": "1.15.0",
    }
    with pytest.raises(UnsupportedVersionError, match=r"transformers 4\.57\.0 is not supported"):
        ts_deepspeed.check_huggingface_versions({"transformers": "4.57.0"})
    with pytest.raises(UnsupportedVersionError, match=r"Accelerate 2\.0\.0 is not supported"):
        ts_deepspeed.check_huggingface_versions({"accelerate": "2.0.0"})


def test_the_environment_variable_enables_tierstore_through_the_installed_pth() -> None:
    """The .pth that the install put into site-packages (editable installs too) reads
    TIERSTORE_DEEPSPEED; a Trainer script needs no edit. Without it, DeepSpeed stays stock."""
    probe = (
        "import sys, deepspeed; "
        "print('tierstore' in sys.modules and sys.modules['tierstore.integrations.deepspeed'].is_enabled())"
    )
    for value, expected in (("1", "True"), ("0", "False")):
        environment = {**os.environ, "TIERSTORE_DEEPSPEED": value}
        run = run_child([sys.executable, "-c", probe], env=environment, timeout=300)
        assert run.stdout.strip().splitlines()[-1] == expected, run.stderr[-2000:]

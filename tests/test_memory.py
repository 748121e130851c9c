"""One DRAM ledger per store: the cache, the optimizer's staging and the activations reserve from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tierstore.activations import ActivationOffload
from tierstore.backends import open_backend
from tierstore.optimizer import OffloadedAdamW

from tierstore import CapacityError, ConfigError, Tier, TierStore
from tierstore.memory import MemoryLedger

MIB = 1 << 20


def test_ledger_refuses_what_does_not_fit_and_names_the_holders() -> None:
    ledger = MemoryLedger(10 * MIB)
    cache = ledger.reserve("cache", 4 * MIB)
    ledger.reserve("optimizer adamw", 5 * MIB)
    with pytest.raises(CapacityError, match=r"activations.*\(cache 4194304, optimizer adamw 5242880\)"):
        ledger.reserve("activations", 2 * MIB)
    ledger.release(cache)
    ledger.reserve("activations", 2 * MIB)
    assert ledger.held() == {"optimizer adamw": 5 * MIB, "activations": 2 * MIB}


def store_with(tmp_path: Path, memory_budget: int | None) -> TierStore:
    tier = Tier("nvme", open_backend(f"nvme://{tmp_path / 'tier'}"))
    return TierStore([tier], cache_budget=MIB, memory_budget=memory_budget)


def test_optimizer_and_activations_share_the_store_budget(tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256)
    with store_with(tmp_path, 8 * MIB) as store:
        optimizer = OffloadedAdamW(model.parameters(), store, sub_group_size=20_000, dram_budget=4 * MIB)
        with pytest.raises(CapacityError, match="activations"):
            ActivationOffload(store, budget=4 * MIB)
        offload = ActivationOffload(store, budget=3 * MIB)
        reserved = store.stats()["memory"]["reserved_bytes"]
        assert reserved == {"cache": MIB, "optimizer adamw": 4 * MIB, "activations activations": 3 * MIB}
        offload.close()
        assert "activations activations" not in store.stats()["memory"]["reserved_bytes"]
        del optimizer


def test_memory_budget_below_the_cache_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="memory_budget"):
        store_with(tmp_path, MIB // 2)
    config = {
        "memory_budget": "64MiB",
        "cache": {"budget": "8MiB"},
        "tiers": [{"name": "ram", "backend": "dram://"}],
    }
    with TierStore.from_config(config) as store:
        assert store.stats()["memory"]["budget_bytes"] == 64 * MIB


@pytest.mark.parametrize(
    ("owner", "budget", "pool_bytes", "error"),
    [
        ("", 1 << 20, None, "owner"),
        (3, 1 << 20, None, "owner"),
        ("worker", True, None, "budget"),
        ("worker", 1.5, None, "budget"),
        ("worker", -1, None, "budget"),
        ("worker", 1 << 20, True, "pool_bytes"),
        ("worker", 1 << 20, -4096, "pool_bytes"),
    ],
)
def test_staging_refuses_bad_arguments_and_reserves_nothing(
    tmp_path: Path, owner: object, budget: object, pool_bytes: object, error: str
) -> None:
    with store_with(tmp_path, None) as store:
        held = store.memory.held()
        with pytest.raises(ConfigError, match=error):
            store.staging(owner, budget, pool_bytes=pool_bytes)  # type: ignore[arg-type]
        assert store.memory.held() == held

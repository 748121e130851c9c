"""Hypothesis state machine: a TierStore over DRAM + NVMe tiers behaves like a plain dict."""

import shutil
import tempfile
from concurrent.futures import Future
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tierstore.backends import open_backend

from tierstore import KeyNotFoundError, Tier, TierStore

KEYS = st.sampled_from(["a", "b", "c", "d", "e", "layer.0/w"])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
SHAPES = st.lists(st.integers(0, 700), min_size=0, max_size=2).map(tuple)
BUDGET = 16 << 10


class StoreMatchesDict(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tierstore-model-"))
        tiers = [
            Tier("ram", open_backend("dram://"), capacity=12 << 10),
            Tier("nvme", open_backend(f"nvme://{self.root}?chunk_bytes=8192&queue_depth=4")),
        ]
        self.store = TierStore(tiers, cache_budget=BUDGET, workers=3)
        self.model: dict[str, torch.Tensor] = {}
        self.pending: list[Future[None]] = []

    @rule(key=KEYS, dtype=DTYPES, shape=SHAPES, seed=st.integers(0, 2**16), wait=st.booleans())
    def put(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], seed: int, wait: bool) -> None:
        value = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul(50).to(dtype)
        future = self.store.put(key, value)
        (future.result() if wait else self.pending.append(future))
        self.model[key] = value

    @rule(key=KEYS, into_out=st.booleans())
    def get(self, key: str, into_out: bool) -> None:
        expected = self.model.get(key)
        if expected is None:  # never put, or deleted (a delete returns once done)
            assert key not in self.store
            with pytest.raises(KeyNotFoundError):
                self.store.get(key).result()
            return
        out = torch.empty_like(expected) if into_out else None
        got = self.store.get(key, out=out).result()
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.store.delete(key)
        del self.model[key]

    @rule(keys=st.lists(KEYS, max_size=3))
    def prefetch(self, keys: list[str]) -> None:
        known = [key for key in keys if key in self.model and self.model[key].nbytes <= BUDGET]
        self.store.prefetch(known).result()

    @rule()
    def flush(self) -> None:
        self.settle()
        self.store.flush()
        for key in self.model:
            assert not self.store.info(key).dirty

    @invariant()
    def budget_respected(self) -> None:
        assert self.store.stats()["cache_bytes"] <= BUDGET

    def settle(self) -> None:
        for future in self.pending:
            future.result()
        self.pending.clear()

    def teardown(self) -> None:
        try:
            self.settle()
            assert sorted(self.store.keys()) == sorted(self.model)
            for key, value in self.model.items():
                assert torch.equal(self.store[key], value)
        finally:
            self.store.close()
            shutil.rmtree(self.root, ignore_errors=True)


StoreMatchesDict.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestStoreMatchesDict = StoreMatchesDict.TestCase

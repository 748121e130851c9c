from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tierstore.backends import open_backend

from tierstore import Tier, TierStore

StoreFactory = Callable[..., TierStore]


@pytest.fixture(params=["dram", "nvme"])
def tier_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(tmp_path: Path, tier_kind: str) -> Iterator[StoreFactory]:
    """Build stores over one persistent tier of the parametrized kind; closes them afterwards."""
    stores: list[TierStore] = []

    def factory(**options: object) -> TierStore:
        url = (
            "dram://"
            if tier_kind == "dram"
            else f"nvme://{tmp_path / f'tier{len(stores)}'}?chunk_bytes=65536"
        )
        store = TierStore([Tier(tier_kind, open_backend(url))], **options)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()

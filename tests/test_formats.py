"""Format versions of the files tierstore writes: a file of another version is refused (a typed
error naming it, or, for a checkpoint record, not counted as a commit), never read as this one."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest
import torch
from tierstore.backends import open_backend
from tierstore.checkpoint.format import FORMAT as RECORD_FORMAT
from tierstore.checkpoint.format import decode_record, encode_record

from tierstore import BufferMismatchError, ManifestError, Tier, TierStore, export_hdf5, import_hdf5
from tierstore.manifest import FORMAT as MANIFEST_FORMAT
from tierstore.snapshot import FORMAT as SNAPSHOT_FORMAT


def test_a_manifest_snapshot_of_another_format_is_refused(tmp_path: Path) -> None:
    config = {
        "manifest": str(tmp_path / "manifest"),
        "tiers": [{"name": "nvme", "backend": f"nvme://{tmp_path / 'nvme'}"}],
    }
    with TierStore.from_config(config) as store:
        store["x"] = torch.ones(3)
    snapshot = tmp_path / "manifest" / "manifest.json"
    document = json.loads(snapshot.read_text())
    assert document["format"] == MANIFEST_FORMAT
    snapshot.write_text(json.dumps({**document, "format": MANIFEST_FORMAT + 1}))
    with pytest.raises(ManifestError, match=rf"not a tierstore manifest \(format {MANIFEST_FORMAT}\)"):
        TierStore.from_config(config)
    snapshot.write_text(json.dumps(document))
    with TierStore.from_config(config) as store:
        assert torch.equal(store["x"], torch.ones(3))


def test_an_hdf5_snapshot_of_another_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.h5"
    with TierStore([Tier("ram", open_backend("dram://"))]) as store:
        store["x"] = torch.ones(3)
        export_hdf5(store, path)
    with h5py.File(path, "r+") as snapshot:
        assert snapshot.attrs["format"] == SNAPSHOT_FORMAT
        snapshot.attrs["format"] = SNAPSHOT_FORMAT + 1
    with (
        TierStore([Tier("ram", open_backend("dram://"))]) as store,
        pytest.raises(BufferMismatchError, match=rf"not a tierstore snapshot \(format {SNAPSHOT_FORMAT}\)"),
    ):
        import_hdf5(path, store)


def test_a_checkpoint_record_of_another_format_commits_nothing() -> None:
    payload = {"format": RECORD_FORMAT, "name": "step-1"}
    assert decode_record(encode_record(payload)) == payload
    assert decode_record(encode_record({**payload, "format": RECORD_FORMAT + 1})) is None

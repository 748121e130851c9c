"""Read-only opens of a persistent store: beside a writer that has it open (in this process or
another), changing no file, and consistent against a writer compacting the manifest meanwhile."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.backends.dram import DramBackend, DramOptions

import tierstore.manifest as manifest
from tierstore import (
    ConfigError,
    ManifestError,
    ReadOnlyStoreError,
    StoreLockedError,
    TierStore,
)

from .helpers import persistent

ROOT = Path(__file__).resolve().parents[1]
SMALL = ("small/int32", "small/bf16", "small/scalar")
"""Keys of objects below ``pack_below`` (64 KiB by default): written back together in one pack
(an empty object is an object of no extent, never packed)."""


def samples() -> dict[str, torch.Tensor]:
    """Objects of every route to the tier: small ones (written back in a pack), one cached and
    written back alone, one larger than the cache (1 MiB: straight to the tier); a NaN makes
    a comparison bit for bit."""
    generator = torch.Generator().manual_seed(0)
    data = {
        "small/int32": torch.arange(1000, dtype=torch.int32),
        "small/bf16": torch.randn(3, 100, generator=generator).bfloat16(),
        "small/scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 7),
        "mid/fp32": torch.randn(50_000, generator=generator),
        "big/fp32": torch.randn(1 << 19, generator=generator),
    }
    data["mid/fp32"][7] = float("nan")
    return data


def fill(store: TierStore, data: dict[str, torch.Tensor]) -> None:
    """Put ``data`` into ``store`` and write every object back to the tier (journaled)."""
    for key, tensor in data.items():
        store[key] = tensor
    store.flush()


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return (
        got.dtype == expected.dtype
        and got.shape == expected.shape
        and torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))
    )


def contents(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones included), by relative path, with its bytes."""
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def check_reads(reader: TierStore, data: dict[str, torch.Tensor]) -> None:
    """``reader`` holds exactly ``data``, read bit for bit into new tensors and into ``out``."""
    assert sorted(reader) == sorted(data) and len(reader) == len(data)
    for key, tensor in data.items():
        assert key in reader
        assert same_bits(reader[key], tensor), key
        out = torch.full_like(tensor, 7)
        assert reader.get(key, out=out).result() is out and same_bits(out, tensor), key


def lines_through_first_put(journal: bytes, key: str) -> bytes:
    """The journal's lines up to and including the first put of ``key``."""
    kept = b""
    for line in journal.splitlines(keepends=True):
        kept += line
        record = json.loads(line)
        if record["op"] == "put" and record["key"] == key:
            return kept
    raise AssertionError(f"no put of {key!r} in the journal")


def test_a_read_only_store_reads_what_a_writer_holding_it_open_committed(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    data = samples()
    with TierStore.from_config(config) as writer:
        fill(writer, data)
        with TierStore.from_config(config, read_only=True) as reader:
            assert reader.read_only and not writer.read_only
            check_reads(reader, data)
            assert len({reader.info(key).name for key in SMALL}) == 1  # one pack holds them all
            for key in data:
                got, written = reader.info(key), writer.info(key)
                assert (got.tier, got.name, got.extents, got.shape, got.dtype, got.nbytes) == (
                    written.tier,
                    written.name,
                    written.extents,
                    written.shape,
                    written.dtype,
                    written.nbytes,
                )
                assert not got.dirty
            hits = reader.stats()["hits"]
            assert same_bits(reader["small/int32"], data["small/int32"])  # cached by the first read
            assert reader.stats()["hits"] == hits + 1
            reader.prefetch(["mid/fp32"]).result()
            assert reader.info("mid/fp32").cached

            writer["late"] = torch.ones(3)
            writer.flush()
            assert "late" not in reader  # the view is the store as of the open
        assert "late" in writer


WRITER = """
import json, sys
from tierstore import TierStore
from tests.test_read_only import fill, samples
with TierStore.from_config(json.loads(sys.argv[1])) as store:
    fill(store, samples())
    print("ready", flush=True)
    sys.stdin.readline()
"""


def test_a_read_only_store_reads_a_store_another_process_holds_open(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, json.dumps(config)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "ready", writer.communicate(timeout=60)[1][-2000:]
        with pytest.raises(StoreLockedError):  # the other process holds it open for writing
            TierStore.from_config(config)
        with TierStore.from_config(config, read_only=True) as reader:
            check_reads(reader, samples())
        _, errors = writer.communicate("exit\n", timeout=60)
        assert writer.returncode == 0, errors[-2000:]
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.communicate()
    with TierStore.from_config(config) as reopened:  # the writer closed it as usual
        check_reads(reopened, samples())


def test_a_read_only_store_refuses_every_change_and_is_a_copy_source_only(tmp_path: Path) -> None:
    data = samples()
    source, destination = persistent(tmp_path / "source"), persistent(tmp_path / "destination")
    with TierStore.from_config(source) as store:
        fill(store, data)
    own = torch.arange(5.0)
    with TierStore.from_config(destination) as store:
        store["own"] = own
    before = contents(tmp_path / "destination")

    with TierStore.from_config(destination, read_only=True) as reader:
        directory = re.escape(destination["manifest"])
        changes: list[Callable[[], object]] = [
            lambda: reader.put("new", torch.ones(2)),
            lambda: reader.put("new", torch.ones(2), scratch=True),
            lambda: reader.put("own", torch.ones(2), cache=False),
            lambda: reader.__setitem__("own", torch.ones(2)),
            lambda: reader.delete("own"),
            lambda: reader.__delitem__("own"),
        ]
        for change in changes:
            with pytest.raises(ReadOnlyStoreError, match=directory) as refused:
                change()
            assert isinstance(refused.value, PermissionError)
        reader.flush()  # nothing to write
        with TierStore.from_config(source) as writable, pytest.raises(ReadOnlyStoreError, match=directory):
            writable.copy_to(reader)
        assert reader.keys() == ["own"] and same_bits(reader["own"], own)
    assert contents(tmp_path / "destination") == before  # nothing copied, nothing written

    with (
        TierStore.from_config(source, read_only=True) as reader,
        TierStore.from_config(destination) as writable,
    ):
        reader.copy_to(writable)
        check_reads(writable, {**data, "own": own})
    with TierStore.from_config(destination) as reopened:
        check_reads(reopened, {**data, "own": own})


def test_closing_a_read_only_store_leaves_every_file_as_it_was(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    data = samples()
    first, second = dict(list(data.items())[:3]), dict(list(data.items())[3:])
    with TierStore.from_config(config) as writer:
        fill(writer, first)  # compacted into manifest.json at the close
    writer = TierStore.from_config(config)
    try:
        fill(writer, second)  # journaled in journal.jsonl
        journal = Path(config["manifest"]) / "journal.jsonl"
        records = [json.loads(line) for line in journal.read_bytes().splitlines()]
        token = next(record["token"] for record in records if record["op"] == "token")
        # An object the writer is still writing: not journaled yet, and not garbage either.
        (tmp_path / "nvme" / f"{token}-ffff").write_bytes(b"in flight")
        before = contents(tmp_path)
        assert {"manifest/manifest.json", "manifest/journal.jsonl"} <= set(before)

        reader = TierStore.from_config(config, read_only=True)
        check_reads(reader, data)
        reader.prefetch(list(first)).result()
        reader.close()
        assert contents(tmp_path) == before

        writer["late"] = torch.ones(4)
        del writer["big/fp32"]
    finally:
        writer.close()
    with TierStore.from_config(config) as reopened:
        expected = {**data, "late": torch.ones(4)}
        del expected["big/fp32"]
        check_reads(reopened, expected)


def test_a_torn_last_journal_line_is_ignored_and_left_as_it_is(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    whole = torch.arange(1000.0)
    with TierStore.from_config(config) as writer:
        writer.put("whole", whole, cache=False).result()
        journal = Path(config["manifest"]) / "journal.jsonl"
        with open(journal, "ab") as appending:  # an append the writer has not finished
            appending.write(b'{"op":"put","key":"torn","entry":{"shape":[')
        before = journal.read_bytes()
        with TierStore.from_config(config, read_only=True) as reader:
            assert reader.keys() == ["whole"] and same_bits(reader["whole"], whole)
        assert journal.read_bytes() == before


def test_a_compaction_between_the_snapshot_and_the_journal_read_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = persistent(tmp_path)
    data = samples()
    first, second = dict(list(data.items())[:3]), dict(list(data.items())[3:])
    with TierStore.from_config(config) as writer:
        fill(writer, first)  # in manifest.json
    read_bytes = manifest._read_bytes
    compacted: list[Path] = []
    during = torch.arange(3.0)
    with TierStore.from_config(config) as writer:
        fill(writer, second)  # in journal.jsonl

        def compact_before_the_journal_is_read(path: Path) -> bytes | None:
            if path.name == "journal.jsonl" and not compacted:
                # The writer's next journal line compacts: a new snapshot, then the journal
                # truncated, after the reader has read the old snapshot.
                monkeypatch.setattr(manifest, "COMPACT_AFTER", 1)
                writer.put("during", during, cache=False).result()
                monkeypatch.setattr(manifest, "COMPACT_AFTER", 10_000)
                assert path.stat().st_size == 0
                compacted.append(path)
            return read_bytes(path)

        monkeypatch.setattr(manifest, "_read_bytes", compact_before_the_journal_is_read)
        with TierStore.from_config(config, read_only=True) as reader:
            assert compacted
            check_reads(reader, {**data, "during": during})


def test_a_journal_truncated_while_it_is_read_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader reads the new snapshot, renamed into place already, then the journal while the
    compaction truncates it: it got only the journal's first lines, among them a version the
    snapshot has replaced (and whose object is deleted)."""
    config = persistent(tmp_path)
    old, new, other = torch.full((1000,), 1), torch.full((1000,), 2), torch.arange(10)
    writer = TierStore.from_config(config)
    writer.put("k", old, cache=False).result()
    writer.put("k", new, cache=False).result()  # the old version's object is deleted
    writer.put("other", other, cache=False).result()
    open_journal, read_bytes = manifest._open_journal, manifest._read_bytes
    race: dict[str, Any] = {}

    def truncated_while_read(path: Path) -> bytes | None:
        content = read_bytes(path)
        if path.name != "journal.jsonl" or "journal" in race:
            return content
        assert content is not None
        race["journal"] = open_journal(path, truncate=True)  # the compaction's truncation
        return lines_through_first_put(content, "k")  # how far the read got before it

    def open_the_reader_before_truncating(path: Path, *, truncate: bool) -> int:
        if not truncate:
            return open_journal(path, truncate=False)
        monkeypatch.setattr(manifest, "_read_bytes", truncated_while_read)
        race["reader"] = TierStore.from_config(config, read_only=True)
        journal: int = race["journal"]
        return journal

    monkeypatch.setattr(manifest, "_open_journal", open_the_reader_before_truncating)
    writer.close()  # compacts: the new snapshot is renamed into place, then the journal truncated
    with race["reader"] as reader:
        check_reads(reader, {"k": new, "other": other})


def test_a_writer_compacting_under_every_replay_is_a_manifest_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = persistent(tmp_path)
    read_bytes = manifest._read_bytes
    with TierStore.from_config(config) as writer:
        writer.put("x", torch.ones(3), cache=False).result()
        monkeypatch.setattr(manifest, "COMPACT_AFTER", 1)  # every journal line compacts

        def compact_before_every_journal_read(path: Path) -> bytes | None:
            if path.name == "journal.jsonl":
                writer.put("x", torch.ones(3), cache=False).result()
            return read_bytes(path)

        monkeypatch.setattr(manifest, "_read_bytes", compact_before_every_journal_read)
        with pytest.raises(ManifestError, match=f"compacted under each of {manifest.READ_ATTEMPTS} attempts"):
            TierStore.from_config(config, read_only=True)


def test_a_read_only_open_needs_an_existing_manifest_and_a_bool(tmp_path: Path) -> None:
    backend = DramBackend(DramOptions())
    try:
        with pytest.raises(ConfigError, match=r"^read_only: a read-only store opens a persistent store's"):
            TierStore([backend], read_only=True)
        with pytest.raises(ConfigError, match=r"^read_only: must be True or False, not 'yes'"):
            TierStore([backend], manifest=tmp_path / "manifest", read_only="yes")  # type: ignore[arg-type]
    finally:
        backend.close()
    config = persistent(tmp_path)
    with pytest.raises(ConfigError, match=r"^read_only: a read-only store opens"):
        TierStore.from_config({**config, "manifest": None}, read_only=True)

    missing = Path(config["manifest"])
    with pytest.raises(ManifestError, match=f"no persistent store at {re.escape(str(missing))}$"):
        TierStore.from_config(config, read_only=True)
    assert not missing.exists()
    missing.mkdir()
    with pytest.raises(ManifestError, match=r"holds neither manifest\.json nor journal\.jsonl"):
        TierStore.from_config(config, read_only=True)
    assert list(missing.iterdir()) == []

"""Child process of the compaction crash test: puts versions of 8 keys into a persistent store
whose manifest compacts every 20 journal lines, and kills itself (SIGKILL) at one step of the
first compaction:

    python tests/crash_compactor.py CONFIG_JSON STEP

STEP is ``snapshot-written`` (the new snapshot is written but not renamed into place),
``snapshot-renamed`` (renamed, the journal not yet truncated) or ``journal-truncated``. Before
each put the child prints ``start KEY VERSION``, after it ``done KEY VERSION``.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch

import tierstore.manifest as manifest
from tierstore import TierStore


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    config, step = json.loads(sys.argv[1]), sys.argv[2]
    manifest.COMPACT_AFTER = 20
    if step == "snapshot-written":
        os.replace = lambda *_: die()
    elif step == "snapshot-renamed":
        manifest._fsync_directory = lambda _: die()  # type: ignore[assignment]
    else:
        open_journal = manifest._open_journal

        def open_then_die(path: Path, *, truncate: bool) -> int:
            journal = open_journal(path, truncate=truncate)
            if truncate:
                die()
            return journal

        manifest._open_journal = open_then_die
    with TierStore.from_config(config) as store:
        for version in range(1000):
            key = f"k{version % 8}"
            print("start", key, version, flush=True)
            store.put(key, torch.full((1000 + version,), version, dtype=torch.int32), cache=False).result()
            print("done", key, version, flush=True)


if __name__ == "__main__":
    main()

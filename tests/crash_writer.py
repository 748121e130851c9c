"""Child process of the crash test: puts versions of 8 keys into a persistent store until killed.

Every tensor is ``full(n, version)`` (int32) with a size that depends on the version, so after a
kill the parent can tell a whole version (every element equal) from a torn one. The highest
version started is written to ``<manifest>.started`` before each put.

    python tests/crash_writer.py CONFIG_JSON FIRST_VERSION SEED [packs]

With ``packs``, each version is instead a round: 300 small keys ``full(1 + version % 250,
version)`` put and flushed (written back as packs), and ``<manifest>.flushed`` names the last
round whose flush returned.
"""

import json
import os
import random
import sys
from pathlib import Path

import torch

from tierstore import TierStore


def main() -> None:
    config = json.loads(sys.argv[1])
    version, rng = int(sys.argv[2]), random.Random(int(sys.argv[3]))
    started = Path(config["manifest"] + ".started")
    packs = sys.argv[4:] == ["packs"]
    with TierStore.from_config(config) as store:
        print("ready", flush=True)
        while True:
            record(started, version)
            if packs:
                tensor = torch.full((1 + version % 250,), version, dtype=torch.int32)
                for put in [store.put(f"k{key}", tensor) for key in range(300)]:
                    put.result()
                store.flush()
                record(Path(config["manifest"] + ".flushed"), version)
            else:
                key = f"k{rng.randrange(8)}"
                store.put(
                    key, torch.full((4096 + 997 * (version % 300),), version, dtype=torch.int32)
                ).result()
            version += 1


def record(path: Path, version: int) -> None:
    """Write ``version`` to ``path``, replaced whole: never read empty."""
    path.with_suffix(".tmp").write_text(str(version))
    os.replace(path.with_suffix(".tmp"), path)


if __name__ == "__main__":
    main()

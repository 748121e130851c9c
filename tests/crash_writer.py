"""Child process of the crash test: puts versions of 8 keys into a persistent store until killed.

Every tensor is ``full(n, version)`` (int32) with a size that depends on the version, so after a
kill the parent can tell a whole version (every element equal) from a torn one. The highest
version started is written to ``<manifest>.started`` before each put.

    python tests/crash_writer.py CONFIG_JSON FIRST_VERSION SEED
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
    with TierStore.from_config(config) as store:
        print("ready", flush=True)
        while True:
            key = f"k{rng.randrange(8)}"
            started.with_suffix(".tmp").write_text(str(version))  # replaced whole: never read empty
            os.replace(started.with_suffix(".tmp"), started)
            store.put(key, torch.full((4096 + 997 * (version % 300),), version, dtype=torch.int32)).result()
            version += 1


if __name__ == "__main__":
    main()

"""Where an update phase's time goes: py-spy samples of a benchmark child, sorted into categories.

py-spy (``pip install py-spy``) samples every thread's Python stack ``RATE`` times a second,
idle ones included (``--idle``), with thread names. Each sample is put in the first category whose
rule matches a frame, innermost frame first; the seconds per category are samples / rate, per
thread group (the caller's main thread, the nvme backend's I/O workers, the store's workers...).
A main-thread sample in ``waiting`` is the update waiting on I/O or a hand-off.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections import defaultdict
from pathlib import Path

from .common import run_captured

RATE = 100
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("checksums", re.compile(r"^(digest|xxh3\w*) ")),
    ("state packing", re.compile(r"^[\w.]+ \(.*state_precision\.py")),
    ("adam kernel", re.compile(r"^(\w+\.)?(_update|_adamw) \(.*(adamw|apollo)\.py")),
    ("gradient conversion", re.compile(r"^(\w+\.)?(_gradients|_?gradient_chunks|_scaled) \(")),
    ("gradient norm", re.compile(r"^(\w+\.)?_gradient_coefficient \(")),
    ("copies", re.compile(r"^(_copy|\w+\._copy_to_model|\w+\._write_back_pack) \(")),
    (
        "device I/O",
        re.compile(r"^(_pwrite_all|_pread_all|\w+\._direct_head|\w+\._write_chunk|\w+\._read_chunk) \("),
    ),
    (
        "waiting",
        re.compile(r"^(\w+\.)?(wait|result|acquire|_wait_for_room|get|_worker|_take_blocking|wait_for) \("),
    ),
]
"""(category, rule on one frame ``function (file:line)``), tried in order on each frame."""


def record(command: list[str], output: Path, cwd: Path) -> None:
    """Run ``command`` under py-spy in the folder ``cwd``, writing raw samples to ``output``."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        raise RuntimeError("py-spy is not installed: pip install py-spy")
    run_captured(
        [
            spy,
            "record",
            "--format",
            "raw",
            "--rate",
            str(RATE),
            "--threads",
            "--idle",
            "--nonblocking",
            "-o",
            str(output),
            "--",
            *command,
        ],
        "py-spy",
        cwd=cwd,
    )


def breakdown(raw: Path, phase: re.Pattern[str]) -> dict[str, dict[str, float]]:
    """Seconds per category per thread group, from py-spy's raw output. The main thread counts
    only inside ``phase`` (a frame rule, e.g. the optimizer's ``step``); other threads cannot be
    told apart by phase and count over the whole run."""
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        group = _group(frames[0].partition(": ")[2])
        if group == "main" and not any(phase.search(frame) for frame in frames[1:]):
            continue
        seconds[group][_category(frames[1:])] += int(count) / RATE
    return {group: {k: round(v, 2) for k, v in sorted(c.items())} for group, c in sorted(seconds.items())}


def _group(thread: str) -> str:
    if thread.startswith("MainThread"):
        return "main"
    if thread.startswith("tierstore-nvme"):
        return "nvme I/O workers"
    if thread.startswith("tierstore-commit"):
        return "write-back completions"
    if thread.startswith("tierstore"):
        return "store workers"
    return "other"


def _category(frames: list[str]) -> str:
    for frame in reversed(frames):
        for category, rule in CATEGORIES:
            if rule.search(frame):
                return category
    return "python and other" if frames else "idle"

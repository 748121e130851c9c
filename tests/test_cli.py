import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore import TierStore
from tierstore.app.cli import main
from tierstore.app.demo import training_failure

from .helpers import run_child

VIRTUAL = """
[[tiers]]
name = "virtual"

[[tiers.paths]]
name = "fast"
backend = {{ type = "throttle", inner = "dram://", read_bytes_per_s = "400MB", write_bytes_per_s = "400MB" }}

[[tiers.paths]]
name = "disk"
backend = "nvme://{root}"
"""


def test_train_offloads_optimizer_state_and_activations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = ["train", "--dir", str(tmp_path / "data"), "--layers", "2", "--width", "128", "--steps", "4"]
    budgets = ["--sub-group-size", "20000", "--dram-budget", "1MiB", "--activation-budget", "4MiB"]
    assert main([*arguments, *budgets, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state_over_budget"] > 1.5 and report["subgroups"] > 1
    assert report["loss_decreased"] and len(report["steps"]) == 4
    assert all(step["gb_per_s"]["nvme"] > 0 for step in report["steps"])
    for step in report["steps"]:
        assert 0 < step["peak_resident_activation_bytes"] <= 4 << 20
        assert step["keep_in_memory_activation_bytes"] > 2 * (4 << 20)
    assert report["steps"][-1]["activation_plan"] == "lifetime"
    assert report["activation_stats"]["spilled_bytes"] > 0
    assert report["memory"]["budget_bytes"] == 5 << 20  # one ledger: 1 MiB optimizer + 4 MiB activations
    assert sorted(report["memory"]["reserved_bytes"]) == [
        "activations activations",
        "cache",
        "optimizer adamw",
    ]
    assert not (tmp_path / "data").exists()  # no objects left, nor the directory the run made


def test_train_with_apollo_mini(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["train", "--dir", str(tmp_path / "data"), "--layers", "2", "--width", "128", "--steps", "4"]
    budgets = ["--sub-group-size", "20000", "--dram-budget", "2MiB", "--activation-budget", "4MiB"]
    assert main([*arguments, *budgets, "--optimizer", "apollo-mini", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["optimizer"] == "apollo-mini" and report["loss_decreased"]
    assert "optimizer apollo" in report["memory"]["reserved_bytes"]
    # the blocks' matrices keep rank-1 moments: well under AdamW's 12 bytes per parameter
    assert report["fp32_state_bytes"] < 8 * report["parameters"]
    assert not (tmp_path / "data").exists()


def test_spill_round_trips_and_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spill", "--dir", str(tmp_path / "data"), "--total", "8MiB", "--object", "1MiB"]) == 0
    assert "verified=True" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # the store removed its objects, the CLI the directory


def test_spill_reports_what_reached_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Within the DRAM budget no read reaches a tier, and the report says so instead of passing
    memory copies off as tier throughput; ``--budget`` makes it spill."""
    monkeypatch.chdir(tmp_path)  # the embedded config's ./tierstore-data
    assert main(["spill", "--total", "4MiB", "--object", "1MiB"]) == 0
    report, summary = _report_and_summary(*capsys.readouterr())
    assert report["cache_budget_bytes"] == 256 << 20
    assert report["tier_bytes_written"] == 4 << 20 and report["tier_bytes_read"] == 0  # flush only
    assert "every read was served from DRAM" in summary and "verified=True" in summary
    assert main(["spill", "--total", "4MiB", "--object", "1MiB", "--budget", "1MiB"]) == 0
    report, summary = _report_and_summary(*capsys.readouterr())
    assert report["cache_budget_bytes"] == 1 << 20 and report["tier_bytes_written"] >= 3 << 20
    assert report["tier_bytes_read"] >= 3 << 20 and "4.0x the DRAM budget" in summary
    assert main(["spill", "--total", "4MiB", "--object", "1MiB", "--budget", "0"]) == 0
    report, summary = _report_and_summary(*capsys.readouterr())
    assert report["tier_bytes_written"] == report["tier_bytes_read"] == 4 << 20
    assert "no DRAM cache" in summary and "served from DRAM" not in summary
    assert list(tmp_path.iterdir()) == []  # ./tierstore-data was made by each run and removed


def _report_and_summary(out: str, err: str) -> tuple[dict[str, Any], str]:
    """The report (stdout: one JSON document) and the summary line (stderr)."""
    return json.loads(out), err.strip().splitlines()[-1]


def test_spill_keeps_a_directory_it_did_not_create(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.txt").write_text("keep")
    assert main(["spill", "--dir", str(tmp_path / "data"), "--total", "1MiB", "--object", "1MiB"]) == 0
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["mine.txt"]
    nested = tmp_path / "made" / "for" / "it"
    assert main(["spill", "--dir", str(nested), "--total", "1MiB", "--object", "1MiB", "--budget", "0"]) == 0
    assert not (tmp_path / "made").exists()  # the parents it made go too


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["spill", "--object", "0"], "argument --object: must be a positive multiple of 4 bytes"),
        (["spill", "--object", "3", "--total", "12"], "argument --object: must be a positive multiple of 4"),
        (["spill", "--total", "1000"], "argument --total: 1000 bytes is not a multiple of --object"),
        (["spill", "--total", "0"], "argument --total: must be at least 1 byte"),
        (["spill", "--budget", "true"], "argument --budget: must be a number of bytes >= 0 (an integer or"),
        (["spill", "--budget", "-1"], "argument --budget: must be a number of bytes >= 0 (an integer or"),
        (["train", "--steps", "0"], "argument --steps: must be at least 1, not 0"),
        (["train", "--sub-group-size", "0"], "argument --sub-group-size: must be at least 1, not 0"),
        (["train", "--layers", "two"], "argument --layers: 'two' is not an integer"),
        (["train", "--width", "-8"], "argument --width: must be at least 1, not -8"),
        (["train", "--dram-budget", "0"], "argument --dram-budget: must be at least 1 byte"),
        (["probe", "c.toml", "--size", "0"], "argument --size: must be at least 1 byte"),
        (["bench", "c.toml", "--objects", "0"], "argument --objects: must be at least 1, not 0"),
        (["bench", "c.toml", "--size", "0B"], "argument --size: must be at least 1 byte"),
    ],
)
def test_bad_options_are_usage_errors_naming_the_option(
    arguments: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(arguments)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: tierstore {arguments[0]}" in err and message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing created


@pytest.mark.parametrize("command", [[], ["train"], ["spill"], ["probe"], ["bench"], ["inspect"]])
def test_every_option_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "The ``tierstore`` command line" not in text and "``" not in text
    entries = [line for line in text.splitlines() if re.match(r"  \S", line)]  # options and positionals
    assert entries
    lines = text.splitlines()
    for line in entries:
        following = lines[lines.index(line) + 1] if lines.index(line) + 1 < len(lines) else ""
        described = re.search(r"\S  +\S", line) or re.match(r" {6,}\S", following)
        assert described, f"no help text for {line.strip()!r} in tierstore {' '.join(command)}"


def test_the_description_says_what_tierstore_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "Spill PyTorch tensors through a DRAM cache onto NVMe, Zarr and ADIOS2 tiers" in " ".join(
        capsys.readouterr().out.split()
    )


def test_probe_reports_and_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each figure says where it comes from; a probe of another size measures something else, so
    the cache's figures are used for the same size only."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = tmp_path / "c.toml"
    config.write_text(VIRTUAL.format(root=tmp_path / "disk"))

    def probe(size: str) -> dict[str, Any]:
        assert main(["probe", str(config), "--size", size]) == 0
        report: dict[str, Any] = json.loads(capsys.readouterr().out)
        assert set(report) == {"fast", "disk"}
        return report

    first = probe("4MiB")
    assert 0 < first["fast"]["write_gb_per_s"] <= 0.41  # throttled to 0.4 GB/s; how far below is load
    assert (tmp_path / "cache" / "tierstore" / "bandwidth.json").exists()
    assert first["disk"]["source"] == "measured" and first["disk"]["probe_bytes"] == 4 << 20
    again = probe("4MiB")["disk"]
    assert again["source"] == "cache" and again["measured_at"] == first["disk"]["measured_at"]
    other = probe("1MiB")["disk"]  # not the 4 MiB figures
    assert other["source"] == "measured" and other["probe_bytes"] == 1 << 20
    assert probe("1MiB")["disk"]["source"] == "cache"
    assert probe("4MiB")["disk"]["source"] == "measured"  # the cache keeps a path's latest probe


def test_bench_writes_json_and_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.toml"
    config.write_text(VIRTUAL.format(root=tmp_path / "disk"))
    output, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(
        [
            "bench",
            str(config),
            "--size",
            "4MiB",
            "--objects",
            "3",
            "--output",
            str(output),
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    report = json.loads(output.read_text())
    tier = report["tiers"]["virtual"]
    assert set(tier["paths_alone"]) == {"fast", "disk"}
    assert tier["tier"]["bytes"] == 3 * (4 << 20)
    assert set(report["timeline_gb_per_s"]) == {"fast", "disk"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(capsys.readouterr().out) == report


def test_bad_config_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.json"
    config.write_text('{"tiers": [{"name": "x", "backend": "warp://"}]}')
    assert main(["bench", str(config)]) == 2
    assert "unknown backend 'warp'" in capsys.readouterr().err


TINY_TRAIN = [
    "--layers", "1", "--width", "64", "--length", "16", "--batch", "2",
    "--sub-group-size", "50000", "--dram-budget", "2MiB", "--activation-budget", "1MiB",
]  # fmt: skip


def extras_only_modules() -> set[str]:
    """Top-level modules of the distributions only tierstore's extras install: neither a runtime
    requirement nor anything those pull in."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def requirements(distribution: str) -> list[Requirement]:
        try:
            return [Requirement(text) for text in metadata.requires(distribution) or []]
        except metadata.PackageNotFoundError:
            return []

    runtime: set[str] = set()
    pending = [r for r in requirements("tierstore") if r.marker is None]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name not in runtime:
            runtime.add(name)
            pending += [r for r in requirements(name) if r.marker is None or r.marker.evaluate({"extra": ""})]
    extras = {canonicalize_name(r.name) for r in requirements("tierstore") if r.marker is not None}
    blocked = extras - runtime - {"tierstore"}
    return {
        module
        for module, distributions in metadata.packages_distributions().items()
        if any(canonicalize_name(d) in blocked for d in distributions)
    }


BLOCKING_TRAIN = """
import json, sys
for name in json.loads(sys.argv[1]):  # as if not installed: import fails, find_spec says None
    sys.modules[name] = None
from tierstore.app.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_the_main_job_needs_only_the_runtime_dependencies(tmp_path: Path) -> None:
    """``make demo`` on a fresh machine has ``pip install tierstore`` and nothing more: ``train``
    runs with every package only an extra installs (pytest, matplotlib, zarr, deepspeed...) made
    unimportable."""
    blocked = extras_only_modules()
    assert {"pytest", "matplotlib", "zarr", "deepspeed"} <= blocked
    arguments = ["train", "--dir", str(tmp_path / "data"), "--steps", "2", *TINY_TRAIN, "--json"]
    run = run_child(
        [sys.executable, "-c", BLOCKING_TRAIN, json.dumps(sorted(blocked)), *arguments], timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["loss_decreased"] is True


def test_one_training_step_is_not_a_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--dir", str(tmp_path / "data"), "--steps", "1", *TINY_TRAIN, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["steps"]) == 1 and report["loss_decreased"] is None


def test_train_prints_a_short_summary_and_writes_its_report_with_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``make demo`` ends with a few lines a person reads, not the report (a JSON document of over
    a hundred lines); ``--json PATH`` writes the report, ``--json`` alone prints it instead."""
    arguments = ["train", "--dir", str(tmp_path / "data"), "--steps", "2", *TINY_TRAIN]
    assert main(arguments) == 0
    summary = capsys.readouterr().out.splitlines()
    assert 3 <= len(summary) <= 6 and all(len(line) <= 120 for line in summary)
    assert summary[0].startswith("trained a GPT of ") and " for 2 steps with adamw: loss " in summary[0]
    assert summary[-1] == "the full report: tierstore train --json PATH"
    report_path = tmp_path / "report.json"
    assert main([*arguments, "--json", str(report_path)]) == 0
    summary = capsys.readouterr().out.splitlines()
    assert summary[-1] == f"the full report: {report_path}"
    report = json.loads(report_path.read_text())
    assert len(report["steps"]) == 2 and report["activation_plan"]


def test_an_unwritable_json_path_is_a_usage_error_before_the_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in (["train", "--dir", str(tmp_path / "data")], ["inspect", str(tmp_path / "c.toml")]):
        with pytest.raises(SystemExit) as exited:
            main([*command, "--json", str(tmp_path / "missing" / "report.json")])
        assert exited.value.code == 2
        assert f"argument --json: directory {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"tierstore {tierstore.__version__} (torch {torch.__version__}")


def persistent_store(tmp_path: Path) -> Path:
    """A config file naming a persistent store of two tiers (one of capacity 1 GiB) holding two
    objects on the first."""
    config = tmp_path / "store.toml"
    config.write_text(
        f'manifest = "{tmp_path / "manifest"}"\n'
        f'[[tiers]]\nname = "fast"\nbackend = "nvme://{tmp_path / "fast"}"\ncapacity = "1GiB"\n'
        f'[[tiers]]\nname = "slow"\nbackend = "nvme://{tmp_path / "slow"}"\n'
    )
    with TierStore.from_config(config) as store:
        store["layer0/w"] = torch.zeros(512, 1024, dtype=torch.bfloat16)
        store["step"] = torch.tensor([7])
    return config


def test_inspect_lists_a_persistent_stores_keys_and_tiers_read_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """While a writer has the store open: the keys with their sizes, the tiers with their paths,
    the bytes they hold and the space free; nothing in the store's directories changes."""
    config = persistent_store(tmp_path)

    def files() -> dict[Path, int]:
        return {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*") if path.is_file()}

    with TierStore.from_config(config):  # the writer, holding the manifest's lock
        before = files()
        assert main(["inspect", str(config)]) == 0
        listing = capsys.readouterr().out
        assert main(["inspect", str(config), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert files() == before
    assert f"store {tmp_path / 'manifest'} (opened read-only): 2 objects, 1.0 MiB" in listing
    assert "tier fast: 2 objects," in listing and "of its capacity of 1.0 GiB" in listing
    assert f"path fast.0: {tmp_path / 'fast'}, " in listing and " free of " in listing
    assert "tier slow: 0 objects, 0 B used, no capacity limit" in listing
    assert re.search(r"^layer0/w\s+1\.0 MiB\s+bfloat16\s+fast\s+\[512, 1024\]$", listing, re.MULTILINE)
    assert re.search(r"^step\s+8 B\s+int64\s+fast\s+\[1\]$", listing, re.MULTILINE)
    assert report["objects"] == 2 and report["bytes"] == (1 << 20) + 8
    assert report["keys"]["layer0/w"] == {
        "nbytes": 1 << 20,
        "dtype": "bfloat16",
        "shape": [512, 1024],
        "tier": "fast",
    }
    fast = report["tiers"]["fast"]
    assert fast["capacity_bytes"] == 1 << 30 and fast["objects"] == 2 and fast["bytes"] == (1 << 20) + 8
    assert 0 < fast["paths"]["fast.0"]["free_bytes"] <= fast["paths"]["fast.0"]["total_bytes"]


def test_inspect_refuses_a_scratch_config_and_a_missing_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scratch = tmp_path / "scratch.toml"
    scratch.write_text(f'[[tiers]]\nname = "a"\nbackend = "nvme://{tmp_path / "data"}"\n')
    assert main(["inspect", str(scratch)]) == 2
    assert "the config has no manifest, so its store is scratch space" in capsys.readouterr().err
    missing = tmp_path / "missing.toml"
    missing.write_text(f'manifest = "{tmp_path / "nowhere"}"\n' + scratch.read_text())
    assert main(["inspect", str(missing)]) == 2
    assert "ManifestError: manifest " in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["missing.toml", "scratch.toml"]


def test_a_failed_training_check_says_why() -> None:
    """The one exit status ``train`` chooses itself besides success (errors and Ctrl-C say theirs)."""
    steps = [{"loss": 5.5}, {"loss": 5.25}, {"loss": 5.75}]
    assert training_failure({"steps": steps, "loss_decreased": False}) == (
        "the loss did not decrease over 3 steps (5.5 to 5.75)"
    )
    assert training_failure({"steps": steps[:1], "loss_decreased": None}) is None


@pytest.mark.parametrize("command", ["train", "spill"])
def test_a_directory_that_is_a_file_is_named_as_such(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "data").write_text("mine")
    arguments = [command, "--dir", str(tmp_path / "data")]
    assert main([*arguments, *(TINY_TRAIN if command == "train" else ["--total", "4", "--object", "4"])]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'data'} is a file, not a directory" in err and "Traceback" not in err
    assert (tmp_path / "data").read_text() == "mine"


def test_spill_prints_one_json_document_and_its_summary_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["spill", "--dir", str(tmp_path / "data"), "--total", "2MiB", "--object", "1MiB"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["verified"] is True
    assert "verified=True" in captured.err


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".ini", ""])
def test_a_config_that_is_neither_toml_nor_json_is_named(
    suffix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / f"store{suffix}"
    config.write_text("tiers:\n  - name: a\n    backend: dram://\n")
    for arguments in (["spill", "--config", str(config)], ["probe", str(config)], ["bench", str(config)]):
        assert main(arguments) == 2
        err = capsys.readouterr().err
        assert "configs are TOML (.toml) or JSON (.json) files" in err and "Expecting value" not in err


@pytest.mark.parametrize(
    ("option", "path", "problem"),
    [
        ("--output", "missing/out.json", "directory {tmp}/missing does not exist"),
        ("--plot", "missing/x.png", "directory {tmp}/missing does not exist"),
        ("--output", ".", ". is a directory"),
    ],
)
def test_bench_refuses_an_output_it_cannot_write_before_the_work(
    option: str,
    path: str,
    problem: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(VIRTUAL.format(root=tmp_path / "disk"))
    with pytest.raises(SystemExit) as exited:
        main(["bench", str(config), "--size", "4MiB", "--objects", "1", option, path])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {problem.format(tmp=tmp_path)}" in err
    assert not (tmp_path / "disk").exists()  # nothing measured


def test_a_finished_bench_report_is_printed_even_if_its_file_cannot_be_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """/dev/full: a writable directory, a file whose every write fails (ENOSPC)."""
    config = tmp_path / "c.toml"
    config.write_text(VIRTUAL.format(root=tmp_path / "disk"))
    assert main(["bench", str(config), "--size", "1MiB", "--objects", "1", "--output", "/dev/full"]) == 1
    captured = capsys.readouterr()
    assert set(json.loads(captured.out)["tiers"]) == {"virtual"}
    assert "the report above was not written to /dev/full: No space left on device" in captured.err


def test_an_unwritable_probe_cache_is_a_warning_not_an_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A home that cannot take ``.cache/tierstore`` (a file in its way: as root, permissions would
    not stop the write): ``probe`` reports, and a store with ``probe = true`` opens; the
    ``tierstore`` logger warns (a program that configures no logging shows it on stderr)."""
    (tmp_path / "home").write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / "cache"))
    config = tmp_path / "c.toml"
    config.write_text(VIRTUAL.format(root=tmp_path / "disk"))
    assert main(["probe", str(config), "--size", "1MiB"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["disk"]["source"] == "measured"
    assert "Traceback" not in captured.err
    assert "bandwidth probe not cached: cannot write" in caplog.text and "Not a directory" in caplog.text
    probed = {"tiers": [{"name": "t", "backend": f"nvme://{tmp_path / 'probed'}", "probe": True}]}
    with TierStore.from_config(probed) as store:
        store["x"] = torch.ones(3)
        assert store.bandwidths()["t"]


@pytest.mark.parametrize("command", ["train", "spill"])
def test_ctrl_c_exits_130_with_one_line(command: str, tmp_path: Path) -> None:
    """SIGINT once the run is under way: the clean-up runs (the directory it made is gone), and the
    terminal gets one line, not a traceback. A shell shows status 130 either way: ``main`` returns
    it, and now and then (under load) CPython ends the process at exit by re-raising SIGINT, its
    own way of reporting an interrupt, which a shell reports as 128 + 2 too."""
    data = tmp_path / "data"
    arguments = {
        "train": ["train", "--dir", str(data), "--steps", "10000", *TINY_TRAIN],
        "spill": ["spill", "--dir", str(data), "--total", "4GiB", "--object", "1MiB", "--budget", "0"],
    }[command]
    # A test run started in the background by a non-interactive shell ignores SIGINT, and a child
    # inherits that: Ctrl-C's handler must be Python's own, as in a terminal.
    launcher = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'tierstore'; runpy.run_module('tierstore.app.cli', run_name='__main__')"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", launcher, *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (data.exists() and any(data.rglob("*"))) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # well into the work
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode in (130, -signal.SIGINT), err[-2000:]
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("tierstore")]
    assert lines == [f"tierstore {command}: interrupted"] and "Traceback" not in err
    assert out == "" and not data.exists()

import json
from pathlib import Path

import pytest

from tierstore.cli import main

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


def test_train_runs_the_offloaded_optimizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["train", "--dir", str(tmp_path / "data"), "--layers", "2", "--width", "256", "--steps", "3"]
    assert main([*arguments, "--sub-group-size", "20000", "--dram-budget", "1MiB"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state_over_budget"] > 1.5 and report["subgroups"] == 7
    assert report["loss_decreased"] and len(report["steps"]) == 3
    assert all(step["gb_per_s"]["nvme"] > 0 for step in report["steps"])
    assert list((tmp_path / "data").iterdir()) == []


def test_spill_round_trips_and_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spill", "--dir", str(tmp_path / "data"), "--total", "8MiB", "--object", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "verified=True" in out
    assert list((tmp_path / "data").iterdir()) == []  # the store removed its objects


def test_probe_reports_and_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = tmp_path / "c.toml"
    config.write_text(VIRTUAL.format(root=tmp_path / "disk"))
    assert main(["probe", str(config), "--size", "4MiB"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"fast", "disk"}
    assert 0.2 < report["fast"]["write_gb_per_s"] <= 0.41
    assert (tmp_path / "cache" / "tierstore" / "bandwidth.json").exists()


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

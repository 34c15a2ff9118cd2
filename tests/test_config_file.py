"""horovodrun --config-file: upstream's YAML keys, precedence against flags, and errors that
name the bad key."""

from __future__ import annotations

import pytest

from horovod.runner.config_file import parse_with_config, settings
from horovod.runner.launch import build_parser, env_from_args, main

FULL = """
controller: gloo
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 2.5
  cache_capacity: 512
  hierarchical_allreduce: true
  hierarchical_allgather: false
autotune:
  enabled: true
  log_file: /tmp/at.csv
  warmup_samples: 2
  steps_per_sample: 5
  bayes_opt_max_samples: 10
  gaussian_process_noise: 0.5
timeline:
  filename: /tmp/tl.json
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 30
  shutdown_time_seconds: 90
library_options:
  gloo_timeout_seconds: 45
  num_nccl_streams: 2
logging:
  level: debug
  with_timestamp: false
"""


def _parse(tmp_path, text, argv_before=(), argv_after=()):
    f = tmp_path / "hvd.yaml"
    f.write_text(text)
    argv = [*argv_before, "--config-file", str(f), *argv_after, "python", "t.py"]
    return parse_with_config(build_parser(), argv)


def test_every_upstream_key_reaches_the_workers_environment(tmp_path):
    a = _parse(tmp_path, FULL, ["-np", "2"])
    env = env_from_args(a)
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert env["HOROVOD_CYCLE_TIME"] == "2.5" and env["HOROVOD_CACHE_CAPACITY"] == "512"
    assert env["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "1"
    assert env["HOROVOD_HIERARCHICAL_ALLGATHER"] == "0"
    assert env["HOROVOD_AUTOTUNE"] == "1" and env["HOROVOD_AUTOTUNE_LOG"] == "/tmp/at.csv"
    assert env["HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"] == "0.5"
    assert env["HOROVOD_TIMELINE"] == "/tmp/tl.json" and env["HOROVOD_TIMELINE_MARK_CYCLES"] == "1"
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "1"
    assert env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "90"
    assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "45"
    assert env["HOROVOD_LOG_LEVEL"] == "DEBUG" and env["HOROVOD_LOG_HIDE_TIME"] == "1"
    assert a.np == 2 and a.command == ["python", "t.py"]


def test_flags_after_the_file_win_and_the_file_wins_over_flags_before(tmp_path):
    text = "params:\n  fusion_threshold_mb: 32\n  cycle_time_ms: 7\n"
    a = _parse(
        tmp_path,
        text,
        ["-np", "2", "--fusion-threshold-mb", "8", "--cache-capacity", "9"],
        ["--cycle-time-ms", "1"],
    )
    assert a.fusion_threshold_mb == 32  # the file over the flag before it
    assert a.cycle_time_ms == 1.0  # the flag after the file over the file
    assert a.cache_capacity == 9  # untouched by the file
    assert a.np == 2


@pytest.mark.parametrize(
    "text, why",
    [
        ("params:\n  fusion_threshold: 3\n", "unknown key params.fusion_threshold"),
        ("tuning:\n  x: 1\n", "unknown section 'tuning'"),
        ("params:\n  cycle_time_ms: fast\n", "params.cycle_time_ms: expected a number"),
        ("params:\n  cache_capacity: -1\n", "must be >= 0"),
        ("autotune:\n  enabled: yes please\n", "expected true or false"),
        ("logging:\n  level: LOUD\n", "logging.level: expected one of"),
        ("controller: nccl\n", "controller must be gloo or mpi"),
        ("params: [1, 2]\n", "must be a mapping"),
        ("params: {a: [\n", "not valid YAML"),
    ],
)
def test_bad_files_are_refused_naming_the_key(text, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace("[", r"\[")):
        settings(text)


def test_horovodrun_reports_a_bad_or_missing_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("params:\n  nope: 1\n")
    with pytest.raises(SystemExit) as e:
        main(["-np", "1", "--config-file", str(bad), "true"])
    assert e.value.code == 2 and "unknown key params.nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["-np", "1", "--config-file", str(tmp_path / "missing.yaml"), "true"])
    assert "cannot read --config-file" in capsys.readouterr().err


def test_an_empty_file_changes_nothing(tmp_path):
    a = _parse(tmp_path, "", ["-np", "3", "--cycle-time-ms", "4"])
    assert a.np == 3 and a.cycle_time_ms == 4.0

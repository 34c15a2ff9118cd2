"""Every HOROVOD_* knob is parsed in one place, with errors that name the variable."""

import dataclasses

import pytest

from horovod.common.config import Config, ConfigError, env_names, knob_table


def test_defaults_match_upstream():
    c = Config.from_env({})
    assert c.fusion_threshold == 128 * 1024 * 1024
    assert c.cycle_time_ms == 1.0
    assert c.cache_capacity == 1024
    assert c.stall_check_time_seconds == 60 and c.stall_shutdown_time_seconds == 0
    assert c.timeout_seconds == 30 and c.start_timeout == 30
    assert (
        c.autotune_warmup_samples,
        c.autotune_steps_per_sample,
        c.autotune_bayes_opt_max_samples,
        c.autotune_gaussian_process_noise,
    ) == (3, 10, 20, 0.8)
    assert (c.rank, c.size, c.local_rank, c.local_size) == (0, 1, 0, 1)
    assert c.hostname  # this host's name by default


def test_parsing():
    c = Config.from_env(
        {
            "HOROVOD_FUSION_THRESHOLD": "1048576",
            "HOROVOD_CYCLE_TIME": "2.5",
            "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
            "HOROVOD_TIMELINE_MARK_CYCLES": "true",
            "HOROVOD_LOG_LEVEL": "debug",
            "HOROVOD_CONTROLLER": "GLOO",
            "HOROVOD_RANK": "2",
            "HOROVOD_SIZE": "4",
            "HOROVOD_CACHE_CAPACITY": " ",
        }
    )
    assert c.fusion_threshold == 1 << 20 and c.cycle_time_ms == 2.5
    assert c.hierarchical_allreduce and c.timeline_mark_cycles
    assert c.log_level == "DEBUG" and c.controller == "gloo"
    assert (c.rank, c.size) == (2, 4) and c.cache_capacity == 1024


@pytest.mark.parametrize(
    "env, pattern",
    [
        ({"HOROVOD_FUSION_THRESHOLD": "lots"}, "HOROVOD_FUSION_THRESHOLD='lots' is not an integer"),
        ({"HOROVOD_CYCLE_TIME": "-1"}, "HOROVOD_CYCLE_TIME='-1' must be >= 0"),
        ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "maybe"}, "is not a boolean"),
        ({"HOROVOD_LOG_LEVEL": "loud"}, "is not one of TRACE"),
        ({"HOROVOD_RANK": "4", "HOROVOD_SIZE": "4"}, "HOROVOD_RANK=4: must be smaller"),
        ({"HOROVOD_LOCAL_RANK": "1"}, "HOROVOD_LOCAL_RANK=1: must be smaller"),
        ({"HOROVOD_SECRET_KEY": "xyz"}, "must be a hex string"),
        ({"HOROVOD_SIZE": "0"}, "HOROVOD_SIZE='0' must be >= 1"),
    ],
)
def test_bad_values_name_the_variable(env, pattern):
    with pytest.raises(ConfigError, match=pattern):
        Config.from_env(env)


def test_every_field_has_a_variable_and_help():
    names = env_names()
    assert len(names) == len(dataclasses.fields(Config))
    assert all(n.startswith("HOROVOD_") for n in names)
    assert all(help_ for _, _, help_ in knob_table())


def test_config_is_the_only_reader_of_horovod_variables():
    """Layering rule: no module but config.py reads HOROVOD_* settings from the environment.
    scheduler.py is the one exception: it runs before Config, turning a scheduler's variables
    into HOROVOD_* ones, and only looks whether the user already set those."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "horovod"
    pattern = re.compile(r"environ(\.get)?\(?\[?[\"']HOROVOD_")
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name not in ("config.py", "scheduler.py") and pattern.search(p.read_text())
    ]
    assert offenders == []


def test_documented_knobs_table_is_complete():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    missing = [n for n in env_names() if f"`{n}`" not in doc]
    assert missing == []

"""The memory limit in a training process (patches/partition/method.py, patches/to_megatron/megatron_flags.py):
where it comes from (--pp-partition-memory-limit, then $DS_PIPE_PARTITION_MEMORY_LIMIT, then the accelerator's
memory; none on CPU), partition_method='profile' planning under it (a partition that cannot fit is planned, not
refused: the training run warns and goes on), and the flag's checks. In process."""
import json
from argparse import ArgumentParser

import pytest

from patches.partition.method import MEMORY_ENVIRONMENT, memory_limit, profiled_plan
from patches.process.errors import PatchConfigError
from patches.process.registry import REGISTRY, RunSettings
from patches.to_megatron.megatron_flags import add_profiler_flags, check_profiler_flags, memory_limit_of
from tests.test_plan_partition_cli import small_report, small_report_with_memory

TYPES = ["Layer"] * 4


@pytest.fixture(autouse=True)
def no_limit(monkeypatch):
    monkeypatch.delenv(MEMORY_ENVIRONMENT, raising=False)
    REGISTRY.settings = RunSettings()
    yield
    REGISTRY.settings = RunSettings()


def test_the_flag_then_the_environment_then_the_device(monkeypatch):
    assert memory_limit() == (None, None)  # this machine's accelerator is the CPU: no limit
    monkeypatch.setenv(MEMORY_ENVIRONMENT, "1.5KiB")
    assert memory_limit() == (1536, "environment")
    REGISTRY.settings = RunSettings(partition_memory_limit=2000)
    assert memory_limit() == (2000, "flag")


def test_a_bad_environment_limit_is_one_line(monkeypatch):
    monkeypatch.setenv(MEMORY_ENVIRONMENT, "lots")
    with pytest.raises(PatchConfigError, match=r"^\$DS_PIPE_PARTITION_MEMORY_LIMIT: size 'lots' is not a size: give"):
        memory_limit()


def test_profile_partitions_plan_under_the_limit(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(small_report_with_memory()))
    assert profiled_plan(str(path), TYPES, 2)["parts"] == [0, 2, 4]  # by time, as before
    plan = profiled_plan(str(path), TYPES, 2, 2000, "environment")
    assert plan["parts"] == [0, 1, 4] and plan["predicted_peak_bytes"] == [300, 1580] and plan["memory_fits"]
    closest = profiled_plan(str(path), TYPES, 2, 1000, "flag")  # nothing fits: the closest, for a warning
    assert closest["parts"] == [0, 1, 4] and closest["memory_fits"] is False and closest["memory_excess_bytes"] == 580


def test_a_limit_asked_for_on_a_report_without_memory_terms_is_refused(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(small_report()))
    with pytest.raises(PatchConfigError, match=f"^the profile report {path}: a memory limit of 2 KB cannot be "
                                               "honoured: the profile report has no memory terms"):
        profiled_plan(str(path), TYPES, 2, 2000, "flag")
    assert profiled_plan(str(path), TYPES, 2, 2000, "device")["parts"] == [0, 2, 4]  # a default: by time


def parsed(*argv):
    parser = ArgumentParser()
    add_profiler_flags(parser)
    return parser.parse_args([str(arg) for arg in argv])


def test_the_flags_checks(tmp_path):
    assert memory_limit_of(parsed("--pp-partition-memory-limit", "70GiB")) == 70 * 1024 ** 3
    assert memory_limit_of(parsed()) is None
    with pytest.raises(PatchConfigError, match=r"^--pp-partition-memory-limit 80XB: size '80XB' is not a size"):
        check_profiler_flags(parsed("--pp-partition-memory-limit", "80XB"))
    old = tmp_path / "old.json"
    old.write_text(json.dumps(small_report()))
    check_profiler_flags(parsed("--pp-partition-from-profile", old))
    with pytest.raises(PatchConfigError, match=f"^--pp-partition-memory-limit 2KB cannot be honoured: the profile "
                                               f"report {old} has no memory terms"):
        check_profiler_flags(parsed("--pp-partition-from-profile", old, "--pp-partition-memory-limit", "2KB"))

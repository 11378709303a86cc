"""The suite's own set-up (tests/conftest.py) in an environment without pytest-xdist: the scheduling hook it gives
xdist is optional, so the tests run in one process there."""
import subprocess
import sys

from tests.helpers.launch import REPO


def test_the_tests_run_without_pytest_xdist():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                             "tests/test_parse_size.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "INTERNALERROR" not in result.stdout + result.stderr

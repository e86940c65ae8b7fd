"""Fixtures for the tests of the command-line tool `kvpolicy` (src/cli/). The binary's path comes
from $KVPOLICY_CLI: the ctest cli.compress sets it (tests/CMakeLists.txt), scripts/test.sh's
pytest stage too. Without it every test errors: a test of nothing must not pass."""

import os
import subprocess

# Idle OpenMP threads yield instead of spinning (busy 2-core machines; scripts/test.sh too).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

_CLI = os.environ.get("KVPOLICY_CLI", "")
_CLI = os.path.abspath(_CLI) if _CLI else ""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "binding: compares with the Python binding kvpolicy.Policy (the package must "
        "be installed; the ctest deselects these, scripts/test.sh's pytest stage runs them)")


@pytest.fixture(scope="session")
def cli():
    """Runs `kvpolicy <args>`; returns the CompletedProcess (text output)."""
    if not _CLI:
        pytest.fail("KVPOLICY_CLI is not set: point it at the built kvpolicy binary "
                    "(build/src/cli/kvpolicy)", pytrace=False)
    if not os.access(_CLI, os.X_OK):
        pytest.fail(f"KVPOLICY_CLI={_CLI} is not an executable file", pytrace=False)

    def run(*args, timeout=300):
        return subprocess.run([_CLI, *map(str, args)], capture_output=True, text=True,
                              timeout=timeout)

    return run


@pytest.fixture
def rng():
    return np.random.default_rng(0)

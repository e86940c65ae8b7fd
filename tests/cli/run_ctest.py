"""ctest driver of tests/cli (the ctest cli.compress, tests/CMakeLists.txt): runs pytest on this
folder with the arguments given. Exits 77, which ctest reports as Skipped (SKIP_RETURN_CODE),
when this Python lacks numpy or pytest: a test that could not run must not count as passed."""

import os
import sys

try:
    import numpy  # noqa: F401
    import pytest
except ImportError as e:
    print(f"cli.compress skipped: {e} in {sys.executable} (configure with "
          "-DKVPOLICY_TEST_PYTHON=<a python with numpy and pytest>, e.g. .venv/bin/python)")
    sys.exit(77)

here = os.path.dirname(os.path.abspath(__file__))
# No cache folder in the source tree; -rs lists skips with their reasons.
sys.exit(pytest.main([here, "-q", "-rs", "-p", "no:cacheprovider", *sys.argv[1:]]))

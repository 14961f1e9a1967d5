from pathlib import Path

import pytest
from helpers.horovod import suite_dir


@pytest.fixture
def horovod_suite() -> Path:
    """Horovod's suite directory (HORA_HOROVOD_SUITE); skips the test when it is not set up."""
    return suite_dir()

from pathlib import Path

import pytest

from tests.training._util import train_tiny


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A finished tiny run (checkpoints/step-1, final/), trained once under umask 022. Tests that
    change it work on a copy (`shutil.copytree`)."""
    return train_tiny(tmp_path_factory.mktemp("trained") / "run")

import os

import pytest

from tests.cli.assets import build_assets
from tests.cli.harness import EyasProcesses, snapshot


@pytest.fixture(scope="session")
def eyas(tmp_path_factory):
    os.environ["EYAS_CACHE"] = str(tmp_path_factory.mktemp("eyas-cache"))  # inherited by the fork server
    server = EyasProcesses(tmp_path_factory.mktemp("eyas-logs"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def assets(eyas, tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    built = build_assets(root, eyas)
    before = snapshot(root)
    yield built
    assert snapshot(root) == before, "a command changed the shared assets"

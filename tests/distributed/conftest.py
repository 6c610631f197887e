"""Fixtures of the distributed tests: the RL runs' data directory (12 additions, the even-character
reward) and a local Ray of 3 CPUs, each once per module that asks."""

from __future__ import annotations

import pytest
from helpers import write_rl_data


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    return write_rl_data(str(tmp_path_factory.mktemp("rl_data")))


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=3, include_dashboard=False)
    yield
    ray.shutdown()

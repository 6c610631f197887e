"""Fixtures of the distributed tests: the RL runs' data directory (12 additions, the even-character
reward), once per module that asks, and a local Ray of 3 CPUs, started once per test process (xdist
worker) by the first module that asks and shared by the later ones (a Ray start and stop costs about
10 s of the two cores, an idle one about 2.5% of a core); a module that needs another cluster
(test_ray_multinode.py) ends it first, and the next module that asks starts it again."""

from __future__ import annotations

import sys

import pytest
import warmstart
from helpers import write_rl_data


LOCAL_RAY_CPUS = 3


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    return write_rl_data(str(tmp_path_factory.mktemp("rl_data")))


@pytest.fixture(scope="session")
def _local_ray_session():
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _leftovers(ray) -> bool:
    """Whether an actor or a placement group of an earlier run is still alive on this Ray."""
    try:
        actors = ray._private.state.actors().values()
        groups = ray.util.placement_group_table().values()
    except Exception:  # noqa: BLE001 (cannot tell: treat as dirty)
        return True
    return any(a.get("State") != "DEAD" for a in actors) or any(g.get("state") != "REMOVED" for g in groups)


@pytest.fixture(scope="module")
def local_ray(_local_ray_session):
    ray = pytest.importorskip("ray")
    # a failed run left actors, or the Ray up is not this one (a test's run started one of its own): a fresh Ray
    if ray.is_initialized() and (_leftovers(ray) or ray.cluster_resources().get("CPU") != LOCAL_RAY_CPUS):
        ray.shutdown()
    if not ray.is_initialized():
        warmstart.wait_ready()  # its workers start from this process's environment
        ray.init(address="local", num_cpus=LOCAL_RAY_CPUS, include_dashboard=False)
    yield

"""The real-node tests' time limits: the first waits for the cluster's start, the last for its stop
(pytest-timeout counts a session fixture's setup and teardown against the test that runs them); and the
session's cluster starts only for tests that use it."""

from __future__ import annotations

import pytest

from devcluster.pytest_plugin import (
    START_BUDGET_S,
    STOP_BUDGET_S,
    pytest_collection_modifyitems,
    session_cluster_images,
)

pytest_plugins = ["pytester"]

SOURCE = """
import pytest

@pytest.mark.realnode
def test_real_a(): pass

def test_plain(): pass

@pytest.mark.realnode
@pytest.mark.timeout(900)
def test_real_b(): pass

@pytest.mark.realnode
def test_real_c(): pass
"""


def limits(items: list[pytest.Item]) -> dict[str, float]:
    out = {}
    for item in items:
        marker = item.get_closest_marker("timeout")
        out[item.name] = float(marker.args[0]) if marker is not None else float(item.config.getini("timeout") or 0)
    return out


def test_the_first_real_node_test_waits_for_the_start_and_the_last_for_the_stop(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntimeout = 600\nmarkers =\n    realnode: real nodes\n")
    items = pytester.getitems(SOURCE)
    pytest_collection_modifyitems(items[0].config, items)
    assert [i.name for i in items] == ["test_plain", "test_real_a", "test_real_b", "test_real_c"]
    assert limits(items) == {
        "test_plain": 600,
        "test_real_a": 600 + START_BUDGET_S,
        "test_real_b": 900,
        "test_real_c": 600 + STOP_BUDGET_S,
    }


def test_a_lone_real_node_test_waits_for_both(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntimeout = 600\nmarkers =\n    realnode: real nodes\n")
    items = pytester.getitems("import pytest\n@pytest.mark.realnode\n@pytest.mark.timeout(100)\ndef test_x(): pass\n")
    pytest_collection_modifyitems(items[0].config, items)
    assert limits(items) == {"test_x": 100 + START_BUDGET_S + STOP_BUDGET_S}


OWN_CLUSTER = """
import pytest

@pytest.fixture
def real_cluster(): pass

@pytest.mark.realnode(images=["operator"])
def test_on_the_session_cluster(real_cluster): pass

@pytest.mark.realnode(images=["charlm"])
def test_with_a_cluster_of_its_own(): pass
"""


def test_the_session_cluster_starts_only_for_tests_that_use_it(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmarkers =\n    realnode: real nodes\n")
    items = pytester.getitems(OWN_CLUSTER)
    assert session_cluster_images(items) == ["operator"]
    assert session_cluster_images([i for i in items if i.name == "test_with_a_cluster_of_its_own"]) is None

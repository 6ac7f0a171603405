"""The operator's startup waits until API discovery lists the SGDJob resource the way kopf reads it
(k8s.handlers.discovery_lists): kopf resolves its resources once, from the group list first."""

from __future__ import annotations

from sgdjob_operator.api.models import GROUP, PLURAL, VERSION
from sgdjob_operator.k8s.handlers import discovery_lists

RESOURCES = {"resources": [{"name": PLURAL}, {"name": f"{PLURAL}/status"}]}


def _groups(*names: str, version: str = VERSION) -> dict[str, object]:
    return {"groups": [{"name": n, "versions": [{"version": version}]} for n in names]}


def test_the_resource_counts_as_listed_only_once_the_group_list_names_it_too() -> None:
    assert discovery_lists(_groups("apps", GROUP), RESOURCES)
    # A restarted API server answered /apis/GROUP/VERSION before its /apis listed the group again
    # (clean CI, chaos case d): kopf, starting then, would never serve an SGDJob.
    assert not discovery_lists(_groups("apps"), RESOURCES)
    assert not discovery_lists(_groups(GROUP, version="v9"), RESOURCES)
    assert not discovery_lists(_groups(GROUP), {"resources": [{"name": "other"}]})
    assert not discovery_lists(None, RESOURCES) and not discovery_lists(_groups(GROUP), None)


def test_kopfs_warning_that_it_serves_no_sgdjob_stops_it_so_the_operator_starts_again() -> None:
    import logging

    from sgdjob_operator.cli.operator import UnresolvedWatch, names_our_resource

    said = (
        "Unresolved resources cannot be served (try creating their CRDs): "
        f"Selector(group='{GROUP}', version='{VERSION}', any_name='{PLURAL}')"
    )
    assert names_our_resource(said)
    assert not names_our_resource(
        "Unresolved resources cannot be served (try creating their CRDs): Selector(any_name='pods')"
    )
    stops: list[bool] = []
    watch = UnresolvedWatch(stop=lambda: stops.append(True))
    kopf_logger = logging.getLogger("kopf._core.reactor.observation")  # where kopf says it
    logging.getLogger("kopf").addHandler(watch)
    try:
        kopf_logger.warning("Unresolved resources cannot be served (try creating their CRDs): %s", "x")
        assert not watch.seen, "before kopf runs, and for other resources, nothing stops"
        watch.armed = True
        kopf_logger.warning(said)
        kopf_logger.warning(said)
        assert watch.seen and stops == [True], "kopf is stopped once"
    finally:
        logging.getLogger("kopf").removeHandler(watch)

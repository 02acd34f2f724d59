"""The e2e fixtures (real `upr serve` nodes on free loopback ports) for the scrape tests."""

from tests.e2e.conftest import _reap_background, node, node_factory, spawned

__all__ = ["_reap_background", "node", "node_factory", "spawned"]

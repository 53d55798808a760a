"""Where a ``RayExecutor``'s ranks run: a placement group of one bundle per rank (or per host, with ``num_hosts``),
or the current one (a Ray Tune trial's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class Placement:
    """The bundles of ``num_workers`` ranks: ``cpus`` (and ``gpus``) each, spread by ``strategy``; or ``num_hosts``
    nodes of ``per_host`` ranks each (STRICT_SPREAD); or the current placement group where ``use_current``."""

    num_workers: int
    num_hosts: int | None
    per_host: int
    cpus: float
    gpus: float
    use_current: bool
    strategy: str
    timeout_s: float
    group: Any = None
    """The placement group, once reserved."""
    owned: bool = False
    """Whether this placement made the group (and removes it)."""

    def reserve(self, ray: Any) -> list[int]:
        """Reserve the bundles (a new placement group, or the current one) and return each rank's bundle index.

        Raises:
            RuntimeError: Ray could not reserve them within ``timeout_s`` (nothing stays reserved).
        """
        from ray.util.placement_group import get_current_placement_group, placement_group

        worker_bundle = {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}
        current = get_current_placement_group() if self.use_current else None
        if current is not None:
            self.group, self.owned = current, False
            return [index % len(current.bundle_specs) for index in range(self.num_workers)]
        if self.num_hosts:  # one bundle per host holding its workers, each host a different node
            per_host = {name: amount * self.per_host for name, amount in worker_bundle.items()}
            bundles, strategy = [per_host] * self.num_hosts, "STRICT_SPREAD"
            indices = [index // self.per_host for index in range(self.num_workers)]
        else:
            bundles, strategy = [worker_bundle] * self.num_workers, self.strategy
            indices = list(range(self.num_workers))
        self.group, self.owned = placement_group(bundles, strategy=strategy), True
        try:
            ray.get(self.group.ready(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.release()
            raise RuntimeError(
                f"RayExecutor: Ray could not reserve {len(bundles)} x {bundles[0]} ({strategy}) within "
                f"{self.timeout_s:.0f} s; the cluster has {ray.available_resources()} free"
            ) from None
        return indices

    def nodes(self, ray: Any, bundles: list[int]) -> list[str]:
        """The address of the node that holds each of ``bundles``."""
        from ray.util.placement_group import placement_group_table

        node_of_bundle = placement_group_table(self.group)["bundles_to_node_id"]
        address_of_node = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        return [address_of_node[node_of_bundle[bundle]] for bundle in bundles]

    def release(self) -> None:
        """Remove the placement group where this placement made it."""
        if self.group is not None and self.owned:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        self.group = None

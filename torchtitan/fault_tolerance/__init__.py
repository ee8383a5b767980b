"""Replica fault tolerance with torchft (docs/fault_tolerance.md): each replica group is its
own torchrun job; a torchft Manager averages the groups' gradients, drops a dead group from the
quorum, and feeds a restarted group a healthy peer's state live."""

from torchtitan.fault_tolerance.replica import ReplicaGroup, ReplicasLost, data_shard

__all__ = ["ReplicaGroup", "ReplicasLost", "data_shard"]

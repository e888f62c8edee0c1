"""Tensor-parallel groups: this rank's place in the group and the collectives the layers use."""

from pagedrs.distributed.group import TPGroup, connect_tp_group, create_store, free_port

__all__ = ["TPGroup", "connect_tp_group", "create_store", "free_port"]

"""Suite-wide fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """An in-process engine sets torch's thread count for its rank (a tensor-parallel rank 0 on a CPU takes
    its share of the cores); each test starts with the count the suite started with, so a float32 comparison
    does not depend on which test ran before it."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)

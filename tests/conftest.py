"""Suite-wide fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

# torch's thread count when the suite started (the machine's cores, or OMP_NUM_THREADS)
_SUITE_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _suite_torch_threads() -> Iterator[None]:
    """An in-process engine sets torch's thread count for its rank (a tensor-parallel rank 0 on a CPU takes
    its share of the cores), also from a module-scoped fixture; each test starts and ends with the count the
    suite started with, so a float32 comparison does not depend on which test or fixture ran before it."""
    if torch.get_num_threads() != _SUITE_THREADS:
        torch.set_num_threads(_SUITE_THREADS)
    yield
    if torch.get_num_threads() != _SUITE_THREADS:
        torch.set_num_threads(_SUITE_THREADS)

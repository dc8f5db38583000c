import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The method tests run tiny models: one intra-op thread is fastest, and it stays fast when another
    process holds a core (two OpenMP threads on one free core slow these steps ~100x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # `datasets` reads both at import; tests never download
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

REQUIRED = ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe"]
GENERIC = "tiny-glm4-moe"  # glm4_moe: no spec file, converts through the generic spec


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    yield


@pytest.fixture
def one_thread():
    """Tiny models: one intra-op thread is fastest, and it stays fast when another process holds a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

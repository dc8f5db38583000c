import os
from pathlib import Path

# Torch threads of each test process and, through OMP_NUM_THREADS, of every process it starts (the CLI, bench and
# study workers, torchrun ranks): the cores shared among the xdist workers (pyproject's addopts), at most 2. More
# threads than cores would make every worker's CPU ops spin against each other's.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
os.environ["OMP_NUM_THREADS"] = str(THREADS)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # `datasets` reads both at import; tests never download
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

REQUIRED = ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe"]
GENERIC = "tiny-glm4-moe"  # glm4_moe: no spec file, converts through the generic spec


# Files whose module fixtures are costly (a study, a bench, a calibration, a trained run): each runs on one xdist
# worker (`--dist loadgroup`), so its fixtures are built once; every other test goes to whichever worker is free.
# The real tier's file is one too: its dense reference eval is shared, and one worker builds the SmolLM2 caches.
# Named by path: a file of the same name elsewhere (methods/test_resume.py) is not held to the same worker.
ONE_WORKER = {"methods/test_architectures.py", "models/test_base.py", "reports/test_bench.py",
              "conversion/test_calibrate.py", "scripts/test_corpus.py", "models/test_hf_remote.py",
              "methods/test_hift.py", "training/test_resume.py", "models/test_smollm2.py", "reports/test_study.py",
              "training/test_watch.py"}
TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into each test's group
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path.is_relative_to(TESTS) and path.relative_to(TESTS).as_posix() in ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group(path.stem))


def needs_model_types(*names: str):
    """Skip where this transformers lacks a model type (types newer than 5.17, the supported minimum)."""
    import transformers
    from transformers import CONFIG_MAPPING

    missing = [n for n in names if n not in CONFIG_MAPPING]
    return pytest.mark.skipif(bool(missing), reason=f"transformers {transformers.__version__} has no {missing}")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
    yield


@pytest.fixture
def one_thread():
    """Tiny models: one intra-op thread is fastest, and it stays fast when another process holds a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

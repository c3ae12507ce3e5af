import os

import pytest
import torch

collect_ignore = ["workers"]  # worker scripts run under `accelfn launch`, not pytest

# torch.compile's on-disk caches are shared by every process of the machine by default; a suite that shared
# them with other processes compiling at the same time failed with torch's functorch config missing a key
# (issue: the suite was not green on a fresh clone). This run's compiles (and its workers': they inherit the
# environment) use a cache of their own.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="accelfn-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A Lightning fit in the test process (e.g. FSDP on one GPU) initializes torch.distributed and
    leaves the group, and its port, behind: the next test that starts a group would then fail
    ("initialize the default process group twice", EADDRINUSE), as seen on the GPU machine."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture
def one_thread():
    """One intra-op thread: on the shared 2-core CI machine two threads contend and stretch
    training steps by up to 10x (timings are recorded, never asserted)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

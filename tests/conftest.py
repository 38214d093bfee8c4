import os

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
    """A Lightning fit in the test process (DDP or FSDP on one device) initializes torch.distributed
    and leaves the group, its port and its environment (MASTER_PORT, WORLD_SIZE, ...) behind: the
    next test that starts a group would fail ("initialize the default process group twice",
    EADDRINUSE, as seen on the GPU machine), and a multi-process script it starts would inherit a
    one-process rendezvous and wait forever."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture
def one_thread():
    """One intra-op thread: on the shared 2-core CI machine two threads contend and stretch
    training steps by up to 10x (timings are recorded, never asserted)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

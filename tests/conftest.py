"""Fixtures for every test file: each test starts from torch's process-wide defaults."""
import pytest
import torch


@pytest.fixture(autouse=True)
def torch_defaults():
    """A Trainer leaves deterministic=true's process-wide switches as its config set them
    (trainer/setup.py's use_device); the next test starts without them."""
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False

import os

import pytest
import torch

from hf_tiny import FAMILIES, make_tiny

DEFAULT_TEXT_KEY = "assignment"  # a pydoc_data.topics entry with plenty of natural text

if os.environ.get("PYTEST_XDIST_WORKER"):  # workers side by side (`-n auto`): one thread each, their children too
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's command): one worker per core, at most 4 (each loads the model, ~1.3 GB)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, 4)


@pytest.fixture(scope="session")
def default_model_dir():
    """The real SmolLM2-135M-Instruct folder, prepared (downloaded + converted) on first use, by one
    worker while the others wait on a lock."""
    import fcntl

    from kvmini.weights import DEFAULT_MODEL_DIR, ensure_default_model

    DEFAULT_MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
    with open(DEFAULT_MODEL_DIR.parent / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_default_model()


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    from kvmini.loading import load_model

    return load_model(default_model_dir, "cpu", "float32")


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from kvmini.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def real_text():
    import pydoc_data.topics

    return "\n".join(pydoc_data.topics.topics.values())


@pytest.fixture(scope="session", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    """(family, folder, HF model) for a tiny random checkpoint of each supported family."""
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_tiny(request.param, folder)


@pytest.fixture
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_tiny("llama", folder)
    return folder


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

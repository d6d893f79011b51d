import pytest
import torch

from hf_tiny import FAMILIES, make_tiny

DEFAULT_TEXT_KEY = "assignment"  # a pydoc_data.topics entry with plenty of natural text


@pytest.fixture(scope="session")
def default_model_dir():
    """The real SmolLM2-135M-Instruct folder, prepared (downloaded + converted) on first use."""
    from kvmini.weights import ensure_default_model

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

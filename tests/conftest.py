import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One Inductor cache for the whole suite (and across runs): cold compiles cost seconds per graph.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(ROOT, ".graphrt-cache", "inductor"))
os.environ.setdefault("GRAPHRT_CACHE_DIR", os.path.join(ROOT, ".graphrt-cache", "user"))


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_model(tiny_root):
    """tiny_model(name) → path of a saved tiny random transformers checkpoint."""
    from tests.tiny_models import save_tiny

    return lambda name: save_tiny(name, tiny_root)


@pytest.fixture(scope="session")
def tiny_tok_model(tiny_root):
    """A tiny random Llama over SmolLM2's vocabulary, with the real tokenizer files."""
    from tests.tiny_models import save_tiny_with_smollm2_tokenizer

    return save_tiny_with_smollm2_tokenizer(tiny_root)

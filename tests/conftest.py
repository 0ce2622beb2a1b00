import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One Inductor cache for the whole suite (and across runs): cold compiles cost seconds per graph.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(ROOT, ".graphrt-cache", "inductor"))
os.environ.setdefault("GRAPHRT_CACHE_DIR", os.path.join(ROOT, ".graphrt-cache", "user"))


def _threads_per_worker() -> int | None:
    """Under pytest-xdist, each worker's share of the cores (None: one process, torch's default)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None


# Workers that each run torch's default thread count (one a core) oversubscribe the cores: the
# spinning OpenMP threads of one take the other's core. A test of many small ops ran 3.4x slower
# beside one busy core with two threads, 1.7x with one. So each worker runs its share of the
# cores, and the processes its tests start inherit it; tests/kernels/test_two_threads.py runs the
# ops whose work is split by the thread count on two threads all the same.
_THREADS = _threads_per_worker()
if _THREADS is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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

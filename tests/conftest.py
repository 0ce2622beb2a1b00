import os

# One Inductor cache for the whole suite (and across runs): cold compiles cost seconds per graph.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".graphrt-cache", "inductor"),
)

"""Stand-in for ``ray`` when EasyDeL's eSurge runs as a benchmark peer (benchmarks/esurge_smoke.py):
easydel 0.3.0's ``__init__`` imports ``ray.is_initialized`` and never calls it; nothing else is
reachable."""

__version__ = "0.0.0-stub"


def is_initialized() -> bool:
    return False


def __getattr__(name: str):
    raise ImportError(f"ray.{name}: ray is not installed (benchmarks/esurge_stubs stands in for its import only)")

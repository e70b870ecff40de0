"""The opt-in warning of experimental entry points."""
import warnings

import torch


class ExperimentalWarning(UserWarning):
    """Emitted once per process by the first call of an experimental cake_ops entry point."""


_warned: set = set()


def warn_experimental(feature: str) -> None:
    """Warn once per process that `feature` is experimental (never while tracing a graph)."""
    if torch.compiler.is_compiling() or feature in _warned:
        return
    _warned.add(feature)
    warnings.warn(
        f"{feature} is experimental: its API and numerics may change between releases",
        ExperimentalWarning,
        stacklevel=3,
    )

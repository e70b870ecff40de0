"""Tactic autotuning: measure every kernel configuration once per shape bucket, keep the fastest.

    with cake_ops.autotune(cache_file="tuning.json"):
        model(x)            # first calls on new shapes profile every tactic
    model(x)                # later calls (also compiled graphs and CUDA graphs) use the winners

A bucket is (op family, E, N, K, sum_m rounded up to a power of two, epilogue): the MoE GEMMs'
fused epilogues (GEMM1's SwiGLU, GEMM2's finalize scatter) are timed as they run and tuned apart
from the plain GEMM of the same sizes, since the epilogue changes which tile wins. Inside the
context the first call of a tunable op on a new bucket times each tactic (CUDA events, median of
a few runs; this synchronises, so tune before capturing graphs) and records the winner in the
extension; calls outside the context use the recorded winners, else the heuristic. Nothing is
tuned while torch.compile traces or a CUDA graph is being captured. ``cache_file`` is read when
the context opens and written when it closes, so a later process can start tuned
(:func:`load_tuning`).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import warnings
from typing import Callable, Optional

import torch

from . import _C

_enabled = False
_tuned: dict = {}  # "family|E|rows|N|K" (plain GEMM) or "family|E|rows|N|K|epilogue" -> tactic name


def _bucket_rows(sum_m: int) -> int:
    rows = 1
    while rows < sum_m:
        rows *= 2
    return rows


def _key(family: str, num_groups: int, sum_m: int, n: int, k: int, epilogue: str = "none") -> str:
    key = f"{family}|{num_groups}|{_bucket_rows(sum_m)}|{n}|{k}"
    return key if epilogue == "none" else f"{key}|{epilogue}"


def _has_tactics() -> bool:
    return hasattr(_C, "grouped_gemm_tactics")


def _record(key: str, name: str) -> bool:
    fields = key.split("|")
    if len(fields) not in (5, 6):
        return False  # not a key this version writes
    family, num_groups, rows, n, k = fields[:5]
    epilogue = fields[5] if len(fields) == 6 else "none"
    names = _C.grouped_gemm_tactics(family)
    if name not in names:
        return False  # a configuration this build no longer has
    try:
        _C.set_grouped_gemm_tuned_tactic(family, int(num_groups), int(rows), int(n), int(k), names.index(name),
                                         epilogue)
    except ValueError:
        return False  # an epilogue this build does not know
    _tuned[key] = name
    return True


def _time_tactics(family: str, candidates: dict, run: Callable[[], object], reps: int = 5,
                  warmup: int = 2) -> dict:
    """Median ms of ``run`` under each tactic ({name: index}), measured in rotation (rep 1 of
    every tactic, then rep 2, ...) so that clock drift during tuning favours none of them."""
    def under(i):
        _C.set_grouped_gemm_tactic(family, i)
        run()

    times = {name: [] for name in candidates}
    try:
        for i in candidates.values():
            for _ in range(warmup):
                under(i)
        for _ in range(reps):
            for name, i in candidates.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                under(i)
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
    finally:
        _C.set_grouped_gemm_tactic(family, -1)
    return {name: statistics.median(t) for name, t in times.items()}


def candidate_tactics(family: str, num_groups: int, sum_m: int) -> dict:
    """{name: index} of the tactics worth timing for such a problem: all but the swap-AB ones
    where groups are large (they serve a few rows per group and are several times slower there)."""
    rows_per_group = sum_m // max(num_groups, 1)
    return {name: i for i, name in enumerate(_C.grouped_gemm_tactics(family))
            if "swapab" not in name or rows_per_group <= 128}


def tuning_active() -> bool:
    """True inside :func:`autotune` (never while torch.compile traces)."""
    return not torch.compiler.is_compiling() and _enabled


def tune_grouped_gemm(family: str, dims: Callable[[], tuple], run: Callable[[], object],
                      device: torch.device, epilogue: str = "none") -> Optional[str]:
    """Profile ``run`` under every tactic of ``family`` for a new bucket; dims() = (E, sum_m, N, K);
    ``epilogue``: the twin ``run`` launches ("none", "swiglu" or "scatter"), tuned as its own bucket."""
    if not tuning_active() or device.type != "cuda" or not _has_tactics():
        return None
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return None  # no profiling inside a fake-tensor trace
    # The ops launch on their operands' device: its current stream is the one to check and to time
    # (the current device may be another GPU).
    with torch.cuda.device(device):
        if torch.cuda.is_current_stream_capturing():
            return None  # no profiling inside a graph capture
        try:
            num_groups, sum_m, n, k = dims()
            key = _key(family, num_groups, sum_m, n, k, epilogue)
        except (IndexError, TypeError, ValueError):
            return None  # malformed arguments: the op itself raises the clear error
        if key in _tuned:
            return _tuned[key]
        times = _time_tactics(family, candidate_tactics(family, num_groups, sum_m), run)
    best = min(times, key=times.get)
    _record(key, best)
    return best


def _device_name() -> Optional[str]:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def load_tuning(path: str) -> int:
    """Load tuned choices written by :func:`autotune`; returns how many this build could use. A file
    tuned on another kind of GPU is skipped with a warning: the winners differ between cards (an
    H100's and an H200's tiles do, benchmarks/NOTES.md session 50)."""
    with open(path) as f:
        try:
            tuning = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"cake_ops.load_tuning: {path} is not JSON ({e})") from None
    entries = tuning.get("grouped_gemm", {}) if isinstance(tuning, dict) else None
    if not isinstance(entries, dict):
        raise ValueError(f"cake_ops.load_tuning: {path} is not a tuning file written by cake_ops.save_tuning / "
                         "autotune(cache_file=...): expected an object with a \"grouped_gemm\" object")
    tuned_on, here = tuning.get("device"), _device_name()
    if tuned_on is not None and here is not None and tuned_on != here:
        warnings.warn(f"cake_ops.load_tuning: {path} was tuned on {tuned_on}, this is {here}: not loaded "
                      "(tune again under cake_ops.autotune())", stacklevel=2)
        return 0
    return sum(_record(key, name) for key, name in entries.items()) if _has_tactics() else 0


def save_tuning(path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": 1, "device": _device_name(), "grouped_gemm": dict(sorted(_tuned.items()))}, f,
                  indent=1)
    os.replace(tmp, path)


def clear_tuning() -> None:
    """Forget every tuned choice (the heuristic decides again)."""
    _tuned.clear()
    if _has_tactics():
        _C.clear_grouped_gemm_tuned_tactics()


@contextlib.contextmanager
def autotune(enabled: bool = True, cache_file: Optional[str] = None):
    """Profile tactics for new shape buckets while the context is open (see the module doc)."""
    global _enabled
    folder = os.path.dirname(os.path.abspath(cache_file)) if cache_file else None
    if folder is not None and enabled and not os.path.isdir(folder):
        # Said before the tuning runs, not when the context closes and its results cannot be saved.
        raise FileNotFoundError(f"cake_ops.autotune: cache_file {cache_file!r} is in no existing folder ({folder})")
    if cache_file and os.path.exists(cache_file):
        load_tuning(cache_file)
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous
        if cache_file and enabled:
            save_tuning(cache_file)

"""Timing shared by the peer scripts: the median of repeated calls after a warm-up, as the
braid bench card times its own workloads."""
import time


def median(f, warm=2, runs=9):
    """Median seconds of `runs` calls of `f` after `warm` warm-up calls."""
    for _ in range(warm):
        f()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]

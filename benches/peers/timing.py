"""Timing shared by the peer scripts: the median of repeated calls after a warm-up, as the
braid bench card times its own workloads; PyTorch imported or a clear exit."""
import argparse
import sys
import time


def torch_or_exit():
    """The `torch` module, or exit 1 with a message on stderr when PyTorch is missing."""
    try:
        import torch
    except ImportError:
        sys.stderr.write("torch is not installed (pip install torch)\n")
        sys.exit(1)
    return torch


def synchronizer(torch, dev):
    """A function that waits for `dev`'s queued work (nothing to wait for on the CPU)."""
    if dev.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def torch_on_device():
    """The common start of a peer script taking `--device` (default cpu) and `--threads` (0:
    PyTorch's default): returns `torch`, the device and its synchronizer, the seed set to 1."""
    torch = torch_or_exit()
    args = argparse.ArgumentParser()
    args.add_argument("--device", default="cpu")
    args.add_argument("--threads", type=int, default=0)
    opts = args.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    dev = torch.device(opts.device)
    torch.manual_seed(1)
    return torch, dev, synchronizer(torch, dev)


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

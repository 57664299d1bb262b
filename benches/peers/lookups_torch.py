"""PyTorch peer of braid's benches/lookups.rs: `F.embedding` of 2,048 ids from tables of 1,000 and
32,000 rows of 256 f32 features, and the table's gradient for a gradient of ones on the rows
(the backward of the lookup, as braid's bench records it: forward, the product with ones, the
sum, backward), with the ids braid's bench uses.

The backward row times the backward pass alone, as braid's does: braid records the forward
(lookup, product, sum) but holds only the gradient, so it computes only the backward (the sum's
ones, their product with the ones on the rows, the scatter-add into the table). Here the
forward runs once, outside the timed region, and each timed run is `backward(retain_graph=True)`
over it: the same three steps. (Timing forward and backward here, as this script did, made the
peer compute a lookup, a product and a sum that braid's row never runs.)

Usage: python3 lookups_torch.py --device cuda|cpu
Prints one line per case: name, vocabulary, median milliseconds (21 runs after 3 warm-ups, each
synchronised). Exits 1 with a message on stderr when PyTorch is missing.
"""
import argparse

from timing import median, synchronizer, torch_or_exit

torch = torch_or_exit()
import torch.nn.functional as F  # noqa: E402 (after the check that torch is there)

args = argparse.ArgumentParser()
args.add_argument("--device", default="cuda")
opts = args.parse_args()
dev = torch.device(opts.device)
IDS, FEATURES = 2048, 256
sync = synchronizer(torch, dev)


for vocabulary in (1000, 32000):
    table = (torch.arange(vocabulary * FEATURES, device=dev) % 97).float().mul(0.25).sub(12.0)
    table = table.reshape(vocabulary, FEATURES)
    ids = torch.tensor([(i * 7919 + 13) % vocabulary for i in range(IDS)], device=dev)
    ones = torch.ones(IDS, FEATURES, device=dev)
    trained = table.clone().requires_grad_(True)

    def forward():
        F.embedding(ids, table)
        sync()

    total = (F.embedding(ids, trained) * ones).sum()

    def backward():
        total.backward(retain_graph=True)
        trained.grad = None
        sync()

    print(f"torch embedding {vocabulary} {median(forward, 3, 21) * 1e3:.4f} ms")
    print(f"torch embedding_backward {vocabulary} {median(backward, 3, 21) * 1e3:.4f} ms")

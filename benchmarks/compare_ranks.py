"""Whether every rank's rank*.pt in a folder (written by benchmarks/trainer_engines.py) holds the same indices and
values (prints one line): BENCHMARKS.md, "Two and four GPUs", ranks identical under each accelerate config."""

import sys
from pathlib import Path

import torch

files = sorted(Path(sys.argv[1]).glob("rank*.pt"))
runs = [torch.load(f) for f in files]
same_i = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0]["indices"], r["indices"]))
same_v = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0]["values"], r["values"]))
nonzero = sum(int((v != 0).sum()) for v in runs[0]["values"])
print(f"{sys.argv[1]}: {len(runs)} ranks; indices identical {same_i}; values identical {same_v}; non-zero values {nonzero}")

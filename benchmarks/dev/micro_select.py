"""Micro-timings (GPU) of exact top-k-set selections over a weight-sized |gradient|: the AG window's
candidate choice. Every method is checked against the library's ``top_k_set`` first.

On the H200 (2026-11-26, 11.5M elements, k=603,000): ``torch.topk`` alone 0.29 ms, ``top_k_set``
(topk threshold + lowest-index ties) 0.65 ms, two 16-bit histogram passes 10.6 ms (atomics on a few
hot bins), a sampled threshold + exact selection on the superset 0.83 ms — so ``top_k_set`` stays.
"""
import torch
import triton.testing as tt

from peft_sparse.core.selection import top_k_set


def radix_kth(flat, k):
    """k-th largest of a non-negative float32 vector by two 16-bit histogram passes (no host sync)."""
    bits = flat.view(torch.int32)
    hi = bits >> 16
    hist = torch.bincount(hi, minlength=1 << 15)
    from_top = hist.flip(0).cumsum(0)
    pos = torch.searchsorted(from_top, torch.tensor([k], device=flat.device))  # first ≥ k
    bucket = (1 << 15) - 1 - pos
    above = from_top[pos] - hist[bucket]
    low = torch.where(hi == bucket, bits & 0xFFFF, 1 << 16)
    hist2 = torch.bincount(low, minlength=(1 << 16) + 1)[: 1 << 16]
    from_top2 = hist2.flip(0).cumsum(0)
    pos2 = torch.searchsorted(from_top2, (k - above))
    value_bits = (bucket << 16) | ((1 << 16) - 1 - pos2)
    return value_bits.to(torch.int32).view(torch.float32)


def top_k_set_radix(flat, k):
    kth = radix_kth(flat, k).reshape(())
    above = flat > kth
    tied = flat == kth
    need = k - above.sum()
    chosen = above | (tied & (torch.cumsum(tied, 0, dtype=torch.int32) <= need))
    return torch.nonzero_static(chosen, size=k).squeeze(1)


def top_k_set_sampled(flat, k, stride=64):
    sample = flat[::stride]
    r = max(1, int(k / stride * 0.97))
    tau = torch.topk(sample, r, sorted=False).values.min()
    sup = torch.nonzero(flat >= tau).squeeze(1)  # host sync
    if sup.numel() < k:
        return top_k_set(flat, k)
    vals = flat[sup]
    return sup[top_k_set(vals, k)]


for n, k in [(2048 * 5632, 603_000), (2048 * 2048, 219_000), (256 * 2048, 27_000)]:
    x = torch.randn(n, device="cuda").abs() * 1e-3
    want = top_k_set(x, k)
    for label, fn in [("topk f32 unsorted (values only)", lambda: torch.topk(x, k, sorted=False)),
                      ("top_k_set (current)", lambda: top_k_set(x, k)),
                      ("radix 2x16-bit histogram", lambda: top_k_set_radix(x, k)),
                      ("sampled threshold + superset", lambda: top_k_set_sampled(x, k)),
                      ("sort f32 (reference)", lambda: torch.sort(x))]:
        if "top_k_set" in label or "radix" in label or "sampled" in label:
            got = fn()
            assert torch.equal(got.sort().values, want.sort().values), label
        print(f"n={n:>9} k={k:>7}  {label:34s} {tt.do_bench(fn):8.3f} ms", flush=True)

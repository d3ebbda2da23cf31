"""SpIEL-AG against a slow, obviously-right reference written from Algorithm 2 on dense masks.

The reference keeps, per targeted weight W, a boolean mask M and a dense delta D (zero off the mask),
trains D·M with a dense Adam whose state lives only on the mask, and at every reselection drops the
k smallest |φ| and grows the k largest |Σ g| among the window's candidates (chosen on the window's
first batch as the top-K |∂L/∂W|), with the seeded moments of §7.3.1. Ours must pick the same indices
at every reselection, and end with the same values.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from peft import get_peft_model

from peft_sparse import SpIELConfig, SpIELScheduler
from peft_sparse.schedules.reselection import in_estimation_window, is_reselection_step, replacement_count

from .models import sparse_layers, tiny_llama

S, GAMMA, T, LR, BETAS, EPS = 6, 2, 20, 3e-2, (0.9, 0.999), 1e-8


def _batch(step):
    return torch.randint(0, 97, (4, 10), generator=torch.Generator().manual_seed(step))


def _loss(model, x):
    logits = model(x).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def _topk(scores, k):  # flat positions of the k largest scores, ties → lowest position
    return torch.sort(scores.reshape(-1), descending=True, stable=True).indices[:k]


def reference_spiel_ag(model, masks, steps, config, log):
    """Algorithm 2 over dense masks (``masks``: weight → bool mask); appends each reselection's masks to ``log``."""
    weights = list(masks)
    delta = {w: torch.zeros_like(w) for w in weights}
    m1 = {w: torch.zeros_like(w) for w in weights}
    m2 = {w: torch.zeros_like(w) for w in weights}
    window = {}
    start = {w: torch.zeros_like(w) for w in weights}  # φ₀ (Algorithm 2, lines 3 and 14)
    for t in range(1, steps + 1):
        for w in weights:  # θ' = scatter-add(φ, η, θ)
            w.requires_grad_(True)
            w.data += delta[w]
        _loss(model, _batch(t)).backward()
        for w in weights:
            w.data -= delta[w]
            g = w.grad.clone()
            w.grad = None
            w.requires_grad_(False)
            if in_estimation_window(t, S, GAMMA, steps):
                if w not in window:  # candidates: top-K |∂L/∂W| of the window's first batch, K = ⌈ratio·d_φ⌉
                    K = math.ceil(config.candidate_ratio * int(masks[w].sum()))
                    # (score_normalization='column': each column's scores divided by its RMS gradient)
                    scale = g.pow(2).mean(0).sqrt().clamp_min(torch.finfo(g.dtype).tiny) if config.score_normalization == "column" else torch.ones(g.shape[1], dtype=g.dtype)
                    window[w] = [_topk(g.abs() / scale, K), torch.zeros(K, dtype=g.dtype), torch.zeros(K, dtype=g.dtype), scale]
                cand, s1, s2, _ = window[w]
                s1 += g.reshape(-1)[cand]
                s2 += g.reshape(-1)[cand] ** 2
            # UPDATE(φ, ∇φ): Adam on the masked entries
            g = g * masks[w]
            m1[w].mul_(BETAS[0]).add_((1 - BETAS[0]) * g)
            m2[w].mul_(BETAS[1]).add_((1 - BETAS[1]) * g * g)
            step = m1[w] / (1 - BETAS[0] ** t) / ((m2[w] / (1 - BETAS[1] ** t)).sqrt() + EPS)
            delta[w] -= LR * step * masks[w]
        if not is_reselection_step(t, S, GAMMA, steps):
            continue
        for w in weights:
            mask, flat_delta = masks[w].reshape(-1), delta[w].reshape(-1)
            active = torch.nonzero(mask).squeeze(1)
            k = replacement_count(t, steps, active.numel(), config.initial_reselection_rate, config.schedule, GAMMA)
            ranked = flat_delta if config.drop_criterion == "magnitude" else flat_delta - start[w].reshape(-1)
            dropped = active[_topk(-ranked[active].abs(), k)]  # DROP: k smallest |φ| (or |φ − φ₀|, line 10)
            mask[dropped] = False
            cand, s1, s2, scale = window.pop(w)
            eligible = ~mask[cand]
            score = s1.abs() / scale[cand % scale.numel()]
            grown_at = _topk(torch.where(eligible, score, -1.0), k)  # GROW: k largest |Σg| (normalized) not kept
            grown = cand[grown_at]
            flat_delta[dropped] = 0.0
            flat_delta[grown] = 0.0
            mask[grown] = True
            # seeded moments: Adam's bias correction at the next step recovers the window's mean squared gradient
            # (the second moment only; the first moment of grown weights starts at 0)
            seeded = (False, True)
            for moment, stat, beta, seed in ((m1[w], s1, BETAS[0], seeded[0]), (m2[w], s2, BETAS[1], seeded[1])):
                flat = moment.reshape(-1)
                flat[dropped] = 0.0
                flat[grown] = stat[grown_at] / GAMMA * (1 - beta**t) if seed else 0.0
            start[w] = delta[w].clone()  # φ₀ ← φ (line 14)
        log.append({w: masks[w].clone() for w in weights})
    return delta


@pytest.mark.parametrize("score_normalization", ["none", "column"])
@pytest.mark.parametrize("drop_criterion", ["magnitude", "change"])
@pytest.mark.parametrize("candidate_ratio", [1.0, 2.0])
def test_spiel_ag_chooses_the_indices_of_algorithm_2_step_for_step(candidate_ratio, drop_criterion, score_normalization):
    config = SpIELConfig(
        target_modules="all-linear", density=0.1, reselection_steps=S, gradient_estimation_steps=GAMMA,
        initial_reselection_rate=0.5, candidate_ratio=candidate_ratio, values_dtype="float64", drop_criterion=drop_criterion,
        score_normalization=score_normalization,
    )  # fmt: skip
    ours = get_peft_model(tiny_llama(dtype=torch.float64), config)
    layers = sparse_layers(ours)
    for layer in layers:
        layer.merge_for_training = False

    # the reference: the same base model and initial masks
    reference = tiny_llama(dtype=torch.float64)
    for p in reference.parameters():
        p.requires_grad_(False)
    ref_modules = dict(reference.named_modules())
    masks = {}
    for layer in layers:
        weight = ref_modules[layer.module_name].weight
        mask = torch.zeros(weight.numel(), dtype=torch.bool)
        mask[layer.sparse_indices["default"].long()] = True
        masks[weight] = mask.view_as(weight)
    log = []
    delta = reference_spiel_ag(reference, masks, T, config, log)

    params = [p for p in ours.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS)
    scheduler = SpIELScheduler(ours, optimizer, total_steps=T)
    ours.train()
    reselection = 0
    for t in range(1, T + 1):
        _loss(ours, _batch(t)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler.step():
            for layer, weight in zip(layers, masks):
                expected = torch.nonzero(log[reselection][weight].reshape(-1)).squeeze(1)
                assert torch.equal(layer.sparse_indices["default"].long(), expected), (t, layer.module_name)
            reselection += 1
    assert reselection == len(log) == 3  # t = 2 (all replaced), 8, 14
    for layer, weight in zip(layers, masks):
        got = layer.logical_delta("default")
        torch.testing.assert_close(got, delta[weight], rtol=1e-9, atol=1e-12)

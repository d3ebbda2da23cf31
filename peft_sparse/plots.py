"""Plots (``pip install peft-sparse[plot]``)."""

from __future__ import annotations

import torch


def age_histogram(tensors: dict, path: str, bins: int = 50) -> str:
    """Histogram of the step at which each active index was last grown (thesis Fig. 7.4) as a PNG."""
    ages = [t.long() for k, t in tensors.items() if k.endswith(".sparse_ages")]
    if not ages:
        raise ValueError(
            "the adapter holds no per-index ages: SpIEL writes them into an adapter saved with "
            "save_pretrained(..., save_ages=True) and into every Trainer checkpoint folder (spiel_scheduler.safetensors); "
            "other methods keep none"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("age histograms need matplotlib: pip install 'peft-sparse[plot]'") from exc
    values = torch.cat(ages).numpy()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(values, bins=bins, color="#4472c4")
    ax.set_xlabel("optimizer step at which the index was last grown (0 = initial)")
    ax.set_ylabel("number of tunable weights")
    ax.set_title(f"SpIEL index ages ({values.size:,} weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def overlap_heatmap(languages: list, overlaps: dict, path: str) -> str:
    """Heatmap of the Jaccard overlaps between language masks (S⁴, as the paper's Figure 2) as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("overlap heatmaps need matplotlib: pip install 'peft-sparse[plot]'") from exc
    grid = [[overlaps[(a, b)] for b in languages] for a in languages]
    side = 0.6 * len(languages)  # (the title spans the figure, above the grid and the colour bar: it never meets the bar)
    fig, ax = plt.subplots(figsize=(max(3.2, 1.6 + side), 1.3 + side), layout="constrained")
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis")
    ax.set_xticks(range(len(languages)), languages)
    ax.set_yticks(range(len(languages)), languages)
    for i in range(len(languages)):
        for j in range(len(languages)):
            ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", color="white" if grid[i][j] < 0.6 else "black", fontsize=8)
    fig.colorbar(image, ax=ax, label="Jaccard overlap")
    fig.suptitle("S⁴ language masks")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def feature_importance_bars(names: list, importance: list, path: str, top: int = 20) -> str:
    """Horizontal bars of the ``top`` typological features by MAD-G importance ‖(W·V)[:, j]‖ (thesis §3.5.4) as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("feature plots need matplotlib: pip install 'peft-sparse[plot]'") from exc
    order = sorted(range(len(names)), key=lambda j: -importance[j])[:top]
    fig, ax = plt.subplots(figsize=(6, 0.28 * len(order) + 1.2))
    ax.barh([names[j] for j in order][::-1], [importance[j] for j in order][::-1], color="#4472c4")
    ax.set_xlabel("‖(W·V)[:, j]‖")
    ax.set_title(f"MAD-G: the {len(order)} most influential typological features")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def slow_fast_plot(history: list, path: str) -> str:
    """Phase, φ and the multipliers K per set over training (one ``SlowFastScheduler.step`` log per step) as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("slow-fast plots need matplotlib: pip install 'peft-sparse[plot]'") from exc
    if not history:
        raise ValueError("slow_fast_plot needs at least one step's log")
    steps = list(range(1, len(history) + 1))
    keys = sorted({k for h in history for k in h if k.startswith("slow_fast/K[")})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    top.step(steps, [h["slow_fast/phase"] for h in history], where="post", color="#444444", label="phase (1 = P₁, 2 = P₂)")
    phi = [h.get("slow_fast/phi") for h in history]
    if any(v is not None for v in phi):
        top.plot(steps, [float("nan") if v is None else v for v in phi], color="#c00000", label="φ")
    if "loss" in history[0]:
        top.plot(steps, [h["loss"] for h in history], color="#4472c4", alpha=0.6, label="training loss")
    top.legend(fontsize=8)
    top.set_title("slow-fast: phase and loss ratio φ")
    for key in keys:
        bottom.plot(steps, [h.get(key) for h in history], label=key.removeprefix("slow_fast/"))
    bottom.set_yscale("symlog", linthresh=1e-3)  # (R(φ) reaches 0)
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("learning-rate multiplier K")
    bottom.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

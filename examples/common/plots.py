"""The loss curve the example trainers draw (WORKDIR/loss.png)."""

from __future__ import annotations

import pathlib


def plot_losses(records: list[dict], path: pathlib.Path, title: str,
                reference: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], label="train loss")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-",
                label="eval loss")
    if "eval_best_loss" in reference:
        ax.axhline(reference["eval_best_loss"], color="k", ls="--", lw=1,
                   label=f"best possible (eval) {reference['eval_best_loss']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

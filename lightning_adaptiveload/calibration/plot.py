"""The calibration's fit plot, `calibration_fit.png`: measured step times against the cost model."""
from __future__ import annotations

import numpy as np

from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.fitting import check_measurements, rel_err


def plot_fit(model: CostModel, batch_sizes, seq_lens, times_ms, path) -> None:
    """PNG: measured step time (markers) and the model (lines) against B, one colour per S, log
    axes; and the relative error of each point against B*S (points need not be the fit points)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, s, t = check_measurements(batch_sizes, seq_lens, times_ms)
    fig, (ax_fit, ax_err) = plt.subplots(1, 2, figsize=(13, 5.5))
    colors = plt.cm.viridis(np.linspace(0, 0.95, len(np.unique(s))))
    for color, seq in zip(colors, np.unique(s)):
        on = s == seq
        ax_fit.plot(b[on], t[on], "o", color=color, label=f"S={int(seq)}")
        if b[on].min() < b[on].max():
            grid = np.geomspace(b[on].min(), b[on].max(), 50)
            ax_fit.plot(grid, model.predict(grid, np.full_like(grid, seq)), "-", color=color)
        else:  # a single batch size: mark the prediction instead of a curve
            ax_fit.plot(b[on], model.predict(b[on], s[on]), "x", color=color)
        ax_err.plot(b[on] * seq, 100 * (model.predict(b[on], s[on]) - t[on]) / t[on], "o", color=color)
    ax_fit.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="step time (ms)",
               title=f"{model.form}: " + ", ".join(f"{k}={v:.3g}" for k, v in model.params.items()))
    ax_fit.legend(fontsize=7, ncol=2)
    rel = rel_err(model.predict(b, s), t)
    ax_err.axhline(0, color="gray", lw=0.8)
    ax_err.set(xscale="log", xlabel="tokens B*S", ylabel="(predicted - measured) / measured (%)",
               title=f"these {len(t)} points: mean {100 * rel.mean():.1f}%, max {100 * rel.max():.1f}%; "
                     f"fit's held-out mean {100 * model.quality['heldout_mean_rel_err']:.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

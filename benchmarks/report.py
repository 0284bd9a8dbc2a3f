"""Charts of the committed benchmark results: benchmarks/results/*.json -> docs/img/*.png.

    python benchmarks/report.py [--results benchmarks/results] [--out docs/img]

Needs only matplotlib and numpy (not fusedattn, not a GPU). One function per
results file; each reads that file's `summary` (or `rows`) as the benchmark wrote
it and draws one PNG, so re-running a benchmark and then this script refreshes
docs/benchmarks.md's charts.
"""

import argparse
import json
import pathlib
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

PASSES = ("fwd", "fwd+bwd")


def load(results: pathlib.Path, name: str) -> dict:
    """The parsed results file `name`.json; a clear error when it is missing."""
    path = results / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run benchmarks/{name}.py first, or pass --results")
    return json.loads(path.read_text())


def grouped_bars(ax, labels, series, ylabel, title):
    """Bars of several series side by side per label; series: {legend: [value or None per label]}."""
    x = np.arange(len(labels))
    width = 0.8 / len(series)
    for i, (legend, values) in enumerate(series.items()):
        heights = [np.nan if v is None else v for v in values]
        ax.bar(x + (i - (len(series) - 1) / 2) * width, heights, width, label=legend)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def save(fig, out: pathlib.Path, name: str, source: dict, top: float = 1.0) -> pathlib.Path:
    """Write fig as out/name.png with the device and date of the results in a footer; top: room for a legend."""
    fig.text(0.01, 0.005, f"{source['device']}, {source['date'][:10]}, benchmarks/results/{name}.json",
             fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, top))
    path = out / f"{name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def shape_label(name: str) -> str:
    """'b4_s2048_h16_d128_causal' -> 'b4 s2048 h16 d128 causal'."""
    return name.replace("_", " ")


def chart_tflops(results, out, name, series_keys, title):
    """TF/s per shape, fwd and fwd+bwd panels; series_keys: {legend: summary key} (a series
    the file has no value of is left out)."""
    data = load(results, name)
    measured = {legend: key for legend, key in series_keys.items()
                if any(r.get(key) is not None for r in data["summary"])}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, pass_ in zip(axes, PASSES):
        rows = [r for r in data["summary"] if r["pass"] == pass_]
        series = {legend: [r.get(key) for r in rows] for legend, key in measured.items()}
        grouped_bars(ax, [shape_label(r["name"]) for r in rows], series, "TF/s", f"{title}, {pass_}")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=len(measured), fontsize=8)
    return save(fig, out, name, data, top=0.9)


def chart_cudnn(results, out):
    """The cudnn backend against jax.nn.dot_product_attention(cudnn) and the xla backend."""
    return chart_tflops(results, out, "cudnn", {
        "fusedattn cudnn": "tflops",
        "jax.nn.dot_product_attention (cudnn)": "jax_cudnn_tflops",
        "fusedattn xla": "xla_tflops",
    }, "cudnn backend")


def chart_flash(results, out):
    """The flash CUDA kernels (sm_90a, and the portable sm_80 text named) against the cudnn
    backend, JAX's cuDNN call, FlashAttention-3 and the xla backend, where the file has them."""
    return chart_tflops(results, out, "flash", {
        "fusedattn flash": "flash_tflops",
        "fusedattn flash, sm_80 kernels": "flash_sm80_tflops",
        "fusedattn cudnn": "cudnn_tflops",
        "jax.nn.dot_product_attention (cudnn)": "jax_cudnn_tflops",
        "FlashAttention-3": "fa3_tflops",
        "fusedattn xla": "xla_tflops",
    }, "flash kernels")


def chart_small_seq(results, out):
    """Fraction of the HBM byte floor against the number of keys, small_seq vs xla vs cudnn."""
    data = load(results, "small_seq")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    prefix = "b30720_d128_skv"
    for ax, pass_ in zip(axes, PASSES):
        for impl, legend in (("small_seq", "fusedattn small_seq"), ("xla", "fusedattn xla"), ("cudnn", "cudnn")):
            rows = [r for r in data["rows"] if r["name"].startswith(prefix) and r["impl"] == impl
                    and r["pass"] == pass_ and r.get("fraction_of_floor") is not None]
            if rows:
                ax.plot([r["shape"]["s_kv"] for r in rows], [r["fraction_of_floor"] for r in rows],
                        marker="o", label=legend)
        ax.set_xlabel("keys per query (s_kv)")
        ax.set_title(f"b=30720 h=16 d=128 s_q=1, {pass_}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of the HBM byte floor")
    fig.suptitle(f"small_seq backend against the floor: {data['floor']}", fontsize=10)
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    axes[1].text(0.5, 0.05, "cudnn: no backward for s_q = 1", transform=axes[1].transAxes,
                 ha="center", fontsize=8, color="gray")
    return save(fig, out, "small_seq", data)


def chart_layers(results, out):
    """Attention layer fwd+bwd time per implementation, with the matmul floor."""
    data = load(results, "layers")
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [r["impl"] for r in rows]
    colors = ["C0" if r["impl"].startswith("fusedattn") else "C1" if r["impl"].startswith("stock") else "C2"
              for r in rows]
    ax.bar(labels, [r["ms"] for r in rows], color=colors)
    ax.axhline(data["matmul_floor_ms"], color="gray", linestyle="--", label="matmul floor")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"attention layer fwd+bwd, {shape_label(rows[0]['name'])}, bf16", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return save(fig, out, "layers", data)


def chart_lm_train(results, out):
    """The example LM's GPU config: tokens/s per backend and the loss curves of the timed runs."""
    data = load(results, "lm_train")
    timed = [r for r in data["rows"] if r["backend"] in data["summary"] and not r["backend"].endswith("profiled")]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(11, 4))
    tokens = [data["summary"][r["backend"]]["tokens_per_s"] / 1e3 for r in timed]
    bars.bar([r["backend"] for r in timed], tokens, color=[f"C{i}" for i in range(len(timed))])
    for i, r in enumerate(timed):
        bars.text(i, tokens[i], f"MFU {data['summary'][r['backend']]['mfu']:.1%}", ha="center", va="bottom",
                  fontsize=8)
    bars.set_ylabel("thousand tokens/s")
    bars.set_title(f"LM trainer {data['config']}", fontsize=10)
    for r in timed:
        points = [(m["step"], m["loss"]) for m in r["metrics"] if "loss" in m]
        curves.plot(*zip(*points), label=r["backend"])
    curves.set_xlabel("step")
    curves.set_ylabel("training loss")
    curves.set_title("loss per step", fontsize=10)
    curves.legend(fontsize=8)
    for ax in (bars, curves):
        ax.grid(alpha=0.3)
    return save(fig, out, "lm_train", data)


def chart_decode(results, out):
    """Fraction of the HBM byte floor per decode case: ours paged (page 64) and contiguous,
    FlashAttention-3 paged (page 64), jax.nn xla."""
    data = load(results, "decode")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    impls = (("paged", 64, "fusedattn paged (page 64)"), ("contiguous", None, "fusedattn contiguous (cudnn)"),
             ("fa3_paged", 64, "FA3 paged (page 64)"), ("jax_xla", None, "jax.nn xla"))
    for ax, s_q in zip(axes, (1, 4)):
        cases = sorted({(r["shape"]["b"], r["shape"]["s_kv"]) for r in data["rows"] if r["shape"]["s_q"] == s_q})
        series = {}
        for impl, page, legend in impls:
            by_case = {(r["shape"]["b"], r["shape"]["s_kv"]): r["fraction_of_floor"] for r in data["rows"]
                       if r["impl"] == impl and r["shape"]["s_q"] == s_q and r["shape"]["page"] == page}
            series[legend] = [by_case.get(case) for case in cases]
        grouped_bars(ax, [f"b{b} s_kv{s}" for b, s in cases], series, "fraction of the HBM byte floor",
                     f"decode, {s_q} quer{'y' if s_q == 1 else 'ies'} per sequence, GQA 32/8 d128 bf16")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    return save(fig, out, "decode", data)


def chart_fp8(results, out):
    """FP8 attention (cudnn backend) against bf16 and JAX's private cuDNN FP8 call, TF/s per shape."""
    data = load(results, "fp8")
    legends = {"fp8": "fusedattn fp8 (scaling managed)", "fp8_inputs": "fusedattn fp8, fp8 inputs",
               "fp8_graph": "cuDNN FP8 graph alone", "bf16": "fusedattn bf16 (cudnn)",
               "jax_fp8": "JAX private cuDNN FP8"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, pass_ in zip(axes, PASSES):
        rows = [r for r in data["rows"] if r["pass"] == pass_ and "impl" in r]
        shapes = list(dict.fromkeys(tuple(r["shape"].values()) for r in rows))
        tflops = {(tuple(r["shape"].values()), r["impl"]): r["tflops"] for r in rows}
        series = {legend: [tflops.get((shape, impl)) for shape in shapes] for impl, legend in legends.items()}
        labels = [f"b{b} s{s_} h{h} d{d}" + (" causal" if causal else "") for b, s_, h, d, causal in shapes]
        grouped_bars(ax, labels, series, "TF/s", f"FP8 attention, {pass_}")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=3, fontsize=8)
    return save(fig, out, "fp8", data, top=0.86)


def chart_masked_values(results, out):
    """What config.guard_masked_values costs: guarded over unguarded time, minus one, per call."""
    data = load(results, "masked_values")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, pass_ in zip(axes, PASSES):
        rows = [r for r in data["rows"] if r["pass"] == pass_ and "guard_cost" in r]
        shapes = list(dict.fromkeys(tuple(r["shape"].values()) for r in rows))
        cost = {(tuple(r["shape"].values()), r["impl"]): 100 * r["guard_cost"] for r in rows}
        series = {backend: [cost.get((shape, f"{backend}_unguarded")) for shape in shapes]
                  for backend in ("cudnn", "flash")}
        labels = [f"b{b} s{s_} h{h} d{d}" + (" causal" if causal else "") for b, s_, h, d, causal in shapes]
        grouped_bars(ax, labels, series, "% more time with the guard", f"guard_masked_values, {pass_}")
    axes[0].legend(fontsize=8)
    return save(fig, out, "masked_values", data)


def chart_context_parallel(results, out):
    """Scaling efficiency of context parallelism (causal, load-balanced, flash per block) on 2 and 4
    H200s: one GPU's time / (time x GPUs), the latest row of each case, against the 0.85 target."""
    files = ("context_parallel", "context_parallel_4xh200")
    latest = {}
    for name in files:
        for r in load(results, name)["rows"]:
            if "scaling_efficiency" in r and r.get("load_balance") in (None, "on"):
                latest[(r["devices"], r["seqlen"], r["pass"], r["impl"])] = r["scaling_efficiency"]
    cases = sorted({key[:3] for key in latest})
    fig, ax = plt.subplots(figsize=(9, 4))
    series = {impl: [latest.get(case + (impl,)) for case in cases] for impl in ("ring", "all_gather")}
    grouped_bars(ax, [f"{n} GPUs s={s} {pass_}" for n, s, pass_ in cases], series, "scaling efficiency",
                 "context parallelism, b1 h16 d128 bf16 causal, load-balanced")
    ax.axhline(0.85, color="gray", linestyle="--", label="target 0.85")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    return save(fig, out, "context_parallel", load(results, files[-1]))


def chart_lm_mesh(results, out):
    """The LM trainer's GPU config on meshes of 1, 2 and 4 H200s: steady tokens/s (intervals after step 20)."""
    runs = [run for name in ("lm_mesh", "lm_mesh_4xh200") for run in load(results, name)["runs"]]
    rates = [np.mean([i["tokens_per_s"] for i in run["intervals"] if i["step"] > 20]) / 1e3 for run in runs]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    labels = [textwrap.fill(run["run"].split(";")[0], 36) for run in runs]
    ax.barh(labels, rates, color=[f"C{i}" for i in range(len(runs))])
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("thousand tokens/s (steady: intervals after step 20)")
    ax.set_title("LM trainer configs/lm_nnx.py:gpu on data x context meshes", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return save(fig, out, "lm_mesh", load(results, "lm_mesh_4xh200"))


CHARTS = (chart_cudnn, chart_flash, chart_small_seq, chart_layers, chart_lm_train, chart_decode, chart_fp8,
          chart_masked_values, chart_context_parallel, chart_lm_mesh)


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=root / "benchmarks" / "results")
    parser.add_argument("--out", type=pathlib.Path, default=root / "docs" / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for chart in CHARTS:
        path = chart(args.results, args.out)
        print(f"{path} ({path.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()

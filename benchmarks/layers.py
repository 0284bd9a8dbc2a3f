"""One attention layer, forward + backward: ours (backend auto) against the stock layers.

b=4, L=2048, d_model=2048, 16 heads (head dim 128), causal self-attention,
bf16 compute with float32 parameters. The timed step is the VJP of the layer
output with a random cotangent, with respect to the parameters and the input.

Impls: fusedattn_{nnx,linen,equinox} (config backend "auto"), stock_{nnx,linen,
equinox} (flax.nnx.MultiHeadAttention, flax.linen.MultiHeadDotProductAttention,
equinox.nn.MultiheadAttention vmapped; causal mask arrays) and hand_cudnn (the
same four projections around jax.nn.dot_product_attention(implementation="cudnn")).

    python benchmarks/layers.py --out benchmarks/results/layers.json
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
from flax import nnx

import fusedattn
from fusedattn.layers import equinox as fa_equinox
from fusedattn.layers import linen as fa_linen
from fusedattn.layers import nnx as fa_nnx

from common import H200_MEASURED_MATMUL_FLOPS, median_ms, parse_args, random_normal, write_results

B, L, D_MODEL, HEADS = 4, 2048, 2048, 16
DTYPE = jnp.bfloat16


def attention_config():
    config = fusedattn.configs.attention_config()
    config.mask = "causal"
    return config


def nnx_step(module, **call_kwargs):
    graphdef, state = nnx.split(module)

    def apply(state, x):
        return nnx.merge(graphdef, state)(x, **call_kwargs)

    return apply, state


def linen_step(module, x, **call_kwargs):
    params = module.init(jax.random.key(0), x)
    return (lambda params, x: module.apply(params, x, **call_kwargs)), params


def equinox_step(module):
    params, static = eqx.partition(module, eqx.is_array)

    def apply(params, x):
        layer = eqx.combine(params, static)
        return jax.vmap(lambda row: layer(row, row, row))(x)

    return apply, params


def stock_equinox_step(module):
    params, static = eqx.partition(module, eqx.is_array)
    mask = jnp.tril(jnp.ones((L, L), bool))

    def apply(params, x):
        layer = eqx.combine(params, static)
        run = lambda row: layer(row.astype(DTYPE), row.astype(DTYPE), row.astype(DTYPE), mask=mask)
        return jax.vmap(run)(x)

    return apply, params


def hand_cudnn_step(rng, fused_qkv: bool = False):
    """Four projections around JAX's cuDNN attention; fused_qkv: q, k, v as one matmul."""
    keys = jax.random.split(rng, 4)
    head_dim = D_MODEL // HEADS
    params = {name: jax.random.normal(k, (D_MODEL, HEADS, head_dim), jnp.float32) * D_MODEL ** -0.5
              for name, k in zip(("q", "k", "v"), keys[:3])}
    params["o"] = jax.random.normal(keys[3], (HEADS, head_dim, D_MODEL), jnp.float32) * D_MODEL ** -0.5
    if fused_qkv:
        params["qkv"] = jnp.stack([params.pop(n) for n in ("q", "k", "v")], axis=1)

    def apply(params, x):
        p = jax.tree.map(lambda w: w.astype(DTYPE), params)
        if fused_qkv:
            q, k, v = jnp.unstack(jnp.einsum("bld,dthe->tblhe", x, p["qkv"]))
        else:
            q, k, v = (jnp.einsum("bld,dhe->blhe", x, p[n]) for n in ("q", "k", "v"))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.einsum("blhe,hed->bld", out, p["o"])

    return apply, params


def floor_ms() -> float:
    """Matmul FLOPs of one layer's fwd+bwd over the ~790 TF/s rate: 4 projections
    (2 * B*L * d_model^2 each, x3 for fwd+bwd) and causal attention (half of
    4 * B*h*L^2*hd forward, x3.5 for fwd+bwd)."""
    projections = 3 * 4 * 2 * B * L * D_MODEL ** 2
    attention = 3.5 * 0.5 * 4 * B * HEADS * L * L * (D_MODEL // HEADS)
    return (projections + attention) / H200_MEASURED_MATMUL_FLOPS * 1e3


def impls(x):
    rngs = nnx.Rngs(0)
    config = attention_config()
    causal = nnx.make_causal_mask(jnp.ones((B, L)))
    return {
        "fusedattn_nnx": nnx_step(fa_nnx.MultiHeadAttention(HEADS, D_MODEL, config=config,
                                                            dtype=DTYPE, rngs=rngs)),
        "fusedattn_linen": linen_step(fa_linen.MultiHeadAttention(HEADS, config=config,
                                                                  dtype=DTYPE), x),
        "fusedattn_equinox": equinox_step(fa_equinox.MultiheadAttention(
            HEADS, D_MODEL, config=config, compute_dtype=DTYPE, key=jax.random.key(1))),
        "stock_nnx": nnx_step(nnx.MultiHeadAttention(HEADS, D_MODEL, dtype=DTYPE, decode=False,
                                                     rngs=rngs), mask=causal),
        "stock_linen": linen_step(linen.MultiHeadDotProductAttention(num_heads=HEADS, dtype=DTYPE),
                                  x, mask=causal),
        "stock_equinox": stock_equinox_step(eqx.nn.MultiheadAttention(HEADS, D_MODEL,
                                                                      key=jax.random.key(2))),
        "hand_cudnn": hand_cudnn_step(jax.random.key(3)),
        "hand_cudnn_fused_qkv": hand_cudnn_step(jax.random.key(3), fused_qkv=True),
    }


def main():
    args = parse_args("benchmarks/results/layers.json")
    keys = jax.random.split(jax.random.key(0), 2)
    x = random_normal(keys[0], (B, L, D_MODEL), DTYPE)
    cotangent = random_normal(keys[1], (B, L, D_MODEL), DTYPE)
    rows = []
    for name, (apply, params) in impls(x).items():

        @jax.jit
        def step(params, x, cotangent, apply=apply):
            out, vjp = jax.vjp(apply, params, x)
            return vjp(cotangent.astype(out.dtype))

        row = {"name": f"b{B}_L{L}_d{D_MODEL}_h{HEADS}_causal", "shape": {"b": B, "L": L, "d_model": D_MODEL,
                                                               "h": HEADS},
               "impl": name, "pass": "fwd+bwd"}
        try:
            row["ms"] = round(median_ms(step, params, x, cotangent, repeats=args.repeats,
                                        iters=args.iters), 4)
        except Exception as error:
            row.update(ms=None, error=str(error).splitlines()[0][:300])
        rows.append(row)
        print(row, flush=True)
    times = {r["impl"]: r["ms"] for r in rows}
    summary = {}
    for ours in ("fusedattn_nnx", "fusedattn_linen", "fusedattn_equinox"):
        stock = ours.replace("fusedattn", "stock")
        if times.get(ours) and times.get(stock) and times.get("hand_cudnn"):
            summary[ours] = {"speedup_vs_stock": round(times[stock] / times[ours], 2),
                             "time_ratio_vs_hand_cudnn": round(times[ours] / times["hand_cudnn"], 3)}
    head_dim = D_MODEL // HEADS
    structs = [jax.ShapeDtypeStruct((B, L, HEADS, head_dim), DTYPE)] * 3
    explanation = fusedattn.ops.explain(structs, config=attention_config())
    print(explanation)
    floor = floor_ms()
    for r in rows:
        r["of_matmul_floor"] = round(floor / r["ms"], 3) if r["ms"] else None
    write_results(args.out, rows, summary=summary, attention_backend=explanation.backend,
                  matmul_floor_ms=round(floor, 4))
    print(f"\n{'impl':<22}{'ms':>9}{'floor/ms':>10}   (matmul floor {floor:.3f} ms)")
    for r in rows:
        ms = 'error' if r['ms'] is None else format(r['ms'], '.3f')
        print(f"{r['impl']:<22}{ms:>9}{r['of_matmul_floor'] or 0:>10.2f}")
    for ours, s in summary.items():
        print(f"{ours}: {s['speedup_vs_stock']}x vs stock, {s['time_ratio_vs_hand_cudnn']} x hand_cudnn time")


if __name__ == "__main__":
    main()

"""An independent float64 NumPy reference of the attention semantics in API.md.

Written from the contract, not from the library: layouts, sequence
descriptors, masks, windows, biases (pre/post scale, ALiBi with re-derived
slopes), softmax variants, GQA and dropout are all computed here in float64
NumPy, and gradients are derived analytically (checked against central finite
differences of the float64 forward in test_xla_backend.py). The only library
code used is the documented Philox dropout definition
(`fusedattn.ops.philox.dropout_keep_mask` / `seed_from_key`), for the mask bits.

Entry point: `reference_attention(arrays, config, ...)` -> `Reference`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import numpy as np

LAYOUTS = (
    "bs3hd", "bshd_bs2hd", "bshd_bshd_bshd",
    "sb3hd", "sbhd_sb2hd", "sbhd_sbhd_sbhd",
    "t3hd", "thd_t2hd", "thd_thd_thd",
)
MASKS = (
    "no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
    "padding_causal_bottom_right",
)
BIASES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
SOFTMAXES = ("vanilla", "off_by_one", "learnable")


# --------------------------------------------------------------------------- layouts

def num_arrays(layout: str) -> int:
    """How many arrays the qkv tuple of a layout holds."""
    if "3" in layout:
        return 1
    if "2" in layout:
        return 2
    return 3


def seq_first(layout: str) -> bool:
    return layout.startswith("sb")


def is_thd(layout: str) -> bool:
    return layout.startswith("t")


def allows_dv(layout: str) -> bool:
    """Whether v may have its own head dim (only with separate q, k, v arrays)."""
    return num_arrays(layout) == 3


def allows_gqa(layout: str) -> bool:
    """Whether k/v may have fewer heads than q (not when q, k, v are packed together)."""
    return num_arrays(layout) != 1


def allows_cross(layout: str) -> bool:
    """Whether sq may differ from skv."""
    return num_arrays(layout) != 1


def layout_shapes(layout: str, b: int, sq: int, skv: int, h: int, h_kv: int, d: int,
                  dv: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of the qkv tuple for a layout (THD arrays are [b, t, h, d])."""
    def single(s, heads, dim):
        return (s, b, heads, dim) if seq_first(layout) else (b, s, heads, dim)

    def packed(s, n, heads, dim):
        return (s, b, n, heads, dim) if seq_first(layout) else (b, s, n, heads, dim)

    n = num_arrays(layout)
    if n == 1:
        if not (sq == skv and h == h_kv and d == dv):
            raise ValueError(f"{layout} packs q, k and v: needs sq == skv, h == h_kv, d == dv")
        return (packed(sq, 3, h, d),)
    if n == 2:
        if d != dv:
            raise ValueError(f"{layout} packs k and v: needs d == dv")
        return (single(sq, h, d), packed(skv, 2, h_kv, d))
    return (single(sq, h, d), single(skv, h_kv, d), single(skv, h_kv, dv))


def split_layout(layout: str, arrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [b, sq, h, d], k [b, skv, h_kv, d], v [b, skv, h_kv, dv]) in float64."""
    arrays = [np.asarray(a, np.float64) for a in arrays]
    if len(arrays) != num_arrays(layout):
        raise ValueError(f"{layout} takes {num_arrays(layout)} arrays, got {len(arrays)}")
    if seq_first(layout):
        arrays = [np.swapaxes(a, 0, 1) for a in arrays]
    if len(arrays) == 1:
        (packed,) = arrays
        return packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    if len(arrays) == 2:
        q, kv = arrays
        return q, kv[:, :, 0], kv[:, :, 1]
    return tuple(arrays)


def merge_layout(layout: str, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple:
    """Inverse of split_layout: canonical q, k, v (e.g. gradients) in the layout's arrays."""
    n = num_arrays(layout)
    if n == 1:
        arrays = (np.stack([q, k, v], axis=2),)
    elif n == 2:
        arrays = (q, np.stack([k, v], axis=2))
    else:
        arrays = (q, k, v)
    if seq_first(layout):
        arrays = tuple(np.swapaxes(a, 0, 1) for a in arrays)
    return arrays


def to_layout_output(layout: str, out: np.ndarray) -> np.ndarray:
    """[b, sq, h, dv] -> q's layout ([sq, b, h, dv] for SBHD)."""
    return np.swapaxes(out, 0, 1) if seq_first(layout) else out


def from_layout_output(layout: str, out: np.ndarray) -> np.ndarray:
    return np.swapaxes(out, 0, 1) if seq_first(layout) else out


# --------------------------------------------------------------------------- descriptors

def _field(sequence, name):
    if sequence is None:
        return None
    value = sequence.get(name) if isinstance(sequence, Mapping) else getattr(sequence, name, None)
    return None if value is None else np.asarray(value).astype(np.int64)


def descriptor_form(sequence) -> str:
    """"segment_ids", "seqlens_offsets" or "seqlens", from which fields are present."""
    if _field(sequence, "q_segment_ids") is not None:
        return "segment_ids"
    if _field(sequence, "q_offsets") is not None:
        return "seqlens_offsets"
    return "seqlens"


@dataclasses.dataclass
class Tokens:
    """Per token: segment (0 = padding), position in it, and the mask diagonal's shift."""

    q_seg: np.ndarray    # [b, sq]
    q_pos: np.ndarray    # [b, sq]
    q_shift: np.ndarray  # [b, sq]: 0 top-left; kv_len - q_len of the segment bottom-right
    kv_seg: np.ndarray   # [b, skv]
    kv_pos: np.ndarray   # [b, skv]


def describe_tokens(sequence, b: int, sq: int, skv: int, *, use_sequence: bool,
                    bottom_right: bool) -> Tokens:
    """Segments and positions of every token, from the descriptor (or one full sequence)."""
    q_seg = np.zeros((b, sq), np.int64)
    kv_seg = np.zeros((b, skv), np.int64)
    q_pos = np.zeros((b, sq), np.int64)
    kv_pos = np.zeros((b, skv), np.int64)
    q_shift = np.zeros((b, sq), np.int64)
    # Per row: {segment id: (q length, kv length)} for the bottom-right diagonal.
    lengths: list[dict[int, tuple[int, int]]] = [dict() for _ in range(b)]

    if not use_sequence:
        q_seg[:] = 1
        kv_seg[:] = 1
        q_pos[:] = np.arange(sq)
        kv_pos[:] = np.arange(skv)
        for row in range(b):
            lengths[row][1] = (sq, skv)
    else:
        if sequence is None:
            raise ValueError("this mask/layout needs a sequence descriptor")
        form = descriptor_form(sequence)
        if form == "seqlens":
            q_len, kv_len = _field(sequence, "q_seqlens"), _field(sequence, "kv_seqlens")
            for row in range(b):
                for i in range(min(sq, max(q_len[row], 0))):
                    q_seg[row, i], q_pos[row, i] = 1, i
                for j in range(min(skv, max(kv_len[row], 0))):
                    kv_seg[row, j], kv_pos[row, j] = 1, j
                lengths[row][1] = (int(q_len[row]), int(kv_len[row]))
        elif form == "seqlens_offsets":
            q_len, kv_len = _field(sequence, "q_seqlens"), _field(sequence, "kv_seqlens")
            q_off, kv_off = _field(sequence, "q_offsets"), _field(sequence, "kv_offsets")
            for row in range(b):
                for slot in range(q_len.shape[1]):
                    segment = slot + 1
                    for seg, pos, length, offset, extent in (
                            (q_seg, q_pos, q_len, q_off, sq), (kv_seg, kv_pos, kv_len, kv_off, skv)):
                        n, start = int(length[row, slot]), int(offset[row, slot])
                        if n <= 0 or start < 0:
                            continue  # unused slot (-1) or empty segment
                        for t in range(start, min(start + n, extent)):
                            seg[row, t], pos[row, t] = segment, t - start
                    lengths[row][segment] = (max(int(q_len[row, slot]), 0),
                                             max(int(kv_len[row, slot]), 0))
        else:  # segment ids (0 = padding); positions count up within each run of one id
            q_ids, kv_ids = _field(sequence, "q_segment_ids"), _field(sequence, "kv_segment_ids")
            q_given, kv_given = _field(sequence, "q_segment_pos"), _field(sequence, "kv_segment_pos")
            q_seg[:], kv_seg[:] = q_ids, kv_ids
            q_pos[:] = _run_positions(q_ids) if q_given is None else q_given
            kv_pos[:] = _run_positions(kv_ids) if kv_given is None else kv_given
            for row in range(b):
                for segment in set(q_ids[row].tolist()) - {0}:
                    lengths[row][segment] = (int(np.sum(q_ids[row] == segment)),
                                             int(np.sum(kv_ids[row] == segment)))
    if bottom_right:
        for row in range(b):
            for i in range(sq):
                segment = int(q_seg[row, i])
                if segment:
                    n_q, n_kv = lengths[row].get(segment, (0, 0))
                    q_shift[row, i] = n_kv - n_q
    return Tokens(q_seg, q_pos, q_shift, kv_seg, kv_pos)


def _run_positions(ids: np.ndarray) -> np.ndarray:
    """0, 1, 2, ... restarting wherever the id changes, per row."""
    pos = np.zeros_like(ids)
    for row in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            pos[row, t] = pos[row, t - 1] + 1 if ids[row, t] == ids[row, t - 1] else 0
    return pos


def visible_keys(tokens: Tokens, *, causal: bool, window: tuple[int, int]) -> np.ndarray:
    """Boolean [b, sq, skv]: which keys each query may attend to."""
    left, right = window
    b, sq = tokens.q_seg.shape
    skv = tokens.kv_seg.shape[1]
    visible = np.zeros((b, sq, skv), bool)
    for row in range(b):
        for i in range(sq):
            segment = tokens.q_seg[row, i]
            if segment == 0:
                continue
            diagonal = tokens.q_pos[row, i] + tokens.q_shift[row, i]
            for j in range(skv):
                if tokens.kv_seg[row, j] != segment:
                    continue
                key = tokens.kv_pos[row, j]
                if causal and key > diagonal:
                    continue
                if left >= 0 and key < diagonal - left:
                    continue
                if right >= 0 and key > diagonal + right:
                    continue
                visible[row, i, j] = True
    return visible


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes (Press et al.): the geometric sequence 2^(-8/n), 2^(-16/n), ... for the
    largest power of two n <= num_heads, then the odd terms of the sequence for 2n."""
    n = 1 << (num_heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    slopes += [2.0 ** (-8.0 * (2 * i + 1) / (2 * n)) for i in range(num_heads - n)]
    return np.asarray(slopes, np.float64)


# --------------------------------------------------------------------------- attention

def _get(config, key: str, default=None):
    node = config
    for part in key.split("."):
        if node is None:
            return default
        node = node.get(part, None) if isinstance(node, Mapping) else getattr(node, part, None)
    return default if node is None else node


@dataclasses.dataclass
class Reference:
    """float64 output in q's layout, weights, and (when dout was given) gradients."""

    out: np.ndarray
    weights: np.ndarray          # [b, h, sq, skv] softmax weights after dropout
    visible: np.ndarray          # [b, sq, skv]
    grads: dict[str, Any] | None = None  # "qkv": tuple in layout; "bias"; "softmax_offset"


def reduce_to_shape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum x over the axes that were broadcast from `shape`."""
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return np.sum(x, axis=axes, keepdims=True).reshape(shape)


def dropout_keep(key, rate: float, shape: tuple[int, int, int, int]) -> np.ndarray:
    """The documented Philox keep mask for a JAX PRNG key (boolean [b, h, sq, skv])."""
    mask_fn, seed_fn = _philox()
    return np.asarray(mask_fn(seed_fn(key), float(rate), tuple(shape)))


@functools.lru_cache(maxsize=None)
def _philox():
    import jax

    from fusedattn.ops import philox  # the documented definition of the mask bits

    return (jax.jit(philox.dropout_keep_mask, static_argnums=(1, 2)),
            jax.jit(philox.seed_from_key))


def reference_attention(arrays, config, *, bias=None, softmax_offset=None, sequence=None,
                        dropout_key=None, is_training: bool = False, dout=None,
                        keep: np.ndarray | None = None) -> Reference:
    """float64 attention per API.md.

    arrays: the qkv tuple in config's layout; config: an attention ConfigDict or a plain
    mapping with the same keys; sequence: a SequenceDescriptor or a dict of its fields;
    dout: cotangent of the output (q's layout) to get gradients; keep: an explicit
    boolean [b, h, sq, skv] dropout keep mask (else derived from dropout_key).
    """
    layout = _get(config, "qkv_layout", "bshd_bshd_bshd")
    mask = _get(config, "mask", "causal")
    bias_type = _get(config, "bias", "no_bias")
    softmax = _get(config, "softmax", "vanilla")
    rate = float(_get(config, "dropout_rate", 0.0))
    window = tuple(_get(config, "window_size", (-1, -1)))
    q, k, v = split_layout(layout, arrays)
    b, sq, h, d = q.shape
    skv, h_kv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = h // h_kv
    scale = _get(config, "scale", None)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    tokens = describe_tokens(sequence, b, sq, skv,
                             use_sequence=mask.startswith("padding") or is_thd(layout),
                             bottom_right=mask.endswith("bottom_right"))
    visible = visible_keys(tokens, causal="causal" in mask, window=window)

    kh = np.repeat(k, group, axis=2)  # query head i reads key/value head i // group
    vh = np.repeat(v, group, axis=2)
    qk = np.einsum("bihd,bjhd->bhij", q, kh)
    bias64 = None if bias is None else np.asarray(bias, np.float64)
    if bias_type == "pre_scale_bias":
        scores = (qk + bias64) * scale
    else:
        scores = qk * scale
    distance = None
    slopes = None
    if bias_type == "post_scale_bias":
        scores = scores + bias64
    elif bias_type == "alibi":
        slopes = alibi_slopes(h) if bias64 is None else bias64
        diagonal = (tokens.q_pos + tokens.q_shift)[:, None, :, None]
        distance = np.abs(tokens.kv_pos[:, None, None, :] - diagonal).astype(np.float64)
        scores = scores - slopes[None, :, None, None] * distance

    vis = visible[:, None]  # broadcast over heads
    if softmax == "vanilla":
        sink = None
    elif softmax == "off_by_one":
        sink = np.zeros((1, h, 1, 1))
    else:
        sink = np.asarray(softmax_offset, np.float64).reshape(1, h, 1, 1)
    row_max = np.max(np.where(vis, scores, -np.inf), axis=-1, keepdims=True)
    if sink is not None:
        row_max = np.maximum(row_max, sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    exps = np.where(vis, np.exp(np.where(vis, scores, 0.0) - row_max), 0.0)
    denominator = exps.sum(-1, keepdims=True)
    sink_exp = 0.0 if sink is None else np.exp(sink - row_max)
    denominator = denominator + sink_exp
    safe = np.where(denominator > 0, denominator, 1.0)
    probs = exps / safe
    sink_prob = sink_exp / safe  # [b, h, sq, 1] (0 for vanilla)

    if keep is None and is_training and rate > 0:
        if dropout_key is None:
            raise ValueError("dropout needs a key")
        keep = dropout_keep(dropout_key, rate, (b, h, sq, skv))
    multiplier = 1.0 if keep is None else np.where(keep, 1.0 / (1.0 - rate), 0.0)
    weights = probs * multiplier
    out = np.einsum("bhij,bjhe->bihe", weights, vh)
    result = Reference(out=to_layout_output(layout, out), weights=weights, visible=visible)
    if dout is None:
        return result

    g_out = np.asarray(from_layout_output(layout, np.asarray(dout, np.float64)), np.float64)
    g_weights = np.einsum("bihe,bjhe->bhij", g_out, vh)
    g_vh = np.einsum("bhij,bihe->bjhe", weights, g_out)
    g_probs = g_weights * multiplier
    row_dot = np.sum(probs * g_probs, axis=-1, keepdims=True)
    g_scores = probs * (g_probs - row_dot)          # zero where masked
    g_qk = g_scores * scale
    g_q = np.einsum("bhij,bjhd->bihd", g_qk, kh)
    g_kh = np.einsum("bhij,bihd->bjhd", g_qk, q)
    g_k = g_kh.reshape(b, skv, h_kv, group, d).sum(3)
    g_v = g_vh.reshape(b, skv, h_kv, group, dv).sum(3)
    grads: dict[str, Any] = {"qkv": merge_layout(layout, g_q, g_k, g_v),
                             "bias": None, "softmax_offset": None}
    if bias_type == "pre_scale_bias":
        grads["bias"] = reduce_to_shape(g_qk, bias64.shape)
    elif bias_type == "post_scale_bias":
        grads["bias"] = reduce_to_shape(g_scores, bias64.shape)
    elif bias_type == "alibi" and bias64 is not None:
        grads["bias"] = -np.sum(g_scores * distance, axis=(0, 2, 3))
    if softmax == "learnable":
        # d(sink prob-normalised weights)/d offset = -p_j * p_sink
        grads["softmax_offset"] = -np.sum(sink_prob[..., 0] * row_dot[..., 0], axis=(0, 2))
    result.grads = grads
    return result

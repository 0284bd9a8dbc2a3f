"""Writes docs/config.md from the config definition, so the page cannot drift from it.

Every key of `fusedattn.configs.attention_config()` becomes a row: its default read from
the config, its values from the string enum of `fusedattn/ops/enums.py` where the key has
one (ENUMS), else from DESCRIPTIONS, which also holds each key's meaning. A key of the
config without a description is an error naming it; descriptions of keys the config does
not have (yet) are not printed. tests/test_docs_config.py checks that the committed page
equals what this writes.

    python scripts/gen_config_docs.py           # writes docs/config.md
    python scripts/gen_config_docs.py --check   # exit 1 when docs/config.md is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ml_collections

from fusedattn import configs
from fusedattn.ops import enums

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "config.md"
COMMAND = "python scripts/gen_config_docs.py"

# Keys whose values are exactly an enum's (the strings the config accepts).
ENUMS: dict[str, type[enums._Choice]] = {
    "backend": enums.BackendName,
    "qkv_layout": enums.QKVLayout,
    "mask": enums.MaskType,
    "bias": enums.BiasType,
    "softmax": enums.SoftmaxType,
    "sequence.format": enums.SequenceFormat,
    "context_parallel.strategy": enums.ContextParallelStrategy,
    "fp8.format": enums.Fp8Format,
    "fp8.scaling": enums.Fp8Scaling,
}

# key -> (values, where the key has no enum; None where it has; meaning). In page order.
DESCRIPTIONS: dict[str, tuple[str | None, str]] = {
    "backend": (None, '"auto" takes the first backend that can serve the call; a named one that '
                      "cannot raises `ValueError` with its reason ([backends.md](backends.md))"),
    "qkv_layout": (None, "how q, k, v are passed: b batch, s sequence, h heads, d head dim, t packed "
                         "tokens; 3 / 2: q, k, v or k, v stacked on one axis; paged_kv_*: k and v "
                         "are page pools read through `fused_attn`'s `page_table`"),
    "mask": (None, 'which keys a query sees: "causal" top-left aligned, "*_bottom_right" aligns the '
                   'last query with the last key; "padding*" reads the sequence descriptor'),
    "bias": (None, 'a [b or 1, h or 1, sq, skv] array added before ("pre_scale") or after '
                   '("post_scale") the scale, or ALiBi slopes ("alibi", no array)'),
    "softmax": (None, '"off_by_one" adds 1 to the denominator, "learnable" adds exp(offset[h]) '
                      "(`softmax_offset`, float32 [h])"),
    "dropout_rate": ("[0, 1)", "dropout on the attention probabilities when training (one Philox "
                               "stream: equal masks on every backend; applied in steps of 2^-16)"),
    "scale": ("float or None", "None = 1/sqrt(head_dim)"),
    "window_size": ("(left, right) inclusive, -1 unbounded",
                    "sliding window, measured from the mask's diagonal"),
    "deterministic_backward": ("bool", "True: bitwise-reproducible gradients"),
    "guard_masked_values": (
        "bool", "True: NaN/Inf at masked keys never reach other rows, also on kernels that would "
                "leak them (a NaN check plus a conditional; see "
                "[backends.md](backends.md#masked-keys-that-hold-nan-or-inf))"),
    "sequence.format": (None, "which sequence descriptor the layers build or expect"),
    "sequence.max_segments_per_seq": (
        "int >= 1", "static; lengths + offsets descriptors may be wider, and q and kv of different "
                    "widths, as in TransformerEngine: the slots past it must be unused"),
    "sequence.max_seqlen_q": ("int or None", "static upper bound of any segment's query length"),
    "sequence.max_seqlen_kv": ("int or None", "static upper bound of any segment's key/value length"),
    "sequence.check_bounds": (
        "bool", "False drops the bounds check under `jit` (the NaN marks and the eager `ValueError` "
                "stay; see [backends.md](backends.md#declared-bounds-and-the-small-sequence-guard))"),
    "small_seq.enabled": ("bool", 'opt in to the small-sequence backend under "auto"'),
    "context_parallel.axis": ("str or None", "the mesh axis the sequence is sharded over (see "
                                             "[architecture.md](architecture.md#context-parallelism))"),
    "context_parallel.strategy": (None, "how K/V reach the queries: passed around a ring, or "
                                        "gathered at once"),
    "context_parallel.load_balance": ("bool", "tokens in the load-balanced order: device i holds "
                                              "chunks i and 2N-1-i"),
    "fp8.enabled": ("bool", "FP8 attention ([fp8.md](fp8.md)): the recipe emulated on xla "
                            "(no FP8 kernel yet); `fused_attn` takes and returns an `Fp8State`"),
    "fp8.format": (None, '"e4m3": every FP8 tensor E4M3; "hybrid": E4M3 forward '
                                       "and E5M2 for the gradients dO and dP"),
    "fp8.scaling": (None, '"delayed": scales from an amax history '
                                            "(TransformerEngine's DelayedScaling); \"current\": "
                                            "scales from this call's amax"),
    "fp8.amax_history_len": ("int >= 1", "how many past amax values delayed scaling keeps"),
    "fp8.margin": ("int >= 0", "scale = fp8_max / amax / 2^margin"),
}

INTRO = """\
# The config

<!-- Generated by scripts/gen_config_docs.py from fusedattn/configs.py: edit the script, then run it. -->

`fusedattn.configs.attention_config()`; a typo in a key raises with the valid
names, a bad value raises `ValueError` naming the key and the valid values.
"""

OUTRO = """\
Semantics (masks, layouts, descriptors, GQA, softmax variants) are those of
the API contract (`../shared/design/API.md` in the project's shared folder); masks given to layers follow Flax/JAX (True = attend).
Bad data never passes as numbers: a descriptor with impossible values (negative
or too long lengths, offsets out of order, overlapping or out of range, negative
segment ids) raises `ValueError` naming the field, row and value when called
eagerly, and under `jit` marks those rows NaN and reports through checkify
(`fusedattn/ops/validation.py`); a descriptor given with a mask that does not
read it (`causal`, `no_mask`) raises. Masked keys contribute nothing, even when
they hold NaN or Inf; a layer's explicit mask travels as a `-inf` bias, exact
at any logit size and dtype. Decoding past a cache's `max_len` raises eagerly
and gives NaN (with a checkify message) under `jit`.

The definition is `fusedattn/configs.py` (`attention_config`); the validated, frozen
form that picks the backend is `fusedattn/ops/spec.py` (`AttentionSpec`). Presets
that set a backend for the example trainers are under `configs/attention/`
(`cudnn.py`, `flash.py`, `small_seq.py`, `xla.py`).
"""


def leaf_defaults(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
    """{"section.key": default} of every leaf of `config` (placeholders read as None)."""
    leaves: dict[str, object] = {}
    for name in config.keys():
        value = config[name]
        if isinstance(value, ml_collections.ConfigDict):
            leaves.update(leaf_defaults(value, f"{prefix}{name}."))
        else:
            leaves[f"{prefix}{name}"] = value
    return leaves


def format_default(value: object) -> str:
    """A default as the config's Python would spell it: "auto", 0.0, (-1, -1), None."""
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def values_of(key: str) -> str:
    """The values column of `key`: its enum's strings, or the description's text."""
    values, _ = DESCRIPTIONS[key]
    if key in ENUMS:
        if values is not None:
            raise ValueError(f"DESCRIPTIONS[{key!r}] gives values, but ENUMS[{key!r}] "
                             f"({ENUMS[key].__name__}) defines them: set its values to None")
        return ", ".join(f'"{member.value}"' for member in ENUMS[key])
    if values is None:
        raise ValueError(f"DESCRIPTIONS[{key!r}] has no values and {key!r} is not in ENUMS: "
                         "give the values text, or map the key to its enum in ENUMS")
    return values


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(config: ml_collections.ConfigDict | None = None) -> str:
    """The text of docs/config.md for `config` (default: attention_config())."""
    defaults = leaf_defaults(configs.attention_config() if config is None else config)
    missing = [key for key in defaults if key not in DESCRIPTIONS]
    if missing:
        raise ValueError(f"config key(s) without a description: {', '.join(missing)}; add each to "
                         f"DESCRIPTIONS in scripts/gen_config_docs.py, then run {COMMAND}")
    rows = ["| key | default | values | meaning |", "|---|---|---|---|"]
    for key in DESCRIPTIONS:
        if key in defaults:
            rows.append(f"| {key} | {_cell(format_default(defaults[key]))} | "
                        f"{_cell(values_of(key))} | {_cell(DESCRIPTIONS[key][1])} |")
    return f"{INTRO}\n" + "\n".join(rows) + f"\n\n{OUTRO}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1, writing nothing, when docs/config.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

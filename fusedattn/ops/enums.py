"""The named choices of the attention config, as string enums.

Each enum's values are exactly the strings accepted in the config (API.md), so
`QKVLayout("bs3hd")` parses a config value and `str(layout)` prints it back.
"""

from __future__ import annotations

import enum


class _Choice(str, enum.Enum):
    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value, key: str):
        """Returns the member named by `value`, or raises ValueError naming `key`."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise ValueError(
                f"config.{key}: got {value!r}; expected one of {choices}. "
                f"Set config.{key} to one of these values."
            ) from None


class QKVLayout(_Choice):
    BS3HD = "bs3hd"
    BSHD_BS2HD = "bshd_bs2hd"
    BSHD_BSHD_BSHD = "bshd_bshd_bshd"
    SB3HD = "sb3hd"
    SBHD_SB2HD = "sbhd_sb2hd"
    SBHD_SBHD_SBHD = "sbhd_sbhd_sbhd"
    T3HD = "t3hd"
    THD_T2HD = "thd_t2hd"
    THD_THD_THD = "thd_thd_thd"
    # Paged KV cache: q as the first letters after "paged_kv_" say; k and v are page
    # pools [num_pages, page_size, h_kv, d], read through fused_attn's page_table.
    PAGED_KV_BSHD_BSHD_BSHD = "paged_kv_bshd_bshd_bshd"
    PAGED_KV_THD_BSHD_BSHD = "paged_kv_thd_bshd_bshd"

    @property
    def is_paged(self) -> bool:
        """Whether k and v are page pools read through a page table."""
        return self.value.startswith("paged_kv_")

    @property
    def format(self) -> str:
        """"bshd", "sbhd" or "thd": how the q array orders its axes."""
        return {"b": "bshd", "s": "sbhd", "t": "thd"}[self.value.removeprefix("paged_kv_")[0]]

    @property
    def num_arrays(self) -> int:
        """How many arrays the qkv tuple holds: 1 (qkv packed), 2 (q, kv) or 3."""
        if "3" in self.value:
            return 1
        if "2" in self.value:
            return 2
        return 3

    @property
    def is_thd(self) -> bool:
        return self.format == "thd"


class MaskType(_Choice):
    NO_MASK = "no_mask"
    PADDING = "padding"
    CAUSAL = "causal"
    PADDING_CAUSAL = "padding_causal"
    CAUSAL_BOTTOM_RIGHT = "causal_bottom_right"
    PADDING_CAUSAL_BOTTOM_RIGHT = "padding_causal_bottom_right"

    @property
    def is_padding(self) -> bool:
        return self.value.startswith("padding")

    @property
    def is_causal(self) -> bool:
        return "causal" in self.value

    @property
    def is_bottom_right(self) -> bool:
        return self.value.endswith("bottom_right")

    @property
    def with_padding(self) -> "MaskType":
        """The padding mask of the same shape: causal -> padding_causal, no_mask -> padding."""
        if self.is_padding:
            return self
        return MaskType("padding" if self == MaskType.NO_MASK else f"padding_{self.value}")


class BiasType(_Choice):
    NO_BIAS = "no_bias"
    PRE_SCALE_BIAS = "pre_scale_bias"
    POST_SCALE_BIAS = "post_scale_bias"
    ALIBI = "alibi"


class SoftmaxType(_Choice):
    VANILLA = "vanilla"
    OFF_BY_ONE = "off_by_one"
    LEARNABLE = "learnable"


class SequenceFormat(_Choice):
    NONE = "none"
    SEQLENS = "seqlens"
    SEQLENS_OFFSETS = "seqlens_offsets"
    SEGMENT_IDS = "segment_ids"


class BackendName(_Choice):
    AUTO = "auto"
    XLA = "xla"
    CUDNN = "cudnn"
    SMALL_SEQ = "small_seq"
    FLASH = "flash"
    DECODE = "decode"


class ContextParallelStrategy(_Choice):
    RING = "ring"
    ALL_GATHER = "all_gather"


class Fp8Format(_Choice):
    """Which FP8 format each tensor takes (fusedattn.ops.fp8)."""

    E4M3 = "e4m3"      # every FP8 tensor E4M3
    HYBRID = "hybrid"  # E4M3 forward; E5M2 for the gradients dO and dP (more range)


class Fp8Scaling(_Choice):
    """Where the FP8 scales come from (fusedattn.ops.fp8)."""

    DELAYED = "delayed"  # from the amax history of earlier calls (TransformerEngine's DelayedScaling)
    CURRENT = "current"  # from this call's amax

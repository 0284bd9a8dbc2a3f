"""fusedattn.ops: the attention op, its sequence descriptor, enums and backend selection."""

from fusedattn.ops.attention import explain, fused_attn
from fusedattn.ops.context_parallel import (
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from fusedattn.ops.enums import (
    BackendName,
    BiasType,
    ContextParallelStrategy,
    Fp8Format,
    Fp8Scaling,
    MaskType,
    QKVLayout,
    SequenceFormat,
    SoftmaxType,
)
from fusedattn.ops.fp8 import Fp8State, fp8_state_init
from fusedattn.ops.registry import Explanation
from fusedattn.ops.sequence import SequenceDescriptor
from fusedattn.ops.spec import AttentionSpec

__all__ = [
    "AttentionSpec", "BackendName", "BiasType", "ContextParallelStrategy", "Explanation",
    "Fp8Format", "Fp8Scaling", "Fp8State", "MaskType", "QKVLayout", "SequenceDescriptor",
    "SequenceFormat", "SoftmaxType", "explain", "fp8_state_init", "fused_attn",
    "inverse_reorder_causal_load_balancing", "reorder_causal_load_balancing",
]

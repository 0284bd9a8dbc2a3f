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
    MaskType,
    QKVLayout,
    SequenceFormat,
    SoftmaxType,
)
from fusedattn.ops.registry import Explanation
from fusedattn.ops.sequence import SequenceDescriptor
from fusedattn.ops.spec import AttentionSpec

__all__ = [
    "AttentionSpec", "BackendName", "BiasType", "ContextParallelStrategy", "Explanation", "MaskType", "QKVLayout",
    "SequenceDescriptor", "SequenceFormat", "SoftmaxType", "explain", "fused_attn",
    "inverse_reorder_causal_load_balancing", "reorder_causal_load_balancing",
]

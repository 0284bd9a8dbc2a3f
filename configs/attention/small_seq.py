"""Attention preset: opt in to the small-sequence backend (one query, <= 16 keys per segment).

THD layout: each batch row packs several (query, history) segments, described by a
SequenceDescriptor.from_seqlens_and_offsets(...) with q lengths 1 and kv lengths
<= 16; the padding mask keeps each query to its own segment. The backend stays
"auto": the small_seq kernels are taken when the call is eligible (opted in, the
declared bounds below), and explain() says why not otherwise, so the same config
runs wherever the kernels are not available.
"""

from fusedattn.configs import attention_config


def get_config():
    config = attention_config()
    config.backend = "auto"
    config.small_seq.enabled = True
    config.qkv_layout = "thd_thd_thd"
    config.mask = "padding"
    config.sequence.format = "seqlens_offsets"
    config.sequence.max_seqlen_q = 1
    config.sequence.max_seqlen_kv = 16
    return config

"""Next-item recommender on synthetic user histories (examples/small_seq).

    python examples/small_seq/main.py --workdir=/tmp/recsys --config=configs/small_seq.py

Every user is one query token (its context) cross-attending to at most 16
history items. config.model.attention comes from configs/attention/small_seq.py:
THD layout (config.data.users_per_row users packed per row), padding mask,
sequence.max_seqlen_q = 1, max_seqlen_kv = 16 and small_seq.enabled under the
"auto" backend. --config.model.attention.qkv_layout=bshd_bshd_bshd runs one user
per row instead (q [b, 1], kv [b, 16]).

Variant: --config=configs/small_seq.py:gpu (larger model and batch, bf16).
"""

import pathlib
import sys

import ml_collections

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import config_lib  # noqa: E402  (configs/ is not a package: config files load by path)


def get_config(arg: str = ""):
    if arg not in ("", "gpu"):
        raise ValueError(f"config variant {arg!r}: expected none or 'gpu' "
                         "(configs/small_seq.py:gpu).")
    config = ml_collections.ConfigDict()
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.seed = 0
    config.data.catalog_seed = 0
    config.data.batch_size = 64         # rows per step
    config.data.users_per_row = 4       # THD: users packed per row (BSHD: rows per step x this)
    config.data.num_items = 256
    config.data.num_categories = 16
    config.data.num_contexts = 4
    config.data.p_in = 0.7              # history item from the user's category
    config.data.p_follow = 0.7          # next item = successor of the latest in-category item
    config.data.zipf_exponent = 1.5
    config.data.min_history = 1
    config.data.max_history = 16

    config.model = ml_collections.ConfigDict()
    config.model.framework = "nnx"
    config.model.num_layers = 2
    config.model.d_model = 128
    config.model.num_heads = 2          # head dim 64: a size the small_seq kernels serve
    config.model.num_kv_heads = 2
    config.model.mlp_dim = 256
    config.model.dtype = "float32"
    config.model.attention = config_lib.attention_preset("small_seq")
    # THD: must be >= data.users_per_row (checked by the trainer)
    config.model.attention.sequence.max_segments_per_seq = 4

    config.optim = config_lib.optim_config(weight_decay=0.01)
    config.trainer = config_lib.trainer_config(num_steps=800, log_every=20, eval_every=200,
                                               checkpoint_every=400)

    if arg == "gpu":
        config.data.batch_size = 256
        config.data.users_per_row = 16
        config.model.attention.sequence.max_segments_per_seq = 16
        config.model.num_layers = 4
        config.model.d_model = 512
        config.model.num_heads = 8
        config.model.num_kv_heads = 8
        config.model.mlp_dim = 2048
        config.model.dtype = "bfloat16"
        config.optim.learning_rate = 1e-3
        config.trainer.num_steps = 3000
        config.trainer.log_every = 50
        config.trainer.eval_every = 500
        config.trainer.checkpoint_every = 1000
    return config

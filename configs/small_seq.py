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

import importlib.util
import pathlib

import ml_collections


def _attention_preset(name: str) -> ml_collections.ConfigDict:
    path = pathlib.Path(__file__).resolve().parent / "attention" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_attention_preset_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


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
    config.model.attention = _attention_preset("small_seq")
    config.model.attention.sequence.max_segments_per_seq = config.data.get_ref("users_per_row")

    config.optim = ml_collections.ConfigDict()
    config.optim.learning_rate = 3e-3
    config.optim.warmup_steps = 50
    config.optim.end_lr_ratio = 0.05
    config.optim.weight_decay = 0.01
    config.optim.b1 = 0.9
    config.optim.b2 = 0.98
    config.optim.eps = 1e-8
    config.optim.grad_clip = 1.0

    config.trainer = ml_collections.ConfigDict()
    config.trainer.num_steps = 800
    config.trainer.log_every = 20
    config.trainer.eval_every = 200
    config.trainer.eval_batches = 8
    config.trainer.checkpoint_every = 400
    config.trainer.keep_checkpoints = 2
    config.trainer.progress = True
    config.trainer.prefetch = 2
    config.trainer.peak_flops = 989e12  # dense bf16 peak of an H100/H200 SXM, for MFU
    config.trainer.halt_after_step = -1  # >= 0: stop there without a final checkpoint

    if arg == "gpu":
        config.data.batch_size = 256
        config.data.users_per_row = 16
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

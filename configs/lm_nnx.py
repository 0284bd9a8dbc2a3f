"""Decoder-only LM on the generated grammar corpus (examples/lm), Flax NNX model.

    python examples/lm/main.py --workdir=/tmp/lm --config=configs/lm_nnx.py
    python examples/lm/main.py --workdir=/tmp/lm --config=configs/lm_nnx.py \
        --config.model.attention.backend=xla --config.data.packing=False

The config argument after ':' is a comma-separated list of variants:
  gpu                 ~12 layers, d_model 1024, seq 2048, bf16 (H100/H200 class)
  xla, cudnn, flash   take config.model.attention from configs/attention/<name>.py
e.g. --config=configs/lm_nnx.py:gpu,cudnn.

config.model.attention is a fusedattn.configs.attention_config(); with packing
(config.data.packing, the default) documents are packed into rows and separated
by the mask "padding_causal" with sequence.format "seqlens_offsets" (per-document
lengths and offsets, computed once per step from the segment ids; "segment_ids"
works too, at the cost of reading the rows token by token in every layer); with
packing off the trainer switches to plain "causal" (one document per row).
"""

import pathlib
import sys

import ml_collections

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import config_lib  # noqa: E402  (configs/ is not a package: config files load by path)
from fusedattn.configs import attention_config

_PRESETS = ("xla", "cudnn", "flash")


def get_config(arg: str = ""):
    variants = [v for v in (arg or "").split(",") if v]
    unknown = set(variants) - {"gpu", *_PRESETS}
    if unknown:
        raise ValueError(f"config variant(s) {sorted(unknown)}: expected 'gpu' and/or one of "
                         f"{_PRESETS}, comma-separated, e.g. configs/lm_nnx.py:gpu,cudnn")
    gpu = "gpu" in variants
    config = ml_collections.ConfigDict()
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.seed = 0                # batches are a function of (seed, step)
    config.data.grammar_seed = 0        # fixes the Markov chain of the sentences
    config.data.batch_size = 16
    config.data.seq_len = 128
    config.data.packing = True
    config.data.max_docs_per_row = 16  # bounds of the packed rows (the attention's too)
    config.data.max_doc_len = 128      # longer documents are cut
    config.data.num_keys = 16
    config.data.min_pairs = 2
    config.data.max_pairs = 6
    config.data.max_sentence_len = 40
    config.data.end_prob = 0.05
    config.data.dirichlet_alpha = 0.1

    config.model = ml_collections.ConfigDict()
    config.model.framework = "nnx"      # "nnx" | "equinox"
    config.model.vocab_size = 128       # bytes (ASCII)
    config.model.num_layers = 2
    config.model.d_model = 128
    config.model.num_heads = 4
    config.model.num_kv_heads = 2       # grouped-query attention
    config.model.mlp_dim = 512
    config.model.max_len = 128          # position table; must be >= data.seq_len (checked)
    config.model.dtype = "float32"      # compute dtype; parameters stay float32
    config.model.remat = False
    # QK-clip: after each optimizer step, heads whose largest attention logit exceeded this
    # are rescaled back to it through their query and key projections (0: off; nnx model).
    config.model.qk_clip = 0.0
    attention = attention_config()
    for name in variants:
        if name in _PRESETS:
            attention = config_lib.attention_preset(name)
    attention.mask = "padding_causal"
    attention.sequence.format = "seqlens_offsets"
    config.model.attention = attention

    # Device mesh of the training step: devices along the batch ("data") and along the
    # sequence ("context": context parallelism, ring strategy, load-balanced token order).
    config.mesh = ml_collections.ConfigDict()
    config.mesh.data = 1
    config.mesh.context = 1

    config.optim = config_lib.optim_config(weight_decay=0.05)
    config.trainer = config_lib.trainer_config(num_steps=400, log_every=10, eval_every=100,
                                               checkpoint_every=200)

    if gpu:
        config.data.batch_size = 16
        config.data.seq_len = 2048
        config.model.max_len = 2048
        config.data.num_keys = 26
        config.data.max_pairs = 12
        config.data.max_docs_per_row = 32
        config.data.max_doc_len = 256
        config.model.num_layers = 12
        config.model.d_model = 1024
        config.model.num_heads = 16
        config.model.num_kv_heads = 16
        config.model.mlp_dim = 4096
        config.model.dtype = "bfloat16"
        config.optim.learning_rate = 3e-4
        config.optim.warmup_steps = 200
        config.optim.weight_decay = 0.1
        config.trainer.num_steps = 2000
        config.trainer.log_every = 20
        config.trainer.eval_every = 500
        config.trainer.checkpoint_every = 500
        # one core makes a 16 x 2048 batch in about 70 ms, as long as an H200's step
        config.trainer.data_workers = 4
    return config

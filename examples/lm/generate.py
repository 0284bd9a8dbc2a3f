r"""Generates text with the example LM, decoding through a paged KV cache.

    python examples/lm/generate.py --workdir=/tmp/fusedattn_lm --config=configs/lm_nnx.py
    python examples/lm/generate.py --workdir=/tmp/lm_gpu --config=configs/lm_nnx.py:gpu  # H200

Loads the latest checkpoint that the trainer (examples/lm/main.py, same --workdir and
--config) wrote, or first trains --train_steps steps there when there is none. Then,
for --num_prompts prompts of different lengths cut from the grammar's documents:
one prefill step for all prompts (each sequence's pages allocated from one pool,
fusedattn.layers.paged), then one token per sequence per step; a sequence that
emits EOS is freed and its pages return to the pool. It decodes greedily, then with
--temperature sampling, prints the continuations and each run's decode tokens/s (over
the steps after the first, which compiles), and checks that every greedy token is the argmax of the
full-sequence model (no cache) at its position, within float noise (1e-4 in the logit).
The NNX model serves paged decoding (config.model.framework "nnx").
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from examples.common import trainer, trees  # noqa: E402
from examples.lm import data as lm_data  # noqa: E402
from examples.lm import models, train  # noqa: E402
from fusedattn.layers import paged  # noqa: E402

TIE = 1e-4  # a greedy token within this of the full model's best logit counts as its argmax


@dataclasses.dataclass
class Run:
    """One generation: continuations (EOS included when emitted) and timings."""

    continuations: list[np.ndarray]
    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / max(self.decode_seconds, 1e-9)


def load_params(config, workdir: pathlib.Path, train_steps: int):
    """(model, params) from the latest checkpoint in workdir; trains train_steps first if none."""
    attention = train.attention_for_data(config)
    model = models.build(config.model, attention, config.seed)
    if model.paged_decoder is None:
        raise ValueError(f"config.model.framework: paged decoding is served by the 'nnx' model, "
                         f"got {config.model.framework!r}; use configs/lm_nnx.py.")
    checkpoints = trainer.Checkpoints(workdir / "checkpoints", keep=1)
    if checkpoints.latest_step() is None:
        print(f"no checkpoint in {workdir}; training {train_steps} steps first")
        checkpoints.close()
        config = _with_steps(config, train_steps)
        train.train_and_evaluate(config, workdir)
        checkpoints = trainer.Checkpoints(workdir / "checkpoints", keep=1)
    tx, _ = trainer.make_optimizer(config.optim, config.trainer.num_steps)
    trained = trees.trained_part(model.params, model.overwrite_with_gradient)
    step, state = checkpoints.restore_latest(
        {"params": model.params, "opt_state": tx.init(trained)}, report=print)
    checkpoints.close()
    print(f"loaded the checkpoint of step {step} from {workdir / 'checkpoints'}")
    return model, state["params"]


def _with_steps(config, steps: int):
    config = config.copy_and_resolve_references()
    config.trainer.num_steps = steps
    config.trainer.checkpoint_every = steps
    config.trainer.eval_every = steps
    return config


def make_prompts(config, count: int, seed: int) -> list[np.ndarray]:
    """count prompts (BOS + the first 3..24 tokens of grammar documents), lengths differ."""
    rng = np.random.default_rng(seed)
    documents = lm_data.grammar_from_config(config.data).sample(rng, count)
    return [np.asarray(d.tokens[:int(rng.integers(4, min(25, len(d.tokens)) + 1))], np.int32)
            for d in documents]


def generate(decoder, prompts: list[np.ndarray], max_new_tokens: int, page_size: int,
             num_pages: int, temperature: float, key) -> Run:
    """Prefill then decode all prompts through `decoder` (Model.paged_decoder's step)."""
    count = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    capacity = int(lengths.max()) + max_new_tokens
    pages = paged.page_table(num_pages, count, -(-capacity // page_size))
    tokens = np.zeros((count, int(lengths.max())), np.int32)
    for s, prompt in enumerate(prompts):
        tokens[s, :len(prompt)] = prompt

    start = time.perf_counter()
    pages = _allocate(pages, jnp.asarray(lengths), page_size)
    logits = decoder(jnp.asarray(tokens), pages)
    last = np.asarray(logits)[np.arange(count), lengths - 1]
    pages = _advance(pages)
    prefill_seconds = time.perf_counter() - start

    out = [[] for _ in prompts]
    active = np.ones(count, bool)
    decoded, decode_seconds = 0, 0.0
    for step in range(max_new_tokens):
        chosen = np.asarray(_choose(jnp.asarray(last), temperature, jax.random.fold_in(key, step)))
        for s in np.nonzero(active)[0]:
            out[s].append(int(chosen[s]))
        finished = active & (chosen == lm_data.EOS)
        active &= ~finished
        if not active.any() or step == max_new_tokens - 1:
            break
        start = time.perf_counter()
        pages = _allocate(_free(pages, jnp.asarray(finished)), jnp.asarray(active, jnp.int32),
                          page_size)
        last = np.asarray(decoder(jnp.asarray(chosen[:, None]), pages))[:, 0]
        pages = _advance(pages)
        if step:  # the first decode step compiles; the rate is that of the steps after it
            decode_seconds += time.perf_counter() - start
            decoded += int(active.sum())
    return Run([np.asarray(c, np.int32) for c in out], prefill_seconds, decode_seconds, decoded)


_allocate = jax.jit(paged.allocate, static_argnums=2)
_advance = jax.jit(paged.advance)
_free = jax.jit(paged.free)


@functools.partial(jax.jit, static_argnums=1)
def _choose(logits, temperature: float, key):
    """Greedy (temperature 0) or sampled next tokens from logits [S, vocab]."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1)
    return jax.random.categorical(key, logits / temperature, axis=-1)


def check_greedy(model, params, prompts, continuations) -> tuple[int, int, int]:
    """(tokens checked, exact argmax matches, tokens that are not the full model's argmax)."""
    rows = [np.concatenate([p, c[:-1]]) for p, c in zip(prompts, continuations)]
    width = max(len(r) for r in rows)
    inputs = np.zeros((len(rows), width), np.int32)
    segments = np.zeros_like(inputs)
    for s, row in enumerate(rows):
        inputs[s, :len(row)] = row
        segments[s, :len(row)] = 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), inputs.shape)
    logits = np.asarray(jax.jit(model.apply)(params, jnp.asarray(inputs), jnp.asarray(positions),
                                             jnp.asarray(segments)))
    checked = exact = wrong = 0
    for s, (prompt, cont) in enumerate(zip(prompts, continuations)):
        for t, token in enumerate(cont):
            row = logits[s, len(prompt) - 1 + t]
            checked += 1
            exact += int(np.argmax(row) == token)
            wrong += int(row.max() - row[token] > TIE)
    return checked, exact, wrong


def run(config, workdir, *, num_prompts: int = 8, max_new_tokens: int = 48,
        temperature: float = 0.8, page_size: int = 16, train_steps: int = 100,
        seed: int = 0) -> dict:
    """The whole script; returns its numbers (also printed)."""
    workdir = pathlib.Path(workdir)
    model, params = load_params(config, workdir, train_steps)
    prompts = make_prompts(config, num_prompts, seed)
    max_new_tokens = min(max_new_tokens, config.model.max_len - max(len(p) for p in prompts))
    capacity = max(len(p) for p in prompts) + max_new_tokens
    num_pages = num_prompts * -(-capacity // page_size)
    decoder = model.paged_decoder(params, num_pages, page_size)
    print(f"{num_prompts} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
          f"up to {max_new_tokens} new tokens each; paged cache: {num_pages} pages of "
          f"{page_size} tokens per layer")
    key = jax.random.key(seed)
    results = {}
    for name, temp in (("greedy", 0.0), (f"temperature {temperature}", temperature)):
        result = generate(decoder, prompts, max_new_tokens, page_size, num_pages, temp, key)
        print(f"\n{name}: prefill {result.prefill_seconds * 1e3:.1f} ms (compilation "
              f"included), decode {result.decode_tokens} tokens in "
              f"{result.decode_seconds:.3f} s after the first step: "
              f"{result.tokens_per_second:.1f} tokens/s")
        for prompt, cont in zip(prompts, result.continuations):
            print(f"  {lm_data.decode(prompt)!r} -> {lm_data.decode(cont)!r}")
        results[name] = result
    checked, exact, wrong = check_greedy(model, params, prompts,
                                         results["greedy"].continuations)
    print(f"\ngreedy vs the full-sequence model: {checked} tokens, {exact} exact argmax, "
          f"{wrong} off by more than {TIE} in the logit")
    if wrong:
        raise AssertionError(f"{wrong} greedy tokens are not the full model's argmax")
    sampled = results[f"temperature {temperature}"]
    return {"checked": checked, "exact": exact, "greedy": results["greedy"].continuations,
            "sampled": sampled.continuations, "tokens_per_second": sampled.tokens_per_second}


def main() -> None:
    from absl import app, flags, logging
    from ml_collections import config_flags

    flags.DEFINE_string("workdir", None, "The trainer's workdir (its checkpoints are loaded).")
    config_flags.DEFINE_config_file("config", None, "Trainer config file, e.g. configs/lm_nnx.py "
                                    "or configs/lm_nnx.py:gpu.", lock_config=True)
    flags.DEFINE_integer("num_prompts", 8, "Prompts decoded together.")
    flags.DEFINE_integer("max_new_tokens", 48, "New tokens per prompt at most.")
    flags.DEFINE_float("temperature", 0.8, "Temperature of the sampled run.")
    flags.DEFINE_integer("page_size", 16, "Tokens per page of the paged KV cache.")
    flags.DEFINE_integer("train_steps", 100, "Steps to train when the workdir has no checkpoint.")
    flags.DEFINE_integer("seed", 0, "Seed of the prompts and the sampling.")
    flags.mark_flags_as_required(["config", "workdir"])
    f = flags.FLAGS

    def _main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
        if not f["verbosity"].present:
            logging.set_verbosity(logging.WARNING)
        run(f.config, f.workdir, num_prompts=f.num_prompts, max_new_tokens=f.max_new_tokens,
            temperature=f.temperature, page_size=f.page_size, train_steps=f.train_steps,
            seed=f.seed)

    app.run(_main)


if __name__ == "__main__":
    main()

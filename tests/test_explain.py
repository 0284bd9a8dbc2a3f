"""explain(): every backend's verdict, the auto order, the table, the platform argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_config
from fusedattn.ops import Explanation, SequenceDescriptor, explain, fused_attn, registry

ORDER = ["small_seq", "decode", "cudnn", "flash", "xla"]
B, S, H, D = 2, 8, 4, 16


def arrays(b=B, sq=S, skv=S, h=H, h_kv=H, d=D, dtype=jnp.float32):
    return (jnp.zeros((b, sq, h, d), dtype), jnp.zeros((b, skv, h_kv, d), dtype),
            jnp.zeros((b, skv, h_kv, d), dtype))


def structs(*args, **kw):
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays(*args, **kw))


class _Fake:
    """A backend that serves everything (or refuses with a fixed reason)."""

    def __init__(self, name, reason=None):
        self.name, self.reason, self.calls = name, reason, 0

    def masked_values_exact(self, spec, platform):
        return True

    def supports(self, spec, shapes, platform):
        return self.reason

    def attention(self, spec, args, scale):
        self.calls += 1
        b, sq, h, _ = args.q.shape
        return jnp.full((b, sq, h, args.v.shape[-1]), 7.0, args.q.dtype)


@pytest.fixture
def fakes(monkeypatch):
    """Replace every registered backend by a fake serving everything; returns the dict."""
    out = {}
    for name in ORDER:
        out[name] = _Fake(name)
        monkeypatch.setitem(registry.BACKENDS, name, out[name])
    # As the real one: the calls of these tests are contiguous, which "decode" never serves.
    out["decode"].reason = "decode: serves the paged layouts only"
    return out


def test_verdict_order_and_keys():
    assert list(registry.BACKENDS) == ORDER
    e = explain(arrays(), config=make_config())
    assert isinstance(e, Explanation)
    assert list(e.verdicts) == ORDER


def test_arrays_and_shape_dtype_structs_agree():
    config = make_config(mask="padding_causal", bias="post_scale_bias")
    sequence = SequenceDescriptor.from_seqlens(np.full(B, 5, np.int32), np.full(B, 8, np.int32))
    bias = jnp.zeros((1, H, S, S))
    from_arrays = explain(arrays(), config=config, bias=bias, sequence=sequence)
    from_structs = explain(structs(), config=config,
                           bias=jax.ShapeDtypeStruct(bias.shape, bias.dtype), sequence=sequence)
    np_arrays = explain(tuple(np.zeros(a.shape, np.float32) for a in arrays()), config=config,
                        bias=np.zeros(bias.shape, np.float32), sequence=sequence)
    assert from_arrays.verdicts == from_structs.verdicts == np_arrays.verdicts
    assert from_arrays.backend == from_structs.backend == np_arrays.backend


def test_verdicts_on_cpu():
    e = explain(arrays(), config=make_config(), platform="cpu")
    assert e.verdicts["xla"] is None
    assert "cudnn: needs a CUDA GPU; this computation runs on cpu" in e.verdicts["cudnn"]
    assert "small_seq" in e.verdicts["small_seq"] and "small_seq.enabled" in e.verdicts["small_seq"]
    for name, reason in e.verdicts.items():
        assert reason is None or (isinstance(reason, str) and reason.startswith(f"{name}:"))


@pytest.mark.parametrize("platform", ["cpu", "cuda", "gpu", "rocm"])
def test_auto_takes_the_first_backend_that_serves(platform):
    for config in (make_config(), make_config(bias="alibi", mask="no_mask"),
                   make_config(small_seq={"enabled": True})):
        e = explain(arrays(), config=config, platform=platform)
        first = next(name for name in ORDER if e.verdicts[name] is None)
        assert e.backend == first
        assert e.requested == "auto"


def test_platform_argument_changes_cudnn_verdict():
    cpu = explain(arrays(), config=make_config(), platform="cpu")
    cuda = explain(arrays(), config=make_config(), platform="cuda")
    gpu = explain(arrays(), config=make_config(), platform="gpu")
    assert "needs a CUDA GPU" in cpu.verdicts["cudnn"]
    assert cuda.verdicts["cudnn"] is None or "needs a CUDA GPU" not in cuda.verdicts["cudnn"]
    assert gpu.verdicts == cuda.verdicts  # "gpu" means "cuda"
    rocm = explain(arrays(), config=make_config(), platform="rocm")
    assert "runs on rocm" in rocm.verdicts["cudnn"]


def test_default_platform_is_the_default_device():
    e = explain(arrays(), config=make_config())
    platform = registry.current_platform()
    assert e.verdicts == explain(arrays(), config=make_config(), platform=platform).verdicts
    if jax.devices()[0].platform == "cpu":
        assert platform == "cpu"


def test_str_prints_a_table_naming_each_backend():
    e = explain(arrays(), config=make_config(), platform="cpu")
    text = str(e)
    lines = text.splitlines()
    assert lines[0] == f"requested backend: auto; chosen: {e.backend}"
    assert len(lines) == 1 + len(ORDER)
    for name, line in zip(ORDER, lines[1:]):
        assert name in line
        reason = e.verdicts[name]
        assert ("ok" if reason is None else reason) in line
        assert line.startswith("->") == (name == e.backend)
    assert sum(line.startswith("->") for line in lines) == 1


def test_named_backend_that_cannot_serve_is_explained_not_raised():
    e = explain(arrays(), config=make_config(backend="cudnn"), platform="cpu")
    assert e.backend is None
    assert e.requested == "cudnn"
    assert "needs a CUDA GPU" in e.verdicts["cudnn"]
    assert "chosen: none" in str(e)
    assert not any(line.startswith("->") for line in str(e).splitlines())


def test_named_xla_is_chosen():
    e = explain(arrays(), config=make_config(backend="xla"), platform="cpu")
    assert e.backend == "xla" and e.requested == "xla"


def test_explain_agrees_with_fused_attn_choice(fakes):
    fakes["small_seq"].reason = "small_seq: no"
    fakes["cudnn"].reason = "cudnn: no"
    qkv = arrays()
    e = explain(qkv, config=make_config(), platform=registry.current_platform())
    assert e.backend == "flash"
    out = fused_attn(qkv, config=make_config())
    assert fakes["flash"].calls == 1 and fakes["xla"].calls == 0
    assert np.all(np.asarray(out) == 7.0)


# --------------------------------------------------------------------------- the auto order, with fakes

def test_auto_skips_small_seq_unless_opted_in(fakes):
    e = explain(arrays(sq=1, skv=4), config=make_config(), platform="cpu")
    assert e.backend == "cudnn"
    assert "small_seq.enabled" in e.verdicts["small_seq"]
    opted = explain(arrays(sq=1, skv=4), config=make_config(small_seq={"enabled": True}),
                    platform="cpu")
    assert opted.backend == "small_seq" and opted.verdicts["small_seq"] is None


def test_named_small_seq_needs_no_opt_in(fakes):
    e = explain(arrays(sq=1, skv=4), config=make_config(backend="small_seq"), platform="cpu")
    assert e.backend == "small_seq"


@pytest.mark.parametrize("refusing,chosen", [
    ((), "small_seq"), (("small_seq",), "cudnn"), (("small_seq", "cudnn"), "flash"),
    (("small_seq", "cudnn", "flash"), "xla"), (("cudnn",), "small_seq"),
    (("cudnn", "flash"), "small_seq"), (("small_seq", "flash"), "cudnn"),
])
def test_auto_order(fakes, refusing, chosen):
    for name in refusing:
        fakes[name].reason = f"{name}: refused for the test"
    e = explain(arrays(), config=make_config(small_seq={"enabled": True}), platform="cpu")
    assert e.backend == chosen
    for name in ORDER:
        assert (e.verdicts[name] is None) == (name not in refusing + ("decode",))


def test_nothing_serves(fakes):
    for name in ORDER:
        fakes[name].reason = f"{name}: refused for the test"
    e = explain(arrays(), config=make_config(), platform="cpu")
    assert e.backend is None
    with pytest.raises(ValueError, match="cannot serve this call"):
        fused_attn(arrays(), config=make_config())


# --------------------------------------------------------------------------- real backends on cpu

@pytest.mark.parametrize("config_kw", [
    {}, {"bias": "alibi"}, {"mask": "padding_causal"}, {"qkv_layout": "thd_thd_thd"},
    {"softmax": "learnable"}, {"dropout_rate": 0.1}, {"window_size": (2, 0)},
])
def test_xla_serves_everything(config_kw):
    config = make_config(**config_kw)
    qkv = arrays()
    sequence = None
    if config.mask.startswith("padding") or config.qkv_layout.startswith("t"):
        sequence = SequenceDescriptor.from_seqlens(np.full(B, 4, np.int32),
                                                   np.full(B, 4, np.int32))
    for platform in ("cpu", "cuda", "rocm"):
        e = explain(qkv, config=config, sequence=sequence, platform=platform)
        assert e.verdicts["xla"] is None
        assert e.backend is not None


def test_small_seq_opted_in_explains_its_reason():
    config = make_config(small_seq={"enabled": True},
                         sequence={"max_seqlen_q": 1, "max_seqlen_kv": 8})
    e = explain(arrays(sq=1, skv=8), config=config, platform="cpu")
    reason = e.verdicts["small_seq"]
    assert reason is None or reason.startswith("small_seq:")
    assert "small_seq.enabled" not in (reason or "")  # opted in: another reason, or none


def test_explain_with_dtypes():
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        e = explain(structs(dtype=dtype), config=make_config(), platform="cpu")
        assert e.verdicts["xla"] is None

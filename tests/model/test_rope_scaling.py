"""RoPE scaling (``model.rope_scaling``): the frequencies and attention factor equal transformers' own rope init
functions for every supported type; bad fields are one-line errors.

Tolerance: we compute the frequencies in float64 and round once to float32, transformers computes them in float32;
the two agree to a few float32 ulps (measured max relative difference ~2e-7), so 1e-6 relative."""
from __future__ import annotations

import pytest
import torch

from megatron_lc.config import ConfigError, load_config
from megatron_lc.model.rope import RotaryEmbedding, rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

CASES = [
    ("default", None),
    ("linear", {"rope_type": "linear", "factor": 4.0}),
    ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    ("yarn-betas-mscale", {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048,
                           "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0}),
]


@pytest.mark.parametrize("name,scaling", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("head_dim,base", [(64, 500000.0), (128, 1e6)])
def test_frequencies_equal_transformers(name, scaling, head_dim, base):
    hf_cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=131072,
                                      rope_parameters={**(scaling or {"rope_type": "default"}), "rope_theta": base})
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        ref, ref_af = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(
            hf_cfg)
    else:
        ref, ref_af = ROPE_INIT_FUNCTIONS[kind](hf_cfg)
    ours, af = rope_frequencies(head_dim, base, load_config(None, [f"model.rope_scaling={scaling}" if scaling
                                                                   else "model.rope_scaling=null"]).model.rope_scaling)
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0), (ours - ref).abs().max()
    assert af == pytest.approx(ref_af, rel=1e-12)
    if kind != "default":  # the scaling really changes something (the test is not vacuous)
        assert not torch.allclose(ours, rope_frequencies(head_dim, base)[0], rtol=1e-3)


def test_yarn_scales_cos_and_sin():
    rope = RotaryEmbedding(64, 1e4, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
    cos, sin = rope(torch.zeros(1, 1, dtype=torch.long))
    assert rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    assert torch.allclose(cos, torch.full_like(cos, rope.attention_factor)) and torch.all(sin == 0)


@pytest.mark.parametrize("value,message", [
    ("{rope_type: dynamic, factor: 2}", "rope_type 'dynamic' is not supported; valid: linear, llama3, yarn"),
    ("{rope_type: llama3, factor: 8}", r"\(llama3\) needs low_freq_factor, high_freq_factor, "
                                       "original_max_position_embeddings"),
    ("{rope_type: linear, factor: 2, beta_fast: 3}", r"\(linear\): unknown field 'beta_fast'; valid: factor"),
    ("{factor: 2}", r"fields \['factor'\] need a rope_type"),
    ("{rope_type: linear, factor: 0.5}", r"rope_scaling.factor \(0.5\) must be >= 1"),
])
def test_bad_rope_scaling_is_a_one_line_error(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"model.rope_scaling={value}"])


def test_older_hf_names_are_accepted():
    m = load_config(None, ["model.rope_scaling={type: linear, factor: 2, rope_theta: 5.0e5}"]).model
    assert m.rope_scaling == {"rope_type": "linear", "factor": 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_is_the_formula_bit_for_bit_with_fewer_fp32_temporaries(dtype):
    """``apply_rotary`` writes ``x·cos + rotate_half(x)·sin`` half by half into one fp32 buffer: the same values and
    gradients, bit for bit, as the formula, with at most 1.5 x-sized fp32 tensors above its output (the formula held
    3.5: at one GPU and 512K tokens 28 GiB for q, seen by the rehearsal)."""
    from megatron_lc.model.rope import apply_rotary
    from megatron_lc.planning.capture.tracker import DispatchTracer

    def formula(x, cos, sin):
        x1, x2 = x.float().chunk(2, dim=-1)
        return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

    torch.manual_seed(0)
    x = torch.randn(64, 2, 4, 16, dtype=dtype, requires_grad=True)
    angle = torch.randn(64, 2, 1, 16)
    cos, sin, g = angle.cos(), angle.sin(), torch.randn(64, 2, 4, 16, dtype=dtype)
    extra = {}
    for name, fn in (("formula", formula), ("ours", apply_rotary)):
        with DispatchTracer() as tracker:
            start, live = len(tracker.events), 0
            y = fn(x, cos, sin)
            peak = 0
            for e in tracker.events[start:]:
                live += e.size if e.op == "malloc" else -e.size
                peak = max(peak, live)
        extra[name] = (peak, y, torch.autograd.grad(y, x, g)[0])
    assert torch.equal(extra["formula"][1], extra["ours"][1]) and torch.equal(extra["formula"][2], extra["ours"][2])
    fp32 = x.numel() * 4
    assert extra["ours"][0] <= 1.5 * fp32 + x.numel() * x.element_size() < extra["formula"][0], extra

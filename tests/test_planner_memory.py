"""The planner's model shapes and memory accounting, against published counts and hand computations."""

from __future__ import annotations

import math
import re

import pytest

from parallelkit.planner import MODELS, ModelShape, in_flight, layer_activation_bytes, state_bytes
from parallelkit.planner.layout import Layout, check, memory_per_device

# Parameter counts as their authors publish them: GPT-2 XL's checkpoint (Radford et al., 2019; the
# Hugging Face model's 1,557,611,200 weights), Llama 3's safetensors totals in Meta's releases.
PUBLISHED = {"gpt2-xl": 1_557_611_200, "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496}


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_equal_the_published_ones(name):
    assert MODELS[name].params == PUBLISHED[name]


def test_flops_per_token_are_palms_count():
    llama = MODELS["llama3-8b"]  # 6 N + 12 L s d
    assert llama.flops_per_token() == 6 * 8_030_261_248 + 12 * 32 * 8192 * 4096


def test_a_mixture_of_experts_counts_every_expert_and_computes_with_top_k():
    dense = ModelShape(2, 64, 4, 256, 100, 16)
    moe = ModelShape(2, 64, 4, 256, 100, 16, experts=8, top_k=2)
    expert = 3 * 64 * 256
    assert moe.params == dense.params + 2 * (7 * expert + 64 * 8)  # 7 more experts and a router a layer
    assert moe.active_params == dense.params + 2 * (expert + 64 * 8)


def test_zero_stages_give_the_papers_figure_1():
    """7.5B parameters on 64 devices, mixed-precision Adam (K = 12): 120, 31.4, 16.6 and 1.9 GB."""
    gb = [sum(state_bytes(7.5e9, data=64, zero=stage)) / 1e9 for stage in range(4)]
    assert gb == pytest.approx([120.0, 31.40625, 16.640625, 1.875])
    assert state_bytes(1000, data=4, zero=2, precision="fp32") == (4000, 1000, 2000)  # 4 + 4/4 + 8/4


# The paper's GPT block: s = 2048, b = 1, h = 12288, a = 96 (GPT-3 175B), t = 8.
S, B, H, A, T = 2048, 1, 12288, 96, 8
GPT3 = ModelShape(layers=96, d_model=H, heads=A, ffn=4 * H, vocab=51200, seq=S, gated=False)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, S * B * H * (34 + 5 * A * S / H)),
        ({"tensor": T}, S * B * H * (10 + 24 / T + 5 * A * S / (H * T))),
        ({"tensor": T, "sequence_parallel": True}, S * B * H / T * (34 + 5 * A * S / H)),
        ({"tensor": T, "sequence_parallel": True, "recompute": "selective"}, 34 * S * B * H / T),
        ({"tensor": T, "recompute": "full"}, 2 * S * B * H),
        ({"tensor": T, "sequence_parallel": True, "recompute": "full"}, 2 * S * B * H / T),
    ],
    ids=["none", "tensor", "tensor+sp", "selective", "full", "full+sp"],
)
def test_activations_are_korthikantis_formulas(kwargs, expected):
    """Section 4 and Table 2 of Korthikanti et al. (2022), one layer, 16-bit activations."""
    assert layer_activation_bytes(GPT3, B, **kwargs) == pytest.approx(expected, rel=1e-12)


def test_a_gated_mlp_and_grouped_heads_count_their_own_arrays():
    llama = MODELS["llama3-8b"]
    s, h, kv, f, a = 8192, 4096, 1024, 14336, 32
    by_hand = (
        8 * s * h  # norm inputs (2 + 2), the blocks' inputs (2 + 2); Llama has no dropout masks
        + 2 * s * h + 2 * s * kv + 2 * s * kv + 2 * s * h  # Q, K, V, the output projection's input
        + 4 * 2 * s * f  # gate, up, SiLU(gate) and their product, 2 bytes each
        + 2 * a * s * s  # the probabilities, kept once (no dropout)
    )  # fmt: skip
    assert layer_activation_bytes(llama, 1) == by_hand
    assert layer_activation_bytes(llama, 1, element_bytes=4) == 2 * by_hand  # float32: every array twice


def test_dropout_masks_cost_a_byte_an_entry():
    llama, s, h, a = MODELS["llama3-8b"], 8192, 4096, 32
    with_dropout = ModelShape(32, 4096, 32, 14336, 128256, 8192, kv_heads=8, dropout=True)
    masks = 2 * s * h + a * s * s  # the blocks' two masks; the probabilities' mask, and their dropped copy (2 bytes)
    assert layer_activation_bytes(with_dropout, 1) - layer_activation_bytes(llama, 1) == masks + 2 * a * s * s


def test_context_parallelism_splits_the_tokens_and_each_method_holds_its_own_scores():
    llama = MODELS["llama3-8b"]
    s, a, c, kv = 8192, 32, 4, 1024
    alone = layer_activation_bytes(llama, 1, recompute="selective")
    received = 2 * 2 * (c - 1) * s / c * kv  # the other devices' K and V blocks, 16-bit
    for method, extra in [("ring", received), ("allgather", received), ("ulysses", 0)]:
        flash = layer_activation_bytes(llama, 1, context=c, context_method=method, recompute="selective")
        assert flash == pytest.approx(alone / c + extra), method
        kept = layer_activation_bytes(llama, 1, context=c, context_method=method)
        assert kept - flash == pytest.approx(2 * a * s / c * s), method  # s/c x s probabilities (a/c heads of s x s)


def test_microbatches_in_flight_by_schedule():
    assert [in_flight("gpipe", 4, m) for m in (1, 4, 16)] == [1, 4, 16]
    assert [in_flight("1f1b", 4, m) for m in (1, 4, 16)] == [1, 4, 4]
    assert in_flight("gpipe", 1, 16) == 1  # one stage: the microbatches are accumulation steps, one at a time


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ModelShape(2, 10, 3, 8, 8, 8), "does not split into heads=3"),
        (lambda: ModelShape(2, 8, 4, 8, 8, 8, kv_heads=3), "do not group into kv_heads=3"),
        (lambda: ModelShape(0, 8, 2, 8, 8, 8), r"layers=0"),
        (lambda: state_bytes(1, zero=4), "zero=4"),
        (lambda: state_bytes(1, precision="int8"), "precision='int8'"),
        (lambda: layer_activation_bytes(GPT3, 1, recompute="some"), "recompute='some'"),
        (lambda: in_flight("zb", 2, 2), "schedule='zb'"),
    ],
)
def test_bad_input_names_what_is_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- a layout's memory per device ------------------------------------------------------------------

LLAMA = MODELS["llama3-8b"]
N, S8, H8, KV8, F8, A8 = 8_030_261_248, 8192, 4096, 1024, 14336, 32


def per_layer(b: int, t: int = 1, sp: bool = False) -> float:
    """Llama 3 8B's layer by hand, without its scores (selective recomputation), microbatch b, tensor t."""
    outer = 8 * S8 * b * H8  # no dropout masks
    inner = (4 * S8 * b * H8 + 4 * S8 * b * KV8) + 8 * S8 * b * F8
    return outer / (t if sp else 1) + inner / t


def test_fully_sharded_with_full_recomputation_by_hand():
    m = memory_per_device(LLAMA, Layout(data=8, zero=3, recompute="full"), batch=8)
    assert (m.params, m.grads, m.optimizer) == pytest.approx((2 * N / 8, 2 * N / 8, 12 * N / 8))
    rebuilt = per_layer(1)  # the layer being recomputed: its arrays, attention block by block (no scores)
    assert m.activations == 32 * 2 * S8 * 1 * H8 + rebuilt  # each layer's 16-bit input, one sequence a device


def test_tensor_and_sequence_parallel_by_hand():
    layout = Layout(data=2, tensor=4, sequence_parallel=True, recompute="selective")
    m = memory_per_device(LLAMA, layout, batch=4)  # 2 sequences a replica
    assert m.state == pytest.approx(16 * N / 4)
    assert m.activations == pytest.approx(32 * per_layer(2, t=4, sp=True))


def test_a_1f1b_first_stage_holds_every_layers_worth_and_gpipe_every_microbatch():
    one = memory_per_device(LLAMA, Layout(recompute="selective"), batch=1).activations
    kw = {"stages": 4, "microbatches": 8, "recompute": "selective"}
    assert memory_per_device(LLAMA, Layout(schedule="1f1b", **kw), batch=8).activations == pytest.approx(one)
    assert memory_per_device(LLAMA, Layout(schedule="gpipe", **kw), batch=8).activations == pytest.approx(2 * one)
    assert memory_per_device(LLAMA, Layout(microbatches=8, recompute="selective"), batch=8).activations == one


def test_expert_weights_split_over_the_expert_axis():
    moe = ModelShape(4, 256, 4, 512, 1000, 128, experts=8, top_k=2)
    experts = 4 * 8 * moe.expert_params
    m = memory_per_device(moe, Layout(data=2, expert=4), batch=8, precision="fp32")
    assert m.params == pytest.approx(4 * ((moe.params - experts) + experts / 4))


@pytest.mark.parametrize(
    ("layout", "batch", "reason"),
    [
        (Layout(data=3), 8, "does not split into 3 replicas"),
        (Layout(tensor=3), 6, r"tensor=3 does not divide the heads \(32\)"),
        (Layout(context=3), 3, "tokens do not split"),
        (Layout(stages=64), 64, "64 stages for 32 layers"),
        (Layout(expert=2), 2, "expert=2 does not divide the model's 0 experts"),
    ],
)
def test_a_layout_that_cannot_run_says_why(layout, batch, reason):
    assert re.search(reason, check(LLAMA, layout, batch))
    with pytest.raises(ValueError, match=reason):
        memory_per_device(LLAMA, layout, batch)


def test_layout_errors_and_names():
    with pytest.raises(ValueError, match=r"sequence_parallel=True\) splits the tokens over the tensor axis"):
        Layout(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"Layout\(data=0\)"):
        Layout(data=0)
    layout = Layout(data=2, tensor=4, sequence_parallel=True, zero=1, stages=2, microbatches=8, recompute="full")
    assert layout.name == "data 2 x tensor 4 x stages 2 (SP), ZeRO-1, 1f1b m=8, remat full" and layout.devices == 16


def _by_hand(model: ModelShape, b: int, t: int = 1, sp: bool = False, c: int = 1, selective: bool = False) -> float:
    """One layer's 16-bit activations written out in the paper's terms, for any published shape (ring attention)."""
    s, h, f, a, kv = model.seq / c, model.d_model, model.ffn, model.heads, model.kv_heads_ * model.head_dim
    masks = 1 if model.dropout else 0
    outer = (8 + 2 * masks) * s * b * h  # two norms' inputs and the two blocks' inputs at 2 bytes, their masks at 1
    inner = 2 * (2 * s * b * h + 2 * s * b * kv) + 2 * (4 if model.gated else 2) * s * b * f  # Q, K, V, O; the MLP
    scores = 0 if selective else (5 if model.dropout else 2) * a * s * model.seq * b  # s/c queries x every key
    received = 2 * 2 * (c - 1) * s * b * kv  # the other blocks' K and V a ring brings
    return outer / (t if sp else 1) + (inner + scores + received) / t


def _tensor(m: ModelShape) -> int:
    return 5 if m.heads % 4 else 4  # GPT-2 XL's 25 heads split 5 ways, the Llamas' 4 ways


def _sp(m: ModelShape) -> bool:
    return m.seq % _tensor(m) == 0  # sequence parallelism where the tokens split too (not GPT-2 XL's 1024 over 5)


@pytest.mark.parametrize("name", PUBLISHED)
@pytest.mark.parametrize(
    ("layout", "batch", "hand"),
    [
        (lambda m: Layout(data=8, zero=3), 8, lambda m: m.layers * _by_hand(m, 1)),
        (lambda m: Layout(data=2, tensor=_tensor(m), sequence_parallel=_sp(m)), 4,
         lambda m: m.layers * _by_hand(m, 2, t=_tensor(m), sp=_sp(m))),
        (lambda m: Layout(data=2, context=4, zero=1), 2, lambda m: m.layers * _by_hand(m, 1, c=4)),
        (lambda m: Layout(data=2, stages=4, microbatches=8, recompute="selective"), 16,
         lambda m: math.ceil(m.layers / 4) * 4 * _by_hand(m, 1, selective=True)),  # 1F1B: 4 microbatches in flight
        (lambda m: Layout(data=8, zero=2, microbatches=2, recompute="full"), 16,
         lambda m: m.layers * 2 * m.seq * m.d_model + _by_hand(m, 1, selective=True)),  # inputs; one layer rebuilt
    ],
    ids=["zero3", "tensor-sp", "context-ring", "1f1b-selective", "zero2-accumulate-full"],
)  # fmt: skip
def test_every_layout_kind_by_hand_for_each_published_shape(name, layout, batch, hand):
    """State exact (16 bytes a parameter over the model-parallel split, then ZeRO); activations the paper's terms."""
    model = MODELS[name]
    layout = layout(model)
    m = memory_per_device(model, layout, batch)
    per = model.params / (layout.tensor * layout.stages)  # tensor x stages split every weight
    zero_over = layout.data * layout.context
    expected = (2 * per / (zero_over if layout.zero >= 3 else 1), 2 * per / (zero_over if layout.zero >= 2 else 1),
                12 * per / (zero_over if layout.zero >= 1 else 1))  # fmt: skip
    assert (m.params, m.grads, m.optimizer) == pytest.approx(expected, rel=1e-12)
    assert m.activations == pytest.approx(hand(model), rel=1e-12)


def test_zero_splits_the_dense_state_over_the_expert_axis_too_and_the_experts_over_data():
    moe = ModelShape(4, 256, 4, 512, 1000, 128, experts=8, top_k=2)
    experts = 4 * 8 * moe.expert_params
    m = memory_per_device(moe, Layout(data=2, expert=4, zero=3), batch=8, precision="fp32")
    assert m.params == pytest.approx(4 * ((moe.params - experts) / 8 + experts / 4 / 2))  # dense / (4 x 2)


def test_the_device_counted_is_the_first_stage_or_the_last_with_its_logits():
    from parallelkit.planner.layout import activations

    gpipe = activations(LLAMA, Layout(stages=4, microbatches=8, schedule="gpipe", recompute="full"), 8)
    assert (gpipe.layers, gpipe.in_flight, gpipe.last_stage) == (8, 8, True)  # the same layers, and the logits
    one_f = activations(LLAMA, Layout(stages=4, microbatches=8, recompute="selective"), 8)
    assert (one_f.layers, one_f.in_flight, one_f.last_stage, one_f.logits) == (8, 4, False, 0.0)

"""The closed-form bounds notebooks 02, 04 and 05 derive, held to the cost model, and every notebook's length.

Each bound is a sentence of a notebook: data parallelism's tokens per device (02), tensor
parallelism's width (05) and the workers one parameter-server link carries (04). The cost model
must agree with each where the notebook says it does, for chips and links other than the H100
the notebooks evaluate, and the numbers their prose quotes must follow from the published figures.
Two of the exercises built on them (05's choice, 04's fewest shards) must judge a wrong answer
wrong and the derived one right.
"""

from __future__ import annotations

import math

import nbformat
import pytest
from helpers import NOTEBOOKS

import parallelkit as pk
from parallelkit import costmodel as cm
from parallelkit.measure import hardware

H100 = hardware.PUBLISHED["H100 SXM"]
MAX_CELLS = 45  # the course's guide: one idea a notebook, taught in one sitting
GPT2_XL = pk.planner.MODELS["gpt2-xl"].params


def data_parallel_tokens(n: int, b: float, flops: float, bandwidth: float) -> float:
    """02's bound: the tokens per device from which the ring all-reduce is no longer than the compute."""
    return (n - 1) / n * b * flops / (3 * bandwidth)


def tensor_parallel_width(k: int, flops: float, bandwidth: float) -> float:
    """05's bound: the width from which a Megatron block's two all-reduces are no longer than its compute."""
    return (k - 1) / 6 * flops / bandwidth


def workers_per_server_link(tokens: float, flops: float, bandwidth: float) -> float:
    """04's bound: the workers one parameter-server link carries while the links keep up with the compute."""
    return 3 / 4 * tokens * bandwidth / flops


LINKS = [("nvlink4", 1), ("ib-ndr", 8), ("ib-hdr", 4), ("100gbe", 8)]  # (preset, devices: one a machine over it)


@pytest.mark.parametrize("chip", ["H100 SXM", "A100 SXM 80GB", "B200"])
@pytest.mark.parametrize(("preset", "n"), LINKS)
def test_data_parallelism_bound_is_where_the_cost_models_all_reduce_equals_the_compute(chip, preset, n):
    flops, link = hardware.PUBLISHED[chip].bf16_flops, cm.PRESETS[preset]
    cluster = cm.Cluster(n, 1, cm.PRESETS["nvlink4"], link) if n > 1 else cm.Cluster(1, 8, link)
    devices = cluster.devices
    tokens = data_parallel_tokens(devices, 4, flops, link.beta)
    work = cm.Workload(4 * GPT2_XL, batch_per_device=round(tokens), flops_per_sample=6 * GPT2_XL, peak_flops=flops)
    step = cm.predict(work, cluster, "mirrored")
    assert step.communication_s / step.compute_s == pytest.approx(1, rel=0.01)


@pytest.mark.parametrize("chip", ["H100 SXM", "A100 SXM 80GB", "B200"])
@pytest.mark.parametrize(("preset", "k"), [("nvlink4", 8), ("nvlink3", 4), ("ib-ndr", 8)])
def test_tensor_parallelism_bound_is_a_width_the_batch_does_not_move(chip, preset, k):
    flops, link = hardware.PUBLISHED[chip].bf16_flops, cm.PRESETS[preset]
    cluster = cm.Cluster(1, k, link) if preset.startswith("nvlink") else cm.Cluster(k, 1, cm.PRESETS["nvlink4"], link)
    width = tensor_parallel_width(k, flops, link.beta)
    ratios = []
    for tokens in (131_072, 1_048_576):
        block = cm.Workload(0, batch_per_device=tokens, flops_per_sample=48 * width**2, peak_flops=flops,
                            activation_allreduces=(2 * width, 2 * width))  # fmt: skip
        step = cm.predict(block, cluster, "tensor")
        ratios.append(step.communication_s / step.compute_s)
    assert ratios == pytest.approx([1, 1], rel=0.01) and ratios[1] <= ratios[0]  # the rest: the latencies


@pytest.mark.parametrize("tokens", [32_768, 65_536, 98_304, 131_072])
@pytest.mark.parametrize("workers", [16, 32, 64])
def test_the_fewest_shards_by_hand_are_the_cost_models_fewest(tokens, workers):
    per_link = workers_per_server_link(tokens, H100.bf16_flops, H100.network_bytes_per_s)
    assert per_link >= 1, "below 4/3 x F/B tokens a worker's own link cannot keep up"
    fewest = math.ceil(workers / per_link)
    cluster = cm.Cluster(workers, 1, cm.PRESETS["nvlink4"], cm.PRESETS["ib-ndr"])
    work = cm.Workload(4 * GPT2_XL, batch_per_device=tokens, flops_per_sample=6 * GPT2_XL, peak_flops=H100.bf16_flops)

    def keeps_up(shards: int) -> bool:
        p = cm.predict(work, cluster, "parameter_server", shards=shards)
        return p.communication_s <= p.compute_s

    assert keeps_up(fewest) and not keeps_up(fewest - 1)


def test_below_four_thirds_f_over_b_tokens_no_number_of_shards_keeps_up():
    tokens = 4 / 3 * H100.bf16_flops / H100.network_bytes_per_s * 0.9
    cluster = cm.Cluster(8, 1, cm.PRESETS["nvlink4"], cm.PRESETS["ib-ndr"])
    work = cm.Workload(4 * GPT2_XL, batch_per_device=round(tokens), flops_per_sample=6 * GPT2_XL,
                       peak_flops=H100.bf16_flops)  # fmt: skip
    for shards in (1, 8, 64, 1024):
        p = cm.predict(work, cluster, "parameter_server", shards=shards)
        assert p.communication_s > p.compute_s


def test_the_numbers_the_prose_quotes_follow_from_the_h100s_figures():
    over_ib = data_parallel_tokens(8, 4, H100.bf16_flops, H100.network_bytes_per_s)
    on_nvlink = data_parallel_tokens(8, 4, H100.bf16_flops, H100.link_bytes_per_s)
    assert over_ib > 20_000 and round(over_ib / on_nvlink) == 9  # 02: "more than 20,000", "nine times fewer"
    assert 1_000 < 0.4 * on_nvlink < 1_050  # 02: "at 40 % of the peak ... about 1,000 tokens"
    assert 2_000 < tensor_parallel_width(8, H100.bf16_flops, H100.link_bytes_per_s) < 3_000  # 05: "a few thousand"
    assert tensor_parallel_width(8, H100.bf16_flops, H100.network_bytes_per_s) > 20_000  # 05: "more than 20,000"
    carried = [workers_per_server_link(t, H100.bf16_flops, H100.network_bytes_per_s) for t in (32_768, 131_072)]
    assert 1 < carried[0] and carried[1] < 5.5  # 04: "one to five workers, even at 32,768 to 131,072 tokens"
    assert 8_192 * 2.5 < tensor_parallel_width(8, H100.bf16_flops, H100.network_bytes_per_s) < 8_192 * 3  # 05


def test_data_parallelism_beats_tensor_parallelism_when_the_tokens_exceed_the_width():
    """05's choice: with n = k = 8, float32 gradients and bf16 activations, both ratios are 7 F / 6 B over T or h."""
    node = cm.Cluster(1, 8, cm.PRESETS["nvlink4"])
    for width, tokens, shorter in ((1600, 4096, "data"), (4096, 1600, "tensor")):
        n_params = 8 * width**2 * 48
        shared = dict(batch_per_device=tokens, flops_per_sample=6 * n_params, peak_flops=H100.bf16_flops)
        layouts = {
            "tensor": cm.predict(cm.Workload(4 * n_params, activation_allreduces=(2 * width,) * 96, **shared), node,
                                 "tensor"),
            "data": cm.predict(cm.Workload(4 * n_params, **shared), node, "mirrored"),
        }  # fmt: skip
        assert min(layouts, key=lambda name: layouts[name].step_s) == shorter


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_notebook_is_taught_in_one_sitting(path):
    cells = len(nbformat.read(path, as_version=4).cells)
    assert cells <= MAX_CELLS, f"{path.name} has {cells} cells, over {MAX_CELLS}: one idea, taught in one sitting"


PUBLISHED_RUNS = "cost_model.md#the-cost-model-against-published-runs"  # where 02's published comparisons went


def test_what_02_moved_out_is_on_the_page_it_links():
    """02's comparisons with published runs (Horovod, a saturating parameter server, the hierarchical
    all-reduce timed) sit in a section of the cost model's page that 02 links, with their code."""
    notebook = next(p for p in NOTEBOOKS if p.stem == "02_collectives_and_scaling")
    markdown = " ".join(c.source for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "markdown")
    assert f"../docs/{PUBLISHED_RUNS}" in markdown
    page = (NOTEBOOKS[0].parents[1] / "docs" / "cost_model.md").read_text()
    section = page.split("\n## The cost model against published runs\n", 1)[1].split("\n## ", 1)[0]
    for taught in ("### The hierarchical all-reduce, timed", "### Horovod's 90 %", "### A parameter server saturating",
                   "def forward_only", "the parameter-server notebook (04)"):  # fmt: skip
        assert taught in section, taught


def _exercise(stem: str, cell_id: str) -> tuple[str, str]:
    """An exercise cell's source and its hidden solution's (the code cell after it)."""
    cells = [c for c in nbformat.read(next(p for p in NOTEBOOKS if p.stem == stem), as_version=4).cells]
    at = [c.id for c in cells].index(cell_id)
    solution = next(c for c in cells[at + 1 :] if c.cell_type == "code")
    assert "solution" in solution.metadata.get("tags", []), f"{stem} {cell_id} has no hidden solution after it"
    return cells[at].source, solution.source


def _judged(source: str, prediction: object, names: dict, capsys) -> bool | None:
    """Run an exercise cell with ``prediction`` entered (and a sentence of reasons); the check's verdict."""
    entered = source.replace("prediction = None", f"prediction = {prediction!r}", 1)
    entered = entered.replace('reasons = ""', 'reasons = "the tokens per device exceed the width"', 1)
    assert entered != source, "the cell sets no prediction = None"
    exec(compile(entered, "<exercise>", "exec"), names)
    out = capsys.readouterr().out
    return "right" in out and "not quite" not in out


# The names the two exercises read from the cells above them, as those cells define them.
CHOICE_NAMES = {"cm": cm, "h100": H100, "nvlink4": cm.PRESETS["nvlink4"]}
SHARDS_NAMES = {"cm": cm, "h100": H100, "gpt2_xl": GPT2_XL, "math": math,
                "f_over_b": H100.bf16_flops / H100.network_bytes_per_s}  # fmt: skip


@pytest.mark.parametrize(
    ("stem", "cell_id", "names", "right", "wrong", "stated"),
    [
        ("05_model_parallel", "c05-ex1", CHOICE_NAMES, "data", "tensor", 'shorter == "data"'),
        ("04_parameter_servers", "c03-ex1", SHARDS_NAMES, 18, 17, "== 18"),
    ],
    ids=["05-choice", "04-shards"],
)
def test_a_new_exercise_fails_a_wrong_answer_and_passes_the_derived_one(stem, cell_id, names, right, wrong, stated,
                                                                        capsys):  # fmt: skip
    exercise, solution = _exercise(stem, cell_id)
    assert stated in solution, f"{stem}'s hidden solution no longer derives {right!r}"
    assert _judged(exercise, right, {"pk": pk, **names}, capsys) is True
    assert _judged(exercise, wrong, {"pk": pk, **names}, capsys) is False

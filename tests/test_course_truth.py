"""Claims the course makes, held to what the code, the records and the notebooks they name say.

Each test takes one sentence of the notebooks, the README or the docs and checks it against its
source: the arithmetic of a notebook's own solution, the schedules, the planner's record, the
notebook a reference points at, the flags of the installed XLA.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from functools import cache

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import parallelkit as pk
from parallelkit.course import arc
from parallelkit.strategies.pipeline import schedules
from parallelkit.strategies.pipeline import stages as programs

NOTEBOOKS = ROOT / "notebooks"


@cache
def _cells(stem: str) -> dict[str, dict]:
    """A notebook's cells by id (``stem`` is the file name's start, e.g. ``"09"``)."""
    (path,) = NOTEBOOKS.glob(f"{stem}_*.ipynb")
    return {cell["id"]: cell for cell in json.loads(path.read_text())["cells"]}


def _source(stem: str, cell_id: str) -> str:
    """One cell's source, block quotes' markers dropped and every run of whitespace as one space."""
    return re.sub(r"\s+", " ", re.sub(r"\n>", "\n", "".join(_cells(stem)[cell_id]["source"])))


def _code(cells: dict[str, dict]) -> list[str]:
    return ["".join(c["source"]) for c in cells.values() if c["cell_type"] == "code"]


def _markdown(stem: str) -> str:
    return " ".join(_source(stem, i) for i, cell in _cells(stem).items() if cell["cell_type"] == "markdown")


def _doc(*parts: str) -> str:
    return re.sub(r"\s+", " ", ROOT.joinpath(*parts).read_text())


# --- Notebook 01: the whole-block ring of exercise 3 -------------------------------------------------------------


def _solution_ring_all_reduce():
    """The ``ring_all_reduce`` of notebook 01's hidden solution, defined alone (its checker left out)."""
    tree = ast.parse("".join(_cells("01")["c01-ex4-solution"]["source"]))
    (found,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "ring_all_reduce"]
    namespace = {"jax": jax}
    exec(compile(ast.Module(body=[found], type_ignores=[]), "notebook 01", "exec"), namespace)
    return namespace["ring_all_reduce"]


def _bytes_sent(fn, mesh: Mesh, blocks: jax.Array) -> list[int]:
    """Per device, the bytes ``fn`` sends, read from the collective-permutes of its compiled program."""
    on_mesh = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    return pk.collectives.sent_bytes(pk.inspect.collectives(on_mesh, blocks), mesh.size)["all"]


@pytest.mark.parametrize("n", [4, 8])
def test_passing_whole_blocks_sends_n_over_2_times_the_bandwidth_optimal_ring(n):
    """Notebook 01, exercise 3: each device sends n - 1 whole blocks, the ring of notebook 02 2(n - 1)/n of one."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    blocks = jax.device_put(np.arange(n * 64.0, dtype=np.float32).reshape(n, 64), NamedSharding(mesh, P("data")))
    whole = _bytes_sent(_solution_ring_all_reduce(), mesh, blocks)
    optimal = _bytes_sent(lambda x: pk.collectives.ring_allreduce(x, "data"), mesh, blocks)
    block = 64 * 4
    assert whole == [(n - 1) * block] * n
    assert optimal == [2 * (n - 1) * block // n] * n
    assert whole[0] / optimal[0] == n / 2


def test_notebook_01_says_n_over_2_not_about_twice():
    text = _source("01", "c01-ex4-md")
    assert "about twice" not in text
    assert "*n*/2 times" in text and "4 times on the 8 devices" in text
    assert any("N_DEVICES = 8 " in code for code in _code(_cells("01")))  # the 8 devices it names


# --- Notebook 09: what the schedules' formulas and memory say -----------------------------------------------------


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (3, 6), (4, 8)])
def test_zb_h1_keeps_1f1b_peak_and_raises_the_later_stages_to_it(stages, microbatches):
    one_f_one_b = schedules.peak_in_flight(schedules.one_f_one_b_schedule(stages, microbatches))
    zero_bubble = schedules.peak_in_flight(schedules.zero_bubble_schedule(stages, microbatches))
    assert one_f_one_b[0] == zero_bubble[0] == stages  # the first stage: p under both
    assert max(one_f_one_b.values()) == max(zero_bubble.values())  # the peak over the stages: the same
    assert all(zero_bubble[s] == stages > one_f_one_b[s] for s in range(1, stages))


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8)])
def test_zb_h1_passes_are_no_shorter_its_idle_time_per_boundary_falls_to_one_forward_pass(stages, microbatches):
    forward, backward = 1.0, 2.0  # the plans' units: B and W each half a backward pass, so F = B = W
    plans = {
        "1f1b": schedules.one_f_one_b_schedule(stages, microbatches, forward, backward),
        "zb-h1": schedules.zero_bubble_schedule(stages, microbatches, forward, backward),
    }
    for stage in range(stages):
        busy = {name: sum(s.end - s.start for s in plan if s.stage == stage) for name, plan in plans.items()}
        idle = {name: schedules.makespan(plan) - busy[name] for name, plan in plans.items()}
        assert busy["zb-h1"] == busy["1f1b"] == microbatches * (forward + backward)
        assert idle["1f1b"] == (stages - 1) * (forward + backward)  # F + B + W per boundary
        assert idle["zb-h1"] == (stages - 1) * forward  # F alone
    assert schedules.bubble_fraction(plans["zb-h1"]) == pytest.approx((stages - 1) / (3 * microbatches + stages - 1))


@pytest.mark.parametrize("backward", [0.5, 1.0, 2.0, 3.5])
def test_gpipe_bubble_formula_holds_for_any_backward_to_forward_ratio(backward):
    for stages, microbatches in ((2, 4), (4, 8)):
        plan = schedules.gpipe_schedule(stages, microbatches, forward=1.0, backward=backward)
        assert schedules.bubble_fraction(plan) == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_notebook_09_blames_unequal_stages_not_the_backward_to_forward_ratio():
    text = _source("09", "043bbfa3")
    assert "not exactly twice a forward one" not in text
    assert "whatever the ratio of backward to forward time" in text


def test_interleaved_counts_are_microbatch_chunks():
    """Interleaved 1F1B counts a microbatch once per chunk it holds: 2 stages x 4 microbatches x 2 chunks."""
    held = schedules.peak_in_flight(schedules.interleaved_schedule(2, 4, virtual=2))
    assert held[0] > 4  # more than the microbatches there are: these are microbatch-chunks
    assert 'held = "microbatch-chunks (half a stage each)" if name == "interleaved"' in _source("09", "014ac877")
    assert "microbatch-chunks" in _source("09", "72765729")


RETIRED = [  # (notebook, cell id, a sentence that was false)
    ("09", "fdd61137", "The price: a microbatch's activations stay until its W pass."),
    ("09", "72765729", "its passes are a third shorter"),
    ("09", "4011ea81", "ZB-H1 pays in memory"),
    ("09", "3e946183", "a third of 1F1B's idle time, more memory"),
    ("09", "dccf7bf0", "ZB-H1's B and W passes also each recompute the stage's forward pass first"),
]


@pytest.mark.parametrize(("stem", "cell_id", "retired"), RETIRED, ids=[f"{s}/{c}" for s, c, _ in RETIRED])
def test_a_corrected_claim_stays_corrected(stem, cell_id, retired):
    assert retired not in _source(stem, cell_id)


def test_notebook_09_says_zb_h1_keeps_1f1b_peak_and_why_the_measured_peak_rose():
    assert "ZB-H1 keeps 1F1B's peak memory" in _source("09", "fdd61137")
    measured = _source("09", "dccf7bf0")
    assert "64-feature batch, tiny beside the 1,024-wide activations" in measured
    assert "1F1B's first stage already holds" in _source("09", "4011ea81")
    assert "Its first stage holds *p* microbatches, as under 1F1B" in _source("09", "3e946183")


def test_the_stage_0_backward_pass_of_zb_h1_computes_nothing():
    """ "Stage 0's B pass computes nothing (nobody needs the gradient of the batch)": its program has no work."""
    layers, params = pk.models.as_layers(pk.models.MLP(8, (16,), 4, rngs=nnx.Rngs(0)))
    batch = {"x": np.ones((4, 8), np.float32), "y": np.zeros(4, np.int32)}
    statics = dict(layers=tuple(layers[:1]), head_loss=pk.models.cross_entropy, first=True, last=False, precision=None)
    cotangent = np.ones((4, 16), np.float32)
    hlo = programs.backward_input.lower(params[:1], None, batch, cotangent, **statics).compile().as_text()
    assert "dot(" not in hlo and programs.backward_input(params[:1], None, batch, cotangent, **statics) is None


# --- References between the notebooks, and what they point at ----------------------------------------------------


REFERENCES = [  # (notebook, cell id, the reference, the notebook it names, what that notebook must say)
    ("12", "cell-17", "Notebook 02's cost model puts times on it (its section 8)", "02",
     "## 8 · The claim: 8 GPUs in one machine vs 16 across machines"),
    ("14", "c2b1d7c5", "Notebook 02 (section 8) set 8 GPUs in one machine against 16 across machines", "02",
     "## 8 · The claim: 8 GPUs in one machine vs 16 across machines"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("stem", "cell_id", "reference", "target", "teaches"), REFERENCES, ids=[r[2] for r in REFERENCES]
)
def test_a_reference_names_the_notebook_that_teaches_it(stem, cell_id, reference, target, teaches):
    assert reference in _source(stem, cell_id)
    assert teaches in _markdown(target) + " ".join(_code(_cells(target)))


def test_stale_notebook_numbers_are_gone():
    assert "notebook (03)" not in _source("02", "c08-33-md")
    assert "Notebook 08's cost model" not in _source("12", "cell-17")
    assert "The course opened with a question" not in _source("14", "c2b1d7c5")


def test_the_course_page_places_each_code_exercise_in_the_notebook_that_holds_it():
    readme = _doc("docs", "course.md")
    said = re.search(r"an all-reduce from `ppermute` in (\d\d), a 1F1B order in (\d\d)", readme)
    assert said, "docs/course.md no longer names where the code exercises are"
    ring, orders = said.groups()
    assert "def ring_all_reduce" in " ".join(_code(_cells(ring)))
    assert "pk.lesson.check_orders" in " ".join(_code(_cells(orders)))


def test_notebook_14_needs_the_notebooks_whose_layouts_its_tables_use():
    (path,) = NOTEBOOKS.glob("14_*.ipynb")
    needs = set(arc.lesson(path).needs)
    assert {"08_when_the_sequence_is_the_problem", "10_many_experts_one_step"} <= needs


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_a_temporary_folder_is_named_for_its_notebook(path):
    source = " ".join(_code(_cells(path.stem[:2])))
    for number in re.findall(r"""prefix=["']pk-(\d\d)-""", source):
        assert number == path.stem[:2], f"{path.name} makes its temporary folders as pk-{number}-"


def test_the_glossary_points_hlo_at_notebooks_that_say_hlo():
    entry = re.search(r'<a id="hlo"></a>(.*?)(?=<a id=|\Z)', _doc("docs", "glossary.md")).group(1)
    named = re.findall(r"\d\d", " ".join(re.findall(r"Notebooks? \d\d(?:(?:, | and )\d\d)*", entry)))
    assert named, "the glossary's HLO entry names no notebook"
    for stem in named:
        assert "HLO" in _markdown(stem), f"the glossary sends HLO to notebook {stem}, which never says HLO"


def _glossary_entries() -> list[tuple[str, list[str], list[str]]]:
    """Each glossary entry: its anchor, its term's spellings, and the notebooks it names."""
    text = (ROOT / "docs" / "glossary.md").read_text()
    entries = []
    for anchor, name, body in re.findall(r'<a id="([^"]+)"></a>\*\*([^*]+?)\*\*(.*?)(?=\n<a id=|\Z)', text, flags=re.S):
        named = re.findall(r"\d\d", " ".join(re.findall(r"Notebooks? \d\d(?:(?:, | and )\d\d)*", body)))
        spellings = [w.strip() for w in re.split(r",| and ", re.sub(r"\(.*?\)", "", name.rstrip("."))) if w.strip()]
        entries.append((anchor, spellings, named))
    return entries


@pytest.mark.parametrize(
    ("anchor", "spellings", "named"), _glossary_entries(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_glossary_entry_names_notebooks_that_use_its_term(anchor, spellings, named):
    """ "Notebook NN points at the notebook that teaches it": that notebook says the term, or links its entry."""
    for stem in named:
        text = _markdown(stem)
        used = any(s.lower() in text.lower() for s in spellings) or f"glossary.md#{anchor})" in text
        assert used, f"the glossary sends {spellings[0]!r} to notebook {stem}, which neither says nor links it"


# --- The docs: what simulated devices show, and XLA's timeouts ----------------------------------------------------


def test_the_appendix_does_not_promise_a_gpu_compiles_the_same_collectives():
    text = _doc("docs", "simulated_devices.md")
    assert "The same strategy on GPUs compiles to the same collectives." not in text
    assert "No multi-GPU run of the kit is recorded yet." in text
    assert not list((ROOT / "benchmarks" / "results").glob("*gpu*")), "a multi-GPU record exists: say so"


def test_the_cpu_collective_timeouts_the_course_quotes_are_xla_flags_here():
    """The two flags docs/simulated_devices.md names exist in the installed jaxlib (an unknown one aborts JAX)."""
    text = _doc("docs", "simulated_devices.md")
    flags = re.findall(r"`(--xla_cpu_collective_call_\w+)`", text)
    assert sorted(flags) == [
        "--xla_cpu_collective_call_terminate_timeout_seconds",
        "--xla_cpu_collective_call_warn_stuck_timeout_seconds",
    ]
    assert "wait 20 s" in text and "After 40 s more" in text
    assert "After 40 more seconds" in _source("01", "c01-laptop")
    env = dict(os.environ, XLA_FLAGS=" ".join(f"{flag}=40" for flag in flags), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "cpu", done.stderr[-2000:]


# --- docs/planner.md against the planner's record ------------------------------------------------------------------


def test_the_layouts_the_planner_ties_at_the_top_are_the_ones_its_page_names():
    validation = json.loads((ROOT / "benchmarks" / "results" / "planner.json").read_text())["validation"]
    predicted = {row["layout"]: row["predicted_s"] for row in validation["rows"]}
    tied = set(validation["tied_with_first"])
    assert tied == {"data 8", "data 8, ZeRO-2"}
    assert predicted["data 8, ZeRO-3"] > predicted["data 8"]  # ZeRO-3's gathers are predicted slower
    assert predicted["data 8, ZeRO-1"] > predicted["data 8"]  # and ZeRO-1's gather of the updated shards
    assert all(predicted[layout] == predicted["data 8"] for layout in tied)
    readme = _doc("docs", "planner.md")
    assert "predicts 2 layouts equal at the top (data parallelism with ZeRO 0 or 2)" in readme
    assert "ZeRO 0-2, with or without accumulation" not in readme


def test_the_planner_page_calls_torchtitans_mfu_against_the_sxm_peak_a_lower_bound():
    published = json.loads((ROOT / "benchmarks" / "results" / "planner.json").read_text())["published"]
    torchtitan = [item for item in published if "torchtitan" in item["published"]["source"]]
    assert torchtitan and all(item["chip"] == "H100 SXM" for item in torchtitan)  # MFU against the SXM peak
    quoted = f"{torchtitan[0]['published']['mfu']:.1%}".replace("%", " %")
    assert f"That {quoted} is a lower bound" in _doc("docs", "planner.md")

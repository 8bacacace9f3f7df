"""The figures `benchmarks/README.md` and the docs pages (honest numbers, course, planner) quote match their JSON.

Each quote below is rendered from the JSON in `benchmarks/results/` with the rounding the
prose uses, and must appear word for word in its document (whitespace and line breaks
aside): change a recorded file or a quoted figure without the other, and this fails.
Re-recording a benchmark therefore means updating the sentences listed here with it.
"""

from __future__ import annotations

import json
import re
from functools import cache

import pytest
from helpers import ROOT

RESULTS = ROOT / "benchmarks" / "results"
BENCH_README = ROOT / "benchmarks" / "README.md"
HONEST, COURSE, PLANNER = (ROOT / "docs" / name for name in ("honest_numbers.md", "course.md", "planner.md"))


@cache
def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


@cache
def text(path) -> str:
    """The document with every run of whitespace (line breaks included) as one space."""
    return re.sub(r"\s+", " ", path.read_text())


def row(name: str, strategy: str, devices: int, processes: int = 1) -> dict:
    """The row of a ``python -m parallelkit bench`` record."""
    (found,) = [
        r for r in load(name)["rows"]
        if (r["strategy"], r["devices"], r["processes"]) == (strategy, devices, processes)
    ]  # fmt: skip
    return found


def sci(x: float) -> str:
    """``6e-8`` as the prose writes it (no leading zero in the exponent)."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _ratio_rows(summary: dict, pairs: tuple[str, ...]) -> list[str]:
    """An overhead record's table, a row per device count: each pair's ratio as the median of the runs [the
    smallest, the largest]."""
    cell = "{median:.3f} [{min:.3f}, {max:.3f}]"
    return [f"| {n} | " + " | ".join(cell.format(**r[pair]) for pair in pairs) + " |" for n, r in summary.items()]


def _overhead() -> list[str]:
    record = load("overhead.json")
    summary, runs, steps = record["summary"], record["args"]["repeats"], record["args"]["steps"]

    rows = _ratio_rows(summary, ("jit", "pmap"))
    diffs = {r["devices"]: r["max_param_diff"]["jit_vs_pmap"] for r in record["results"]}
    single_max = max(r["max"] for backends in summary.values() for r in backends.values())
    return [
        *rows,
        f"`benchmarks/results/overhead.json`: {steps:,} interleaved steps per variant, in {runs} runs",
        f"single runs reach {single_max:.3f}",
        f"parameter difference between them is {sci(diffs[4])} on 4 devices and {diffs[2]:.2f} on 2",
    ]


def test_what_the_overhead_prose_says_holds():
    """ "Both backends are within the 1.02 target on 2, 4 and 8 devices in the median of the runs"."""
    summary = load("overhead.json")["summary"]
    assert sorted(summary, key=int) == ["2", "4", "8"]
    assert all(r["median"] <= 1.02 and r["within_target"] for backends in summary.values() for r in backends.values())


def _overhead_composed() -> list[str]:
    return _ratio_rows(load("overhead_composed.json")["summary"], ("composed", "jit", "pmap"))


def test_the_composed_step_on_one_axis_costs_nothing_over_its_preset():
    """ "The composed step is within the 1.02 target of the preset on 2, 4 and 8 devices, and ends with its
    parameters exactly"."""
    record = load("overhead_composed.json")
    assert sorted(record["summary"], key=int) == ["2", "4", "8"]
    assert all(r["composed"]["median"] <= 1.02 for r in record["summary"].values())
    assert all(r["max_param_diff"]["composed"] == 0.0 for r in record["results"])


def _overhead_random() -> list[str]:
    return _ratio_rows(load("overhead_random.json")["summary"], ("jit", "pmap", "composed"))


def test_what_the_random_order_prose_says_holds():
    """ "The composed step is within the target everywhere. The jit pair is within it on 2 and 8 devices ...; the
    `pmap` pair within it on 8"; "Each misses by about 0.01 or less"."""
    record = load("overhead_random.json")
    assert record["args"]["order"] == "random" and sorted(record["summary"], key=int) == ["2", "4", "8"]
    within = {(n, pair) for n, r in record["summary"].items() for pair in r if r[pair]["median"] <= 1.02}
    pairs = {(n, pair) for n, r in record["summary"].items() for pair in r}
    assert pairs - within == {("4", "jit"), ("2", "pmap"), ("4", "pmap")}
    assert all(round(r[pair]["median"], 2) <= 1.03 for r in record["summary"].values() for pair in r)  # "about 0.01"
    # each library run ends with its hand-written twin's parameters (and the composed step with the preset's)
    assert all(r["max_param_diff"][pair] == 0.0 for r in record["results"] for pair in ("jit", "pmap", "composed"))


def _overhead_pacing() -> list[str]:
    return _ratio_rows(load("overhead_pacing.json")["summary"], ("jit", "pmap", "composed"))


def test_what_the_pacing_prose_says_holds():
    """ "Every pair is within the 1.02 target on 2, 4 and 8 devices in the median of the runs, the `pmap` pair on
    4 devices at the edge (1.020); single runs reach 1.027. Each library run ends with its hand-written twin's
    parameters exactly"."""
    record = load("overhead_pacing.json")
    summary = record["summary"]
    assert record["args"]["order"] == "random" and sorted(summary, key=int) == ["2", "4", "8"]
    assert all(r[pair]["median"] <= 1.02 and r[pair]["within_target"] for r in summary.values() for pair in r)
    assert f"{summary['4']['pmap']['median']:.3f}" == "1.020"
    assert f"{max(r[pair]['max'] for r in summary.values() for pair in r):.3f}" == "1.027"
    assert all(r["max_param_diff"][pair] == 0.0 for r in record["results"] for pair in ("jit", "pmap", "composed"))


def _recompute() -> list[str]:
    return [f"| {r['recompute']} | {r['peak_bytes'] / 1e6:.2f} | {r['beyond_arguments_bytes'] / 1e6:.2f} | "
            f"{r['planned_bytes'] / 1e6:.2f} | {r['planned_activation_bytes'] / 1e6:.2f} | {r['flops'] / 1e9:.3f} |"
            for r in load("recompute.json")["rows"]]  # fmt: skip


def test_what_the_recompute_prose_says_holds():
    """ "The compiled peak falls from none to selective to full, and the FLOPs rise"; the planner's count is "0.85 of
    the compiled peak under selective recomputation and 0.86 under full, and 1.17 times it without"."""
    rows = {r["recompute"]: r for r in load("recompute.json")["rows"]}
    none, selective, full = (rows[name] for name in ("none", "selective", "full"))
    assert none["peak_bytes"] > selective["peak_bytes"] > full["peak_bytes"]
    assert none["flops"] < selective["flops"] < full["flops"]
    ratios = [round(r["planned_bytes"] / r["peak_bytes"], 2) for r in (selective, full, none)]
    assert ratios == [0.85, 0.86, 1.17]


def _cpu_pool() -> list[str]:
    results = load("cpu_pool.json")["results"]
    labels = {"digits-mlp": "digits MLP, Adam, batch 64", "wide-mlp": "MLP 784-1024-1024-10, SGD, batch 256"}
    quotes = [
        f"| {labels[key]} | {r['devices']} | {r['median_step_ms']['cores']:.3g} ms "
        f"| {r['median_step_ms']['2n']:.3g} ms | {r['ratio_2n_to_cores']:.2f} |"
        for key, r in results.items()
    ]  # fmt: skip
    low, high = sorted(round((r["ratio_2n_to_cores"] - 1) * 100) for r in results.values())
    return [*quotes, f"About {low} to {high} % slower steps on simulated devices"]


def _strategies() -> list[str]:
    record = load("strategies.json")
    columns = ("SingleDevice", "Mirrored(pmap)", "CentralStorage", "PS(2 shards)", "TensorParallel",
               "FullySharded(3)", "MultiWorkerMirrored", "PS(2, async)")  # fmt: skip
    quotes = [
        f"| {r['devices']} | " + " | ".join(f"{r['rows'][c]['vs_mirrored_jit']:.2f}" for c in columns) + " |"
        for r in record["results"]
    ]
    diffs = [(name, d) for r in record["results"] for name, d in r["max_param_diff"].items()]
    synchronous = max(d for name, d in diffs if name != "PS(2, async)")
    asynchronous = max(d for name, d in diffs if name == "PS(2, async)")
    args = record["args"]
    return [
        *quotes,
        f"MLP, batch {args['batch_size']}, {args['steps']} interleaved steps, dated {record['date'][:10]}",
        f"Every synchronous strategy ended within {sci(synchronous)} of SingleDevice's parameters",
        f"the asynchronous parameter server, by design, up to {asynchronous:.2f}",
    ]


def _dashboard() -> list[str]:
    d = load("dashboard.json")
    share = d["max_ms"] / (d["args"]["min_interval"] * 1e3)
    return [
        f"median {d['median_us']:.1f} us a step, p99 {d['p99_us']:.0f} us; the {d['redraws']} redraws cost up to "
        f"{d['max_ms']:.1f} ms each, which spread over the {d['args']['min_interval']} s between them is about "
        f"{share:.1%}".replace("%", " %")
    ]


def _bench(doc) -> list[str]:
    """bench_cores.json's four runs, against one device on one core and on the same 2 cores."""
    one, two = row("bench_cores.json", "SingleDevice", 1), row("bench_cores.json", "SingleDevice", 2)
    mirrored, multi = row("bench_cores.json", "Mirrored(jit)", 2), row("bench_cores.json", "MultiWorkerMirrored", 2, 2)

    def vs_one(r: dict) -> str:
        return f"{r['samples_per_s'] / one['samples_per_s']:.2f}"

    def vs_same(r: dict) -> str:
        return f"{two['median_step_ms'] / r['median_step_ms']:.2f}"

    step = f"({mirrored['median_step_ms']:.1f} ms a step against {two['median_step_ms']:.1f} ms)"
    record = load("bench_cores.json")
    command = f'--strategies "Mirrored(jit)" --batch-per-device {record["batch_per_device"]} --steps {record["steps"]}'
    if doc is BENCH_README:
        return [
            f"Both were recorded on {load('bench.json')['date'][:10]}, and every row of both",
            f"gets through {vs_one(mirrored)} times the samples/s of one device on one core, and takes "
            f"{vs_same(mirrored)} times the speed of one device on the same 2 cores {step}",
            f"two processes of one device over loopback reach {vs_one(multi)} and {vs_same(multi)}",
            command,
        ]

    def table(label: str, r: dict, same: str) -> str:
        return (f"| {label}, batch {r['global_batch']} | {r['median_step_ms']:.1f} ms | {r['samples_per_s']:,.0f} "
                f"| {vs_one(r)} | {same} |")  # fmt: skip

    return [
        table("SingleDevice, 1 device on 1 core", one, "-"),
        table("SingleDevice, 1 device on 2 cores", two, vs_same(two)),
        table("Mirrored(jit), 2 devices of 1 core in one process", mirrored, vs_same(mirrored)),
        table("MultiWorkerMirrored, 2 processes x 1 device (gloo, loopback)", multi, vs_same(multi)),
        f"two devices of one core each get through {vs_one(mirrored)} times the samples",
        f"the same two devices run at {vs_same(mirrored)} times its speed {step}",
        f"Two processes that all-reduce over loopback TCP do worse still ({vs_same(multi)})",
        "every multi-device strategy is slower than SingleDevice",
        command,
    ]


def _prefetch(doc) -> list[str]:
    v = load("prefetch.json")["variants"]
    hand, host, ahead = v["hand, on device"], v["library, host batch"], v["library, prefetch"]
    if doc is not BENCH_README:
        return [f"{ahead['ratio_to_hand']:.3f} times the hand-written step with batches already on the device, "
                f"against {host['ratio_to_hand']:.3f} when the step copies its own batch"]  # fmt: skip
    batch_mb = load("prefetch.json")["args"]["batch_size"] * 784 * 4 / 1e6  # float32 MNIST-sized rows
    return [
        f"hand-written with batches on the device {hand['median_ms']:.2f}, library with host batches "
        f"{host['median_ms']:.2f} ({host['ratio_to_hand']:.3f}), library with prefetching {ahead['median_ms']:.2f} "
        f"({ahead['ratio_to_hand']:.3f})",
        f"copy of {batch_mb:.1f} MB",
        f"The variants take turns, {load('prefetch.json')['args']['chunk']} blocked steps at a time, "
        f"{load('prefetch.json')['args']['rounds']} rounds",
    ]


def _layouts(doc) -> list[str]:
    d = load("layouts.json")
    errors = d["layouts"]["2x2"]
    if doc is not BENCH_README:
        return [f"({errors['error_hierarchical']:.0%} mean error against {errors['error_ring']:.0%} for the flat ring"
                .replace("%", " %")]  # fmt: skip
    steps = ", ".join(
        f"{key} {r['step_predicted_s'] * 1e3:.1f} against {r['step_measured_s'] * 1e3:.1f}" + (" ms" * (key == "1x4"))
        for key, r in d["layouts"].items()
    )
    return [
        f"({d['measured']['1x4']['param_bytes'] / 1e6:.2f} MB of float32 parameters), "
        f"{d['args']['batch_per_device']} examples per device",
        f"step; {d['args']['check_steps']} steps of it are then checked against",
        f"(2-core CPU, JAX 0.10.2, dated {d['date'][:10]}):",
        f"fitted links {d['inside']['GBps']:.2f} GB/s and {d['inside']['latency_us']:.0f} us inside one process, "
        f"{d['network']['GBps']:.2f} GB/s and {d['network']['latency_us']:.0f} us between processes",
        f"off by {errors['error_hierarchical']:.0%} on average over the four sizes against {errors['error_ring']:.0%} "
        "for the flat ring".replace("%", " %"),
        f"predicted with the flat ring (compute + all-reduce) against measured: {steps}",
    ]


COUNT = {10: "ten", 11: "eleven", 12: "twelve", 13: "thirteen", 14: "fourteen", 15: "fifteen", 16: "sixteen"}


def _notebooks(doc) -> list[str]:
    d = load("notebooks.json")
    slowest = f"the slowest, `{d['slowest'].removesuffix('.ipynb')}`,"
    every = f"all {COUNT[len(d['seconds'])]} {round(d['total_s'])} s"
    if doc is not BENCH_README:
        return [f"{slowest} took {round(d['max_s'])} s, and {every}"]
    return [f"{slowest} {round(d['max_s'])} s; {every}"]


def test_every_notebook_has_a_recorded_time():
    """ "all N": the record times every notebook of the course, no more."""
    assert sorted(load("notebooks.json")["seconds"]) == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


def _roofline(doc) -> list[str]:
    d = load("roofline.json")
    if doc is not BENCH_README:
        return [f"measured / predicted {d['ratio']:.0f}"]
    return [
        f"{d['flops']:,.0f} FLOPs on {d['bytes_accessed']:,.0f} bytes ({d['intensity']:.2f} FLOPs per byte, "
        f"{d['regime']})",
        f"{d['peak_flops'] / 1e9:.0f} GFLOP/s float32 matmul and {d['memory_bandwidth'] / 1e9:.0f} GB/s memory",
        f"predicted {d['predicted_s'] * 1e6:.1f} us (the roofline's bound, bytes included: "
        f"{d['roofline_s'] * 1e6:.1f} us), measured {d['measured_s'] * 1e6:.0f} us: measured / predicted "
        f"{d['ratio']:.0f}, an efficiency of {d['implied_efficiency']:.1%}".replace("%", " %"),
        f"load average {d['load_average'][0]:.2f}",
        f"(the quick measurement, on {d['quick_ceilings_devices']} device, took {d['quick_ceilings_s']:.1f} s)",
    ]


def _central(doc) -> list[str]:
    d = load("central.json")
    r, stages = d["rows"], d["stages_ms"]
    lib, ps = r["pk.CentralStorage"], r["pk.ParameterServer(2)"]
    if doc is not BENCH_README:
        return [
            f"batch 256): {lib['ratio_to_hand_host_memory']:.3f} times the hand-written step that keeps the state "
            f"in host memory as the library does, {lib['ratio_to_hand']:.3f} times one that keeps it in device 0's "
            "memory; "
            f"`pk.ParameterServer(2)` {ps['ratio_to_hand_host_memory']:.3f} and {ps['ratio_to_hand']:.3f}"
        ]
    hand, host, single = r["hand central"], r["hand central, host memory"], r["single device"]
    lib_stages, host_stages = stages["pk.CentralStorage"], stages["hand central, host memory"]
    return [
        f"`hand central` {hand['median_ms']:.2f}, `hand central, host memory` {host['median_ms']:.2f}, "
        f"`pk.CentralStorage` {lib['median_ms']:.2f} ({lib['ratio_to_hand']:.3f} times the first twin, "
        f"{lib['ratio_to_hand_host_memory']:.3f} times the host-memory one), `pk.ParameterServer(2)` "
        f"{ps['median_ms']:.2f} ({ps['ratio_to_hand']:.3f} and {ps['ratio_to_hand_host_memory']:.3f}), "
        f"SingleDevice {single['median_ms']:.2f}",
        ", ".join(
            f"{stage} {lib_stages[stage]:.2f} against {host_stages[stage]:.2f}" + " ms" * (stage == "pull")
            for stage in ("pull", "gradients", "push", "update")
        ),  # fmt: skip
        f"by up to {single['max_diff_to_hand']:.1e} after the 77 steps".replace("e-0", "e-"),
    ]


def _precision() -> list[str]:
    d = load("precision.json")

    def row(r: dict) -> str:
        mb = [f"{r[key] / 1e6:.2f}" for key in ("argument_bytes", "temp_bytes")]
        cells = [
            r["strategy"],
            r["precision"],
            r["accumulate"],
            f"{r['median_ms']:.2f}",
            f"{r['ratio_to_float32']:.2f}",
        ]
        cells += [*mb, r["allreduce_count"], f"{r['allreduce_bytes'] / 1e6:.2f}"]
        return "| " + " | ".join(map(str, cells)) + " |"

    rows = [row(r) for r in d["rows"].values()]
    r, z = d["rows"], {k: v.get("temp_bytes_per_parameter") for k, v in d["zero3_temporaries"].items()}
    accumulated = [r[f"{s} float32 accumulate=4"]["ratio_to_float32"] for s in ("SingleDevice", "Mirrored(8)")]
    return [
        *rows,
        f"({d['parameters']:,} parameters)",
        f"it took {d['default_over_hand']:.3f} times the hand-written",
        f"({accumulated[0]:.2f} times float32's step) but not on 8 ({accumulated[1]:.2f} times)",
        f"{z['FullySharded(3) float32']:.2f} bytes in float32 and {z['FullySharded(3) bf16']:.2f} under bf16",
        f"holds {z['FullySharded(3) float32 explicit']:.2f} bytes per",
    ]


def test_what_the_precision_prose_says_holds():
    """ "every Mirrored step all-reduces once", "on one device the 16-bit steps are slower", "on 8 ... faster",
    accumulation "cost time on one device ... but not on 8", the Explicit bf16 ZeRO-3 step "refused"."""
    d = load("precision.json")
    rows = d["rows"]
    assert (
        rows["SingleDevice float32 accumulate=4"]["ratio_to_float32"]
        > 1
        > rows["Mirrored(8) float32 accumulate=4"]["ratio_to_float32"]
    )
    assert "refused" in d["zero3_temporaries"]["FullySharded(3) bf16 explicit"]
    assert all(r["allreduce_count"] == 1 for r in rows.values() if r["strategy"] == "Mirrored(8)")
    for precision in ("bf16", "fp16"):
        assert rows[f"SingleDevice {precision} accumulate=1"]["ratio_to_float32"] > 1
        assert rows[f"Mirrored(8) {precision} accumulate=1"]["ratio_to_float32"] < 1


def _experts() -> list[str]:
    d = load("experts.json")

    def row(r: dict) -> str:
        dropped = sum(r["dropped_fraction_per_step"]) / len(r["dropped_fraction_per_step"])
        cells = [r["devices"], r["all_to_all_count"], f"{r['all_to_all_sent_bytes']:,.0f}",
                 f"{r['formula_sent_bytes']:,.0f}", f"{r['expert_weight_bytes_per_device']:,}",
                 f"{r['expert_weight_bytes']:,}", f"{dropped:.2f}", f"{r['expert_parallel_ms']['median_ms']:.1f}",
                 f"{r['single_device_ms']['median_ms']:.1f}"]  # fmt: skip
        return "| " + " | ".join(map(str, cells)) + " |"

    last = [[int(v) for v in block] for block in d["rows"]["8"]["tokens_per_expert_per_step"][-1]]
    block_0, block_1 = (_two_busiest(d, block) for block in (0, 1))
    tenth = sorted(r["dropped_fraction_per_step"][-1] for r in d["rows"].values())
    return [
        *(row(r) for r in d["rows"].values()),
        f"block 0's eight experts received {last[0]} token-choices and block 1's {last[1]} (an even share would be "
        f"{d['args']['batch_size'] * d['model']['max_length'] * d['model']['top_k'] // 8} each)",
        f"from the third step its two busiest experts took at least {block_1[:, 2:].min():.0%} of its choices on "
        f"every device count".replace("%", " %"),
        f"Block 0's two busiest took at most {block_0.max():.0%} at any step".replace("%", " %"),
        f"and {tenth[0] * 100:.0f} to {tenth[-1] * 100:.0f} % at the tenth",
    ]


def _two_busiest(d: dict, block: int):
    """(devices, steps): the share of ``block``'s token-choices that its two busiest experts took, at each step."""
    import numpy as np

    counts = np.array([r["tokens_per_expert_per_step"] for r in d["rows"].values()])[:, :, block]
    return np.sort(counts, axis=-1)[..., -2:].sum(axis=-1) / counts.sum(axis=-1)


def test_what_the_experts_prose_says_holds():
    """ "equal the formula", "1/n of the expert weights", "about a third dropped", the times' order, and the check."""
    rows = load("experts.json")["rows"]
    for r in rows.values():
        n = r["devices"]
        assert r["all_to_all_sent_bytes"] == r["formula_sent_bytes"] and r["all_to_all_count"] == 8
        assert r["expert_weight_bytes_per_device"] * n == r["expert_weight_bytes"]
        assert 0.25 < sum(r["dropped_fraction_per_step"]) / len(r["dropped_fraction_per_step"]) < 0.42
        assert r["max_param_diff"] < 1e-5
    ep, one = ({n: r[key]["median_ms"] for n, r in rows.items()} for key in ("expert_parallel_ms", "single_device_ms"))
    assert ep["2"] < one["2"] and ep["4"] < one["4"] and ep["8"] > one["8"]
    assert one["2"] > one["4"] > one["8"]
    # "at the tenth all but at most 4 of its 2,048", "does not keep the experts in use"
    for r in rows.values():
        tenth = sorted(r["tokens_per_expert_per_step"][-1][1])
        assert sum(tenth) == 2048 and sum(tenth[-2:]) >= 2048 - 4 and tenth[:5] == [0] * 5
    assert load("experts.json")["model"]["depth"] == 2  # "every block": blocks 0 and 1


def _context_row(strategy: str, length: int, devices: int, method: str | None = None) -> dict:
    (found,) = [
        r for r in load("context.json")["rows"]
        if r["strategy"].startswith(strategy) and (r["length"], r["devices"]) == (length, devices)
        and r.get("method") == method
    ]  # fmt: skip
    return found


def _context() -> list[str]:
    one = _context_row("SingleDevice", 1024, 1)
    eight = [_context_row("ContextParallel", 1024, 8, m) for m in ("allgather", "ring", "ring_zigzag", "ulysses")]
    figures = ", ".join(f"{r['attention_temp_bytes'] / 1e6:.1f} ({r['method']})" for r in eight)
    two = [_context_row("ContextParallel", 1024, 2, m) for m in ("allgather", "ring", "ring_zigzag", "ulysses")]

    def sent(r: dict) -> float:
        return sum(v["sent_bytes"] for v in r["collectives"].values()) / 1e6

    def payload(r: dict) -> float:
        return sum(v["bytes"] for v in r["collectives"].values()) / 1e6

    return [
        "At 1024 tokens a step sends per device "
        + ", ".join(f"{sent(r):.2f}{' MB' * (i == 0)} ({r['method']})" for i, r in enumerate(two[:3]))
        + f" and {sent(two[3]):.2f} (ulysses) on 2 devices, and "
        + ", ".join(f"{sent(r):.2f}" for r in eight[:3])
        + f" and {sent(eight[3]):.2f} on 8",
        f"By payload the all-gather would rank wrongly: {payload(two[0]):.2f} MB on 2 devices and "
        f"{payload(eight[0]):.2f} MB on 8, against the ring's {sent(two[1]):.2f} and {sent(eight[1]):.2f}",
        f"attention alone plans {one['attention_temp_bytes'] / 1e6:.0f} MB of temporaries on one device, and on each "
        f"of 8 devices {figures}: each under `1/n` of one device's figure",
        f"share of one layer's scores ({eight[0]['scores_bytes_per_device'] / 1e6:.1f} MB)",
    ]


def test_what_the_context_prose_says_holds():
    """ "Every count and payload the compiler wrote equals the cost model's", "each under 1/n of one device's"."""
    rows = [r for r in load("context.json")["rows"] if r["predicted"]]
    assert rows and all(r["collectives"] == r["predicted"] for r in rows)
    assert all("sent_bytes" in v for r in rows for v in r["collectives"].values())  # "and byte sent"
    # "The all-gather and the ring send the same bytes, at every length and device count. Ulysses sends as much as
    # they do on 2 devices, and less on 4 and 8." The payloads rank the all-gather otherwise.
    args = load("context.json")["args"]
    for length in args["lengths"]:
        for n in args["devices"]:
            rows = {
                m: _context_row("ContextParallel", length, n, m)["collectives"]
                for m in ("allgather", "ring", "ulysses")
            }
            sent, payload = (
                {m: sum(v[key] for v in r.values()) for m, r in rows.items()} for key in ("sent_bytes", "bytes")
            )
            assert sent["allgather"] == sent["ring"] and payload["allgather"] != payload["ring"]
            assert (sent["ulysses"] == sent["ring"]) if n == 2 else (sent["ulysses"] < sent["ring"])
            assert payload["ring"] == sent["ring"]  # a permute sends its payload
    one = _context_row("SingleDevice", 1024, 1)["attention_temp_bytes"]
    for method in ("allgather", "ring", "ring_zigzag", "ulysses"):
        assert _context_row("ContextParallel", 1024, 8, method)["attention_temp_bytes"] < one / 8


def _planner() -> list[str]:
    record = load("planner.json")
    v, slope, speed = record["validation"], record["activation_slope"], record["speed"]
    small, wider, large, tpu = record["published"]
    quotes = [
        f"within 20 % of the compiler's for {v['memory_within_20pct']} of the {v['memory_compared']} layouts compared "
        f"(median planned/compiled {v['memory_ratio_median']:.2f})",
        f"adds {slope['compiled_bytes'] / 1e3:.1f} kB to the compiled step and {slope['planned_bytes'] / 1e3:.1f} kB",
        f"rank the {len(v['rows'])} layouts with a Spearman correlation of {v['spearman']:.2f}",
        f"its first choice ({v['first_choice']}) measured {v['first_choice_over_best']:.2f} times the best "
        f"({v['measured_best']})",
        f"It plans Llama 3 70B on 1,024 GPUs ({speed['layouts_weighed']:,} layouts weighed, {speed['layouts_left']:,} "
        f"left) in {speed['median_s']:.2f} s",
        f"It predicts {len(v['tied_with_first'])} layouts equal at the top",
        f"which measured {min(v['tied_over_best']):.2f} to {max(v['tied_over_best']):.2f} times the best",
    ]
    rows = {r["layout"]: r for r in v["rows"]}
    zero = [rows[f"data 8, ZeRO-{stage}"] for stage in (1, 2, 3)]
    quotes.append(", ".join(f"{r['compiled_bytes'] / 1e6:.2f}" for r in zero) + " MB compiled against "
                  + ", ".join(f"{r['planned_bytes'] / 1e6:.2f}" for r in zero) + " MB counted")  # fmt: skip
    for item in (small, wider, large):
        mine, theirs = item["planner_for_their_layout"], item["published"]
        quotes.append(f"counts {mine['memory_bytes'] / 1e9:.1f} GB")
        quotes.append(f"{theirs['memory_bytes'] / 1e9:.1f} GB")
        said = "{} MFU beside the {}" if item is small else "predicts {} beside {}"
        quotes.append(said.format(f"{mine['mfu']:.1%}", f"{theirs['mfu']:.1%}").replace("%", " %"))
    quotes.append(f"it predicts {tpu['planner_for_their_layout']['mfu']:.1%} beside the {tpu['published']['mfu']:.1%} "
                  "MaxText's".replace("%", " %"))  # fmt: skip
    runs = record["published_runs"]
    for r in runs["rows"]:  # docs/planner.md's table of published runs, row by row
        quotes.append(f"| {r['run']} | {r['layout']} | {r['published_mfu']:.1%} | {r['mfu']:.1%} | "
                      f"{r['mfu_error']:+.0%} | {r['memory_bytes'] / 1e9:.1f} |".replace("%", " %"))  # fmt: skip
    summary = runs["summary"]
    quotes.append(f"the mean absolute MFU error is {summary['mean_abs_mfu_error']:.1%} ({summary['within_10pct']} of "
                  f"{summary['runs']} runs within 10 %".replace("%", " %").replace("  %", " %"))  # fmt: skip
    return quotes


def _planner_summary() -> str:
    v, speed = load("planner.json")["validation"], load("planner.json")["speed"]
    return (f"memory within 20 % for {v['memory_within_20pct']} of {v['memory_compared']} layouts, Spearman "
            f"{v['spearman']:.2f}, the first choice {v['first_choice_over_best']:.2f} times the best, the published "
            f"comparisons, {speed['median_s']:.2f} s for 1,024 GPUs")  # fmt: skip


def _pipeline() -> list[str]:
    rows = load("pipeline.json")["rows"]
    diffs = [r["measured"] - r["formula"] for r in rows]
    return [
        *(f"| {r['schedule']} | {r['microbatches']} | {r['measured']:.3f} | {r['replayed']:.3f} | {r['formula']:.3f} | "
          + ", ".join(f"{b / 1024:,.0f}" for b in r["peak_stashed_bytes"].values()) + " |" for r in rows),
        f"lies between {min(diffs):+.3f} and {max(diffs):+.3f} of the formula",
    ]  # fmt: skip


def test_what_the_pipeline_prose_says_holds():
    """ "falls less than the formula", "interleaving and ZB-H1 measured a smaller bubble than 1F1B", "replay to
    exactly their formula", "its last stage kept twice 1F1B's bytes"."""
    rows = {(r["schedule"], r["microbatches"]): r for r in load("pipeline.json")["rows"]}
    counts = sorted({m for _, m in rows})
    for m in counts:
        assert max(rows["interleaved", m]["measured"], rows["zb-h1", m]["measured"]) < rows["1f1b", m]["measured"]
        # twice the microbatches, and the last stage's seed gradients (4 bytes each) kept for the weight passes
        twice = rows["zb-h1", m]["peak_stashed_bytes"]["1"] / (2 * rows["1f1b", m]["peak_stashed_bytes"]["1"])
        assert abs(twice - 1) < 1e-4
    for schedule in ("gpipe", "1f1b", "interleaved", "zb-h1"):
        first, last = rows[schedule, counts[0]], rows[schedule, counts[-1]]
        assert first["measured"] - last["measured"] < first["formula"] - last["formula"]
        if schedule != "zb-h1":
            assert all(abs(rows[schedule, m]["replayed"] - rows[schedule, m]["formula"]) < 1e-9 for m in counts)


def _buckets() -> list[str]:
    record = load("buckets.json")
    rows, gpus = record["rows"], record["gpus"]
    one, many = rows["bucket_bytes=1000000000"], rows["bucket_bytes=1000"]
    return [
        *(f"| {r['bucket_bytes']} | {len(r['plan_bytes'])} | {r['median_ms']:.2f} | {r['predicted_ms']:.2f} |"
          for r in rows.values()),
        *(f"| {r['bucket_mb']:,.0f} MB | {r['buckets']:,} | {r['exposed_ms']:.1f} | {r['allreduce_ms']:.1f} |"
          for r in gpus["rows"]),
        f"26 the step grows by {many['median_ms'] - one['median_ms']:.1f} ms where the model adds "
        f"{many['predicted_ms'] - one['predicted_ms']:.1f} ms",
        f"charges each one 6 rounds of {record['here']['link']['latency_us']:.0f} us",
        f"a backward pass of {gpus['backward_s'] * 1e3:.1f} ms",
    ]  # fmt: skip


def test_what_the_buckets_prose_says_holds():
    """ "More buckets cost more here ... but less than it says", "slower than one flat bucket", "a few hundred MB"."""
    record = load("buckets.json")
    rows = sorted(record["rows"].values(), key=lambda r: len(r["plan_bytes"]))
    bucketed = [r for r in rows if r["bucket_bytes"] is not None]
    assert [r["median_ms"] for r in bucketed] == sorted(r["median_ms"] for r in bucketed)
    assert all(r["median_ms"] <= r["predicted_ms"] for r in bucketed)
    assert record["rows"]["bucket_bytes=None"]["median_ms"] > record["rows"]["bucket_bytes=1000000000"]["median_ms"]
    assert len(record["rows"]["bucket_bytes=1000"]["plan_bytes"]) == 26
    best = min(record["gpus"]["rows"], key=lambda r: r["exposed_ms"])
    assert 100 <= best["bucket_mb"] < 1000
    first, last = record["gpus"]["rows"][0], record["gpus"]["rows"][-1]
    assert first["exposed_ms"] > last["exposed_ms"] > best["exposed_ms"] and last["buckets"] == 1


def _h100() -> list[str]:
    """The one-GPU records: the course's refusals, the wrapper's cost, the roofline, the tests under JAX 0.11."""
    notebooks, overhead = load("h100/notebooks.json"), load("h100/overhead.json")
    roofline, tests = load("h100/roofline.json"), load("h100/pytest_jax011.json")
    ran, summary = notebooks["seconds"], overhead["summary"]["1"]
    hand_jit = [r["variants"]["hand-jit"]["median_ms"] for r in overhead["results"]]
    extra = [1e3 * (r["variants"][f"lib-{b}"]["median_ms"] - r["variants"][f"hand-{b}"]["median_ms"])
             for r in overhead["results"] for b in ("jit", "pmap")]  # fmt: skip
    passed, failed = (re.search(rf"(\d+) {word}", tests["summary"])[1] for word in ("passed", "failed"))
    return [
        f"{len(notebooks['failed'])} of the {len(notebooks['failed']) + len(ran)} notebooks stop in their first cell",
        *(f"`{name}`, whose processes bring their own devices, ran to the end in {s:.1f} s" for name, s in ran.items()),
        f"jit {summary['jit']['median']:.3f} [{summary['jit']['min']:.3f}, {summary['jit']['max']:.3f}], "
        f"pmap {summary['pmap']['median']:.3f} [{summary['pmap']['min']:.3f}, {summary['pmap']['max']:.3f}]",
        f"({min(hand_jit):.2f} to {max(hand_jit):.2f} ms by hand",
        f"{min(extra):.0f} to {max(extra):.0f} us in the medians",
        f"gave {roofline['peak_flops'] / 1e9:,.0f} GFLOP/s float32 matmul and "
        f"{roofline['memory_bandwidth'] / 1e9:,.0f} GB/s",
        f"measured {roofline['measured_s'] * 1e6:,.0f} us per step in `pk.fit`, a FLOPs utilisation of "
        f"{roofline['implied_efficiency'] * 100:.4f} %",
        f"{passed} passed, {failed} failed, the four in `tests/test_profile.py`",
        f"a machine with an NVIDIA H200: {tests['later']['summary'].split(' in ')[0]}",
    ]


def test_what_the_one_gpu_prose_says_holds():
    """ "one NVIDIA H100", "about half a millisecond", "above the 1.02 target", "equal (difference 0.0)", "the four"."""
    notebooks, overhead = load("h100/notebooks.json"), load("h100/overhead.json")
    assert notebooks["devices"] == "1 x NVIDIA H100 80GB HBM3" == "1 x " + overhead["device_kind"]
    assert all("needs at least 2 devices" in e or "needs at least 4 devices" in e for e in notebooks["failed"].values())
    assert all(0.3 < r["variants"]["hand-jit"]["median_ms"] < 0.8 for r in overhead["results"])
    assert not any(r["within_target"] for r in overhead["summary"]["1"].values())
    assert all(d == 0.0 for r in overhead["results"] for d in r["max_param_diff"].values())
    failed = load("h100/pytest_jax011.json")["failed"]
    assert len(failed) == 4 and all(name.startswith("tests/test_profile.py::") for name in failed)


QUOTES = [
    *((BENCH_README, q) for q in _h100() + _buckets() + _pipeline()),
    (
        HONEST,
        "step cost {jit[median]:.3f} (jit) and {pmap[median]:.3f} (pmap) times".format(
            **load("h100/overhead.json")["summary"]["1"]
        ),
    ),
    *((PLANNER, q) for q in _planner()),
    (BENCH_README, _planner_summary()),
    *((COURSE, q) for q in _notebooks(COURSE)),
    *((doc, q) for doc in (HONEST, BENCH_README) for q in _central(doc) + _roofline(doc)),
    *((BENCH_README, q) for q in _notebooks(BENCH_README)),
    *((BENCH_README, q) for q in _context()),
    *((BENCH_README, q) for q in _overhead() + _overhead_composed() + _overhead_random() + _overhead_pacing()),
    *((BENCH_README, q) for q in _cpu_pool() + _strategies()),
    *((BENCH_README, q) for q in _dashboard() + _precision() + _recompute()),
    *((BENCH_README, q) for q in _experts()),
    *((BENCH_README, q) for q in _bench(BENCH_README) + _prefetch(BENCH_README) + _layouts(BENCH_README)),
    *((HONEST, q) for q in _bench(HONEST) + _prefetch(HONEST) + _layouts(HONEST)),
]


@pytest.mark.parametrize(("doc", "quote"), QUOTES, ids=[f"{d.parent.name}/{d.name}: {q[:50]}" for d, q in QUOTES])
def test_quoted_figure_matches_its_record(doc, quote):
    assert quote in text(doc), (
        f"{doc.relative_to(ROOT)} does not say, word for word, what its recorded JSON gives:\n  {quote}\n"
        "Either the prose or benchmarks/results/ changed without the other: update the sentence to the record."
    )


def test_what_the_prose_says_of_the_records_holds():
    """The claims beside the figures: which targets were met, what was slower, what a record lacks."""
    losses = {r["devices"]: r["final_loss"] for r in load("overhead.json")["results"]}  # "within 0.3 %"
    assert all(abs(f["lib-jit"] / f["lib-pmap"] - 1) < 0.003 for f in losses.values())
    slower = [r for r in load("bench.json")["rows"] if r["strategy"] != "SingleDevice" and r["devices"] > 1]
    assert slower and all(r["speedup"] < 1 for r in slower)  # "every multi-device strategy is slower"
    assert load("bench.json")["date"][:10] == load("bench_cores.json")["date"][:10]  # "Both were recorded on"
    assert load("roofline.json")["ratio"] > 1  # "the FLOPs at the peak are a floor"
    layouts = load("layouts.json")  # "the hierarchical formula fit 2x2 better"
    assert layouts["better_fit"] == "hierarchical"
    assert layouts["layouts"]["2x2"]["error_hierarchical"] < layouts["layouts"]["2x2"]["error_ring"]


def test_every_recorded_bench_row_equals_one_device():
    """ "every row of both, the pipeline and the multi-process rows included, ends within the tolerance"."""
    for name in ("bench.json", "bench_cores.json"):
        rows = load(name)["rows"]
        assert {r["strategy"].split("(")[0] for r in rows} >= {"SingleDevice", "Mirrored", "MultiWorkerMirrored"}
        assert all(r["equals_single"] is True and r["max_param_diff"] is not None for r in rows), name


NOTEBOOK_TIME = re.compile(r"this notebook ran top to bottom in (\d+) s")


@pytest.mark.parametrize("name", sorted(load("notebooks.json")["seconds"]))
def test_a_notebooks_quoted_run_time_is_its_recorded_one(name):
    """A notebook that says how long it ran quotes its own time from `benchmarks/results/notebooks.json`."""
    cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
    source = " ".join("".join(cell["source"]) for cell in cells)
    quoted = [int(s) for s in NOTEBOOK_TIME.findall(re.sub(r"\s+", " ", source))]
    assert len(quoted) <= 1, f"{name} quotes its run time more than once"
    assert quoted in ([], [round(load("notebooks.json")["seconds"][name])])


def test_make_bench_runs_every_benchmark_but_the_notebooks():
    """ "`make bench` runs the scripts below, all but `notebooks.py` and `planner_compiled.py`" (interleaved.py is
    their shared module)."""
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - {"notebooks.py", "planner_compiled.py",
                                                                       "interleaved.py"}  # fmt: skip
    assert set(re.findall(r"benchmarks/(\w+\.py)", (ROOT / "Makefile").read_text())) == scripts

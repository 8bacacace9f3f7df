"""Reading collectives out of HLO text, on the shapes XLA prints for CPU and GPU programs."""

from __future__ import annotations

import pytest

from parallelkit.measure.inspect import parse_collectives, sent_bytes, summarize

HLO = """
ENTRY %main {
  %all-reduce.6 = (f32[10]{0}, f32[10,64]{1,0}, /*index=2*/f32[]) all-reduce(%a, %b, %c), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}, to_apply=%add
  %ag-start = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(bf16[4,8]{1,0} %p), replica_groups=[2,4]<=[8], dimensions={0}
  %ag-done = bf16[16,8]{1,0} all-gather-done((bf16[4,8]{1,0}, bf16[16,8]{1,0}) %ag-start)
  %rs = f32[2,8]{1,0} reduce-scatter(f32[8,8]{1,0} %g), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %cp = s32[5]{0} collective-permute(s32[5]{0} %x), source_target_pairs={{0,1},{1,0}}
  %a2a = f32[4,4]{1,0} all-to-all(f32[4,4]{1,0} %y), replica_groups={{0,1}}, dimensions={0}
  %add.1 = f32[8]{0} add(%u, %v)
}
"""


def test_every_kind_once_with_bytes_and_groups():
    found = parse_collectives(HLO)
    assert [c.op for c in found] == ["all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all"]
    all_reduce, all_gather, reduce_scatter, permute, all_to_all = found
    assert all_reduce.shapes == ("f32[10]", "f32[10,64]", "f32[]")
    assert (all_reduce.elements, all_reduce.bytes, all_reduce.group_size) == (651, 2604, 8)
    assert (all_gather.shapes, all_gather.bytes, all_gather.group_size) == (("bf16[16,8]",), 256, 4)
    assert (reduce_scatter.bytes, reduce_scatter.group_size) == (64, 4)
    assert (permute.bytes, permute.group_size) == (20, None)
    assert (all_to_all.bytes, all_to_all.group_size) == (64, 2)


def test_summary_counts_and_adds():
    hlo = HLO + "  %ar2 = f32[6]{0} all-reduce(f32[6]{0} %z), replica_groups={{0,1}}\n"
    summary = summarize(parse_collectives(hlo))
    assert summary["all-reduce"] == {"count": 2, "bytes": 2604 + 24}
    assert summary["all-gather"] == {"count": 1, "bytes": 256}


def test_no_collectives_in_plain_code():
    assert parse_collectives("%add = f32[8]{0} add(%a, %b)\n%r = f32[] reduce(%x, %c)") == []


def test_sent_bytes_per_device_are_the_ring_formulas_for_each_kind():
    """One device's bytes sent, one way, for each collective of HLO, from the payloads and group sizes the HLO
    states: an all-reduce of S over n sends 2(n-1)/n S, an all-gather of output S (n-1)/n S, a reduce-scatter of
    input S (n-1)/n S, a permute its operand, an all-to-all (n-1)/n of its operand."""
    all_reduce, all_gather, reduce_scatter, permute, all_to_all = parse_collectives(HLO)
    assert all_reduce.sent_bytes() == 2 * 7 / 8 * (10 + 640 + 1) * 4  # f32[10], f32[10,64], f32[] over 8
    assert all_gather.sent_bytes() == 3 / 4 * 16 * 8 * 2  # bf16[16,8] gathered over 4
    assert reduce_scatter.sent_bytes() == 3 / 4 * 8 * 8 * 4  # its input f32[8,8], over 4
    assert permute.sent_bytes() == 5 * 4  # s32[5], whatever the group
    assert all_to_all.sent_bytes() == 1 / 2 * 4 * 4 * 4  # f32[4,4] over 2
    assert all_gather.sent_bytes(n=2) == sent_bytes("all-gather", 256, 2) == 128  # a group size given overrides
    assert sent_bytes("all-reduce", 100, 1) == 0 and sent_bytes("reduce-scatter", 100, 1) == 0  # alone: nothing


def test_sent_bytes_needs_a_group_size_and_a_collective():
    unknown = parse_collectives("%ag = f32[8]{0} all-gather(f32[2]{0} %x), dimensions={0}")[0]
    assert unknown.group_size is None
    with pytest.raises(ValueError, match="names no replica groups for this all-gather: pass n"):
        unknown.sent_bytes()
    assert unknown.sent_bytes(n=4) == 24
    with pytest.raises(ValueError, match="'add' is not a collective"):
        sent_bytes("add", 100, 2)

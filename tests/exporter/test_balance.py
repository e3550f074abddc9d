"""Stage balance: cost-balanced layer splits and rebalancing from measured times."""

from __future__ import annotations

import pytest

from exporter.balance import (
    balanced_split,
    decoder_layer_weights,
    format_layers,
    head_cost_layers,
    measured_head_cost,
    rebalanced_split,
    stage_costs,
    suggest_layers,
)
from zctl.manifest import even_split, parse_layer_spec

SMOLLM2 = dict(hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64)
LLAMA_1B = dict(hidden=2048, intermediate=8192, num_heads=32, num_kv_heads=8, head_dim=64)


def test_layer_weights_count_attention_and_mlp() -> None:
    # q, o: 576 x 576; k, v: 576 x 192; gate, up, down: 576 x 1536
    assert decoder_layer_weights(**SMOLLM2) == 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536


def test_head_cost_follows_vocabulary_relative_to_layer_size() -> None:
    smol = head_cost_layers(**SMOLLM2, vocab=49152)
    big = head_cost_layers(**LLAMA_1B, vocab=128256)
    # measured with a core per stage: SmolLM2's head ~4.9-5.5 layers, the 1B shape's ~2.3
    assert 4.0 < smol < 6.0
    assert 1.8 < big < 3.2
    assert head_cost_layers(**SMOLLM2, vocab=64) < 0.01


def test_without_extras_the_split_is_even() -> None:
    for layers, stages in [(30, 2), (30, 3), (16, 3), (7, 7), (5, 1)]:
        assert balanced_split(layers, stages) == even_split(layers, stages)


def test_the_head_moves_layers_to_earlier_stages() -> None:
    head = head_cost_layers(**SMOLLM2, vocab=49152)
    ranges = balanced_split(30, 2, head)
    assert ranges == [(0, 17), (17, 30)]
    costs = stage_costs(ranges, 30, head)
    assert max(costs) < max(stage_costs(even_split(30, 2), 30, head))
    three = balanced_split(30, 3, head)
    assert [e - s for s, e in three] == [12, 11, 7]


def test_split_is_optimal_against_brute_force() -> None:
    import itertools

    for layers, stages, extra, speeds in [(12, 3, 2.5, None), (10, 2, 0.7, [1.0, 2.0]),
                                          (9, 3, 4.0, [2.0, 1.0, 1.0])]:
        speeds_ = speeds or [1.0] * stages
        got = balanced_split(layers, stages, extra, speeds=speeds)
        cuts = [0, *[e for _, e in got]]
        assert cuts[-1] == layers and all(b > a for a, b in itertools.pairwise(cuts))

        def slowest(ranges: list[tuple[int, int]], layers: int = layers, extra: float = extra,
                    speeds_: list[float] = speeds_) -> float:
            return max(c / s for c, s in zip(stage_costs(ranges, layers, extra), speeds_,
                                             strict=True))

        best = min(slowest(list(itertools.pairwise([0, *c, layers])))
                   for c in itertools.combinations(range(1, layers), stages - 1))
        assert slowest(got) == pytest.approx(best)


def test_faster_nodes_get_more_layers() -> None:
    ranges = balanced_split(30, 2, speeds=[2.0, 1.0])
    assert ranges == [(0, 20), (20, 30)]


def test_measured_times_calibrate_the_head() -> None:
    # 15 + 15 layers: stage 0 16.0 ms (1.067 ms/layer), stage 1 21.2 ms -> head ~4.9 layers
    ranges = even_split(30, 2)
    assert measured_head_cost(ranges, [16.0, 21.2]) == pytest.approx(21.2 / (16.0 / 15) - 15)
    assert rebalanced_split(ranges, [16.0, 21.2]) == [(0, 17), (17, 30)]
    assert rebalanced_split(ranges, [16.0, 16.0]) == ranges
    assert measured_head_cost(ranges, [16.0, 10.0]) == 0.0


@pytest.mark.parametrize("args", [(3, 4), (30, 0)])
def test_impossible_splits_are_refused(args: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="cannot split"):
        balanced_split(*args)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="extras"):
        balanced_split(30, 2, -1.0)
    with pytest.raises(ValueError, match="speeds"):
        balanced_split(30, 2, speeds=[1.0])
    with pytest.raises(ValueError, match="speeds"):
        balanced_split(30, 2, speeds=[1.0, 0.0])
    with pytest.raises(ValueError, match="at least two"):
        measured_head_cost([(0, 30)], [10.0])
    with pytest.raises(ValueError, match="> 0"):
        measured_head_cost(even_split(30, 2), [0.0, 10.0])


def test_format_round_trips_through_the_layers_option() -> None:
    ranges = [(0, 17), (17, 30)]
    assert format_layers(ranges) == "0-16,17-29"
    assert parse_layer_spec(format_layers(ranges)) == ranges


def test_suggestions_come_only_when_the_split_is_off_balance() -> None:
    assert suggest_layers(["0-14", "15-29"], [16.0, 21.2]) == "0-16,17-29"
    assert suggest_layers(["0-16", "17-29"], [18.6, 19.6]) is None  # already balanced
    assert suggest_layers(["0-29"], [30.0]) is None
    assert suggest_layers(["0-14", "15-29"], [16.0, 0.0]) is None  # no timing yet
    assert suggest_layers(["0-14", "15-29"], [16.0]) is None
    assert suggest_layers(["garbage", "15-29"], [16.0, 20.0]) is None


def _source(layers: int, **shape: object) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(num_layers=layers, decoder_shape=lambda: SimpleNamespace(**shape))


def test_a_mixture_of_experts_is_split_by_its_active_experts() -> None:
    """gpt-oss-20b's config calls one expert's width its intermediate size, and a token
    runs 4 of its 32: its layers cost 4 experts' weights a step, so the head is worth ~2.8
    layers, not the ~7 that one expert's width would make it (2 stages: 13 and 11 layers,
    not 15 and 9)."""
    from exporter.balance import decode_mlp_width, default_split

    gpt_oss = dict(hidden_size=2880, intermediate_size=2880, num_heads=64, num_kv_heads=8,
                   head_dim=64, vocab_size=201088, experts=32, active_experts=4,
                   expert_intermediate=2880, sparse_layers=tuple(range(24)))
    assert decode_mlp_width(_source(24, **gpt_oss).decoder_shape(), 24) == 4 * 2880
    head = head_cost_layers(2880, 4 * 2880, 64, 8, 64, 201088)
    assert 2.5 < head < 3.0 < 6.5 < head_cost_layers(2880, 2880, 64, 8, 64, 201088)
    assert default_split(_source(24, **gpt_oss), 2) == balanced_split(24, 2, head) == [(0, 13), (13, 24)]
    # a layer mlp_only_layers makes dense counts its dense MLP
    mixed = {**gpt_oss, "intermediate_size": 6144, "sparse_layers": tuple(range(12))}
    assert decode_mlp_width(_source(24, **mixed).decoder_shape(), 24) == (4 * 2880 + 6144) // 2
    dense = {**gpt_oss, "experts": 0}
    assert decode_mlp_width(_source(24, **dense).decoder_shape(), 24) == 2880

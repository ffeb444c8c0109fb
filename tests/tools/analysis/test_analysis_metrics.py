"""The analyses' numbers on hand-made tensors whose answers are known."""

from __future__ import annotations

import pytest
import torch

from kvforge.errors import ConfigError
from kvforge.tools.analysis.capture import Activations
from kvforge.tools.analysis.channels import channel_magnitude, kv_channels, max_median_ratio
from kvforge.tools.analysis.similarity import layer_similarity, row_cosine, similarity_matrix
from kvforge.tools.analysis.spectra import (
    chunk_min_cosine,
    cumulative_energy,
    key_spectra,
    mean_energy,
    rank_for_energy,
)


def test_rank_two_matrix_has_all_energy_at_rank_two():
    torch.manual_seed(0)
    matrix = torch.randn(300, 2) @ torch.randn(2, 40)
    energy = cumulative_energy(matrix)
    assert energy[0] < 0.99 and energy[1] == pytest.approx(1.0, abs=1e-9)
    assert [rank_for_energy(energy, level) for level in (0.9999, 1.0)] == [2, 2]


def test_energy_matches_singular_values_reference():
    torch.manual_seed(1)
    for shape in ((200, 24), (24, 200)):  # both Gram orientations
        matrix = torch.randn(*shape) * torch.linspace(0.1, 3.0, shape[1])
        squares = torch.linalg.svdvals(matrix.double()).pow(2)
        torch.testing.assert_close(cumulative_energy(matrix), squares.cumsum(0) / squares.sum())


def test_rank_for_energy_reads_the_first_rank_reaching_the_level():
    energy = torch.tensor([0.5, 0.8, 0.9, 0.97, 1.0], dtype=torch.float64)
    assert [rank_for_energy(energy, level) for level in (0.5, 0.85, 0.9, 0.95, 0.99)] == [1, 3, 3, 4, 5]
    with pytest.raises(ConfigError):
        rank_for_energy(energy, 0.0)


def test_mean_energy_of_constant_and_zero_mean_rows():
    row = torch.randn(16)
    assert mean_energy(row.expand(10, 16)) == pytest.approx(1.0)
    assert mean_energy(torch.cat([row[None], -row[None]])) == pytest.approx(0.0, abs=1e-12)


def test_cosine_of_identical_opposite_and_orthogonal_rows():
    a = torch.tensor([[1.0, 2.0, 3.0], [1.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    b = torch.tensor([[2.0, 4.0, 6.0], [-3.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    torch.testing.assert_close(row_cosine(a, b), torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64))


def test_similarity_matrix_is_the_token_mean_of_row_cosines():
    torch.manual_seed(2)
    states = [torch.randn(32, 8) for _ in range(4)]
    matrix = similarity_matrix(states)
    for i in range(4):
        for j in range(4):
            assert float(matrix[i, j]) == pytest.approx(float(row_cosine(states[i], states[j]).mean()))
    torch.testing.assert_close(matrix.diagonal(), torch.ones(4, dtype=torch.float64))


def test_layer_similarity_reads_next_last_and_output():
    base = torch.randn(20, 6)
    # states 0 and 1 identical, 2 its negation, output orthogonal to all (disjoint channels)
    states = [torch.cat([base, torch.zeros(20, 6)], 1)] * 2 + [torch.cat([-base, torch.zeros(20, 6)], 1),
                                                               torch.cat([torch.zeros(20, 6), base], 1)]
    result = layer_similarity(states)
    assert result["num_layers"] == 3
    assert result["next_layer"] == pytest.approx([1.0, -1.0, 0.0])
    assert result["to_last_input"] == pytest.approx([-1.0, -1.0, 1.0])
    assert result["to_output"] == pytest.approx([0.0, 0.0, 0.0])


def test_chunk_min_cosine_finds_the_outlier_chunk():
    keys = torch.zeros(24, 2, 4)
    keys[:, :, 0] = 1.0  # every key along e0: cosine 1 to its chunk mean
    keys[13, 1] = torch.tensor([-1.0, 0.0, 0.0, 0.0])  # chunk 1 of head 1: mean 6/8 e0, this key opposite
    keys[20, 0] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # chunk 2 of head 0: mean (7/8, 1/8, 0, 0)
    scores = chunk_min_cosine(keys, chunk=8)
    assert scores.shape == (2, 3)
    expected_head0 = float(torch.nn.functional.cosine_similarity(
        torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.tensor([7 / 8, 1 / 8, 0.0, 0.0]), dim=0))
    torch.testing.assert_close(scores, torch.tensor([[1.0, 1.0, expected_head0], [1.0, -1.0, 1.0]],
                                                    dtype=torch.float64))


def test_chunk_min_cosine_drops_a_trailing_partial_chunk():
    keys = torch.ones(12, 1, 4)
    keys[10, 0] = -1.0  # only in the partial chunk 8..11
    assert chunk_min_cosine(keys, chunk=8).tolist() == [[pytest.approx(1.0)]]


def test_a_channel_scaled_tenfold_gives_ratio_ten():
    torch.manual_seed(3)
    x = torch.where(torch.rand(50, 2, 8) < 0.5, -1.0, 1.0)  # |x| = 1 in every channel
    x[:, 1, 3] *= 10.0
    magnitude = channel_magnitude(x)
    assert magnitude.shape == (16,) and int(magnitude.argmax()) == 8 + 3
    assert max_median_ratio(magnitude) == pytest.approx(10.0)
    assert max_median_ratio(channel_magnitude(x[:, 0])) == pytest.approx(1.0)


def _hand_made_activations() -> Activations:
    torch.manual_seed(4)
    tokens, layers = 32, 2
    keys = [torch.randn(tokens, 2, 4) for _ in range(layers)]
    for k in keys:
        k[:, 0, 2] *= 20.0  # an outlier key channel
    values = [torch.randn(tokens, 2, 4) for _ in range(layers)]
    hidden = [torch.randn(tokens, 8) for _ in range(layers + 1)]
    return Activations(hidden=hidden, attention_inputs=hidden[:layers], keys_pre=keys, keys_post=keys,
                       values=values)


def test_kv_channels_shows_the_key_outlier_and_not_in_values():
    result = kv_channels(_hand_made_activations(), layer=1)
    assert result["top_key_channel"] == [2, 2]
    assert all(k > 10 * v for k, v in zip(result["max_median_ratio"]["keys_post_rope"],
                                           result["max_median_ratio"]["values"]))
    assert len(result["key_magnitude"]) == 8
    with pytest.raises(ConfigError):
        kv_channels(_hand_made_activations(), layer=2)


def test_key_spectra_reports_every_layer_and_kind():
    result = key_spectra(_hand_made_activations())
    assert [entry["layer"] for entry in result["layers"]] == [0, 1]
    entry = result["layers"][0]
    assert entry["keys_pre_rope"]["dim"] == 8 and entry["layer_input"]["dim"] == 8
    # the 20x channel holds most of the keys' energy: rank 1 reaches 90%, not so for values
    assert entry["keys_pre_rope"]["rank"]["0.90"] == 1 < entry["values"]["rank"]["0.90"]
    assert len(entry["chunk_min_cosine"]["values"]) == 2 * 4

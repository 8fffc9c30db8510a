"""Caffe's fillers: the distributions their FillerParameter asks for."""
import numpy as np
import pytest
from google.protobuf import text_format

from cgp.errors import NetError
from cgp.fillers import fill
from cgp.proto import caffe_pb2


def filled(text, shape=(200, 50, 3, 3), seed=0):
    fp = text_format.Parse(text, caffe_pb2.FillerParameter())
    array = np.zeros(shape, np.float32)
    fill(array, fp, np.random.default_rng(seed))
    return array


def test_constant():
    assert np.all(filled('type: "constant" value: 0.25') == 0.25)
    assert np.all(filled('') == 0)  # Caffe's default filler is constant 0


def test_uniform_range_and_mean():
    a = filled('type: "uniform" min: -2 max: 3')
    assert a.min() >= -2 and a.max() <= 3
    assert abs(a.mean() - 0.5) < 0.02


def test_gaussian_moments():
    a = filled('type: "gaussian" mean: 1 std: 0.5')
    assert abs(a.mean() - 1) < 0.01 and abs(a.std() - 0.5) < 0.01


def test_xavier_scales_by_fan_in():
    fan_in = 50 * 3 * 3
    a = filled('type: "xavier"')
    bound = np.sqrt(3.0 / fan_in)
    assert np.abs(a).max() <= bound * (1 + 1e-6)
    assert abs(a.std() - bound / np.sqrt(3)) < 0.02 * bound
    avg = filled('type: "xavier" variance_norm: AVERAGE')
    assert np.abs(avg).max() <= np.sqrt(3.0 / ((fan_in + 200 * 9) / 2)) * (1 + 1e-6)


def test_msra_std():
    a = filled('type: "msra"')
    assert abs(a.std() - np.sqrt(2.0 / (50 * 9))) < 0.01 * np.sqrt(2.0 / (50 * 9)) * 5


def test_same_seed_same_weights():
    assert np.array_equal(filled('type: "gaussian"', seed=3), filled('type: "gaussian"', seed=3))
    assert not np.array_equal(filled('type: "gaussian"', seed=3), filled('type: "gaussian"', seed=4))


def test_unknown_filler_names_supported():
    with pytest.raises(NetError, match="unknown filler type 'magic'.*xavier"):
        filled('type: "magic"')

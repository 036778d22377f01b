"""The typed carriers features pass along: a batch's data keyed by its type, results copied to the host."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from service.core.device import CPU
from service.core.forward_batch import FeatureData


@dataclass
class Masks:
    rows: list[int]


@dataclass
class Splices:
    n: int


def test_feature_data_reads_back_each_type_it_holds():
    data = FeatureData()
    assert data.get(Masks) is None and Masks not in data and len(data) == 0
    masks, splices = Masks([1, 2]), Splices(3)
    data.put(masks)
    data.put(splices)
    assert data[Masks] is masks and data.get(Splices) is splices and len(data) == 2
    data.put(Masks([4]))  # one per feature: a second put replaces the first
    assert data[Masks].rows == [4]
    with pytest.raises(KeyError):
        data[int]


@dataclass
class Values:
    lp: torch.Tensor
    top: torch.Tensor | None = None
    cache: list[int] | None = field(default=None, init=False)


@dataclass
class Output:
    output: Values
    input: Values | None = None


def test_tree_to_host_rebuilds_nested_dataclasses():
    out = Output(Values(torch.zeros(2), torch.ones(2, 3)))
    out.output.cache = [1]
    host = CPU.tree_to_host(out)
    assert isinstance(host, Output) and host is not out and host.input is None
    assert torch.equal(host.output.lp, out.output.lp) and torch.equal(host.output.top, out.output.top)
    assert host.output.cache is None  # not an init field: derived again on the host

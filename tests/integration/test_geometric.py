"""PyTorch Geometric: a list of Data graphs of different sizes, batched by the model itself."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import dataparallel as dp

from ._oracle import LAYOUTS, check

pyg = pytest.importorskip("torch_geometric", reason="torch_geometric is not installed")
from torch_geometric.data import Batch, Data  # noqa: E402
from torch_geometric.nn import GCNConv, global_mean_pool  # noqa: E402


class GraphClassifier(nn.Module):
    """Takes a list of graphs and batches them itself (as PyG's own DataParallel expects)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = GCNConv(4, 8)
        self.conv2 = GCNConv(8, 8)
        self.head = nn.Linear(8, 3)
        self.devices_seen: list[torch.device] = []

    def forward(self, graphs: list[Data]) -> torch.Tensor:
        batch = Batch.from_data_list(graphs)
        self.devices_seen.append(batch.x.device)
        h = self.conv1(batch.x, batch.edge_index).relu()
        h = self.conv2(h, batch.edge_index)
        return self.head(global_mean_pool(h, batch.batch))


def graphs(batch: int) -> list[Data]:
    gen = torch.Generator().manual_seed(batch)
    out = []
    for i in range(batch):
        n = 2 + (5 * i) % 7
        edges = torch.randint(0, n, (2, 2 * n), generator=gen)
        out.append(
            Data(x=torch.randn(n, 4, generator=gen), edge_index=edges, y=torch.tensor([i % 3]))
        )
    return out


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_list_of_graphs_is_split_per_sample(devices: list[str], batch: int) -> None:
    data = graphs(batch)
    labels = torch.tensor([i % 3 for i in range(batch)])

    def loss(out: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(out, labels)

    model = GraphClassifier()
    check("pyg list of Data", model, (data,), {}, loss, devices)
    plan = dp.DataParallel(model, devices).explain(data)
    [entry] = plan.entries
    assert entry.rule == "per-sample" and "own .to(device)" in entry.why
    assert plan.chunk_sizes == ([3, 2] if batch == 5 else [3, 2, 2])
    assert all(g.x.device.type == "cpu" for g in data)  # the caller's graphs are not changed


class _Recorder(Data):
    """A Data whose .to records where it was sent (PyG's own .to moves in place)."""

    moved_to: ClassVar[list[str]] = []

    def to(self, device: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        _Recorder.moved_to.append(str(device))
        return super().to(device, *args, **kwargs)


def test_each_graph_is_moved_by_its_own_to() -> None:
    items = [_Recorder(x=g.x, edge_index=g.edge_index) for g in graphs(5)]
    _Recorder.moved_to = []
    chunks = dp.scatter((items,), ["cpu", "cpu:1"])
    assert sorted(_Recorder.moved_to) == ["cpu"] * 3 + ["cpu:1"] * 2
    assert [len(c[0]) for c in chunks] == [3, 2]
    assert all(
        a is not b for a, b in zip(chunks[0][0], items[:3], strict=True)
    )  # copies, not the caller's
    assert torch.equal(chunks[1][0][0].x, items[3].x)


class BatchClassifier(GraphClassifier):
    """Takes PyG's whole Batch, as a script written for one device does."""

    def forward(self, batch: Batch) -> torch.Tensor:  # type: ignore[override]
        self.devices_seen.append(batch.x.device)
        h = self.conv1(batch.x, batch.edge_index).relu()
        h = self.conv2(h, batch.edge_index)
        return self.head(global_mean_pool(h, batch.batch))


def test_a_whole_batch_runs_on_one_device_and_says_so_once() -> None:
    """Item 13 of issue 39: one Batch object is not batched by the rules (it is one object):
    the module runs once, on the first device, with a warning naming explain and the port
    (a list of Data); once per wrapper. A batch of one sample is not warned."""
    model = BatchClassifier()
    wrapper = dp.DataParallel(model, ["cpu", "cpu:1", "cpu:1"])
    whole = Batch.from_data_list(graphs(7))
    with pytest.warns(UserWarning, match=r"no input of this call has a batch dimension") as got:
        out = wrapper(whole)
    message = str(got[0].message)
    assert "w.explain(...)" in message and "a list of Data" in message
    assert "ran once, on cpu alone" in message
    assert torch.allclose(out, model(whole)) and out.shape == (7, 3)
    assert wrapper.last_call is not None and wrapper.last_call.chunk_sizes == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapper(whole)  # once per wrapper
        dp.DataParallel(nn.Linear(4, 2), ["cpu", "cpu"])(torch.randn(1, 4))  # a batch of one
    [entry] = wrapper.explain(whole).entries
    assert entry.rule == "broadcast"

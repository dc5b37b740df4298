"""``ReplicaSets.kept``: the warm call's one answer (replicas, serial mark, SyncBatchNorm), kept
from one sync to the next, follows every fill.

The answer is read as it is while the snapshot finds the tree unwritten; a write refills the
replicas, and a refill can mark them serial or unmark them: the next answer says so, as
``serial_mark`` of the replicas does.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from dataparallel.replicate import ReplicaSets, serial_mark

DEVICES = (torch.device("cpu"), torch.device("cpu"))


class Net(nn.Module):
    def __init__(self, norm: type[nn.Module] = nn.Identity) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.norm = norm(4) if norm is not nn.Identity else nn.Identity()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def test_the_answer_is_kept_while_nothing_is_written_and_follows_a_serial_mark() -> None:
    model = Net()
    sets = ReplicaSets()
    sets.replicate(model, DEVICES)
    first = sets.kept(model, DEVICES)
    assert first is not None and first[1] is None and first[2] is False
    assert sets.kept(model, DEVICES) is first  # nothing written: the same answer
    registry: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()
    registry["model"] = model
    model.lin.registry = registry  # a write (a refill, the same structure) that cannot be rebound
    with pytest.warns(UserWarning, match="one after another"):
        marked = sets.kept(model, DEVICES)
    assert marked is not None and marked is not first
    replicas, serial, _ = marked
    assert serial is not None and serial == serial_mark(replicas)  # before: the old answer
    assert sets.kept(model, DEVICES) is marked
    del model.lin.registry
    unmarked = sets.kept(model, DEVICES)
    assert unmarked is not None and unmarked[1] is None and serial_mark(unmarked[0]) is None


@pytest.mark.parametrize("norm", [nn.SyncBatchNorm, nn.BatchNorm1d])
def test_the_answer_says_whether_the_replicas_hold_a_sync_batchnorm(
    norm: type[nn.Module],
) -> None:
    model = Net(norm)
    sets = ReplicaSets()
    sets.replicate(model, DEVICES)
    answer = sets.kept(model, DEVICES)
    assert answer is not None and answer[2] is (norm is nn.SyncBatchNorm)
    model.eval()  # a write: a refill, the same structure
    again = sets.kept(model, DEVICES)
    assert again is not None and again is not answer and again[2] is answer[2]


def test_no_answer_for_another_module_or_a_shared_owner() -> None:
    model = Net()
    sets = ReplicaSets()
    sets.replicate(model, DEVICES)
    assert sets.kept(Net(), DEVICES) is None
    shared = ReplicaSets(shared=True)
    shared.replicate(model, DEVICES)
    assert shared.kept(model, DEVICES) is None


def test_the_writes_guard_keeps_the_parameters_never_a_copy() -> None:
    """The shared slots' tensors the guard reads on every call (``ForwardWrites.tensors``)
    are the module's parameters, read once; on a device list whose replicas share copies
    (``cpu:1`` twice, the parameters on ``cpu``) they must not keep the first call's copies
    alive."""
    model = Net()
    devices = (torch.device("cpu", 1), torch.device("cpu", 1))
    sets = ReplicaSets()
    replicas = sets.replicate(model, devices)
    entry = sets.sets[devices]
    assert replicas[0].lin.weight is not model.lin.weight  # copies, shared by both replicas
    assert entry.writes.shared
    params = list(model.parameters())
    assert all(any(t is p for p in params) for t in entry.writes.tensors)

"""Read-through (issue 39): a public name the wrapper does not define is the module's, read and
written; the wrapper's own names (its options, torch's attributes, nn.Module's API, private
names) stay its own; isinstance, ``.module`` and state_dict keys are torch's."""

from __future__ import annotations

import copy
import pickle
from typing import Any, cast

import pytest
import torch
from torch import nn

import dataparallel as dp


class Detect(nn.Module):
    """YOLOv5's last layer: scripts read ``nl`` and ``stride`` from it after training."""

    def __init__(self) -> None:
        super().__init__()
        self.nl = 3
        self.conv = nn.Linear(4, 2)
        self.register_buffer("stride", torch.tensor([8.0, 16.0, 32.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 4), Detect())
        self.features = nn.Linear(4, 4)
        self.names = ["a", "b"]
        self._secret = "private"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(self.features(x))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """A method of the model's own: through the wrapper, the module itself runs it."""
        assert torch.is_grad_enabled() or not self.training
        return self.features(x) * 2

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


def _wrapped() -> tuple[Net, dp.DataParallel]:
    torch.manual_seed(0)
    net = Net()
    return net, dp.DataParallel(net, ["cpu", "cpu"])


def test_reads_give_the_modules_attributes_and_methods() -> None:
    net, w = _wrapped()
    assert w.names is net.names and w.features is net.features and w.device == net.device
    assert {"embed", "names", "explain", "module", "max_size"} <= set(dir(w))
    x = torch.randn(6, 4)
    assert w.embed.__self__ is net  # the module's own method: w.module.embed
    assert torch.equal(w.embed(x), net.embed(x))
    assert w.last_call is None  # the wrapper's call machinery did not run for it


def test_the_wrappers_names_stay_its_own() -> None:
    net, w = _wrapped()
    assert isinstance(w, nn.DataParallel) and w.module is net
    assert all(k.startswith("module.") for k in w.state_dict())
    names = [f"module.{n}" for n, _ in net.named_parameters()]
    assert [n for n, _ in w.named_parameters()] == names
    assert w.forward.__self__ is w and w.dim == 0 and w.training is net.training
    assert w.device_ids == [torch.device("cpu")] * 2
    with pytest.raises(AttributeError, match="_secret"):
        w._secret  # noqa: B018  private names are each object's own
    with pytest.raises(AttributeError, match=r"no attribute 'nothing', and neither has its module"):
        w.nothing  # noqa: B018


def test_yolov5_de_parallel_reads_the_model_through_the_wrapper() -> None:
    """Item 11: YOLOv5's de_parallel tests type(), which is False for the subclass, so the
    script reads model.model[-1] on the wrapper (before: AttributeError ... 'model')."""

    def is_parallel(model: nn.Module) -> bool:
        return type(model) in (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)

    def de_parallel(model: nn.Module) -> nn.Module:
        return model.module if is_parallel(model) else model  # type: ignore[return-value]

    net, w = _wrapped()
    assert not is_parallel(w)  # what a type() test sees (the guide's differences table)
    detect = cast(Any, de_parallel(w)).model[-1]
    assert torch.equal(detect.stride, torch.tensor([8.0, 16.0, 32.0])) and detect.nl == 3
    assert detect is net.model[-1]
    x = torch.randn(5, 4)
    assert torch.allclose(w(x), net(x))


def test_writes_of_the_modules_names_land_on_the_module() -> None:
    net, w = _wrapped()
    new = nn.Linear(4, 4)
    w.features = new
    assert net.features is new and "features" not in w._modules
    assert "module.features.weight" in w.state_dict() and "features.weight" not in w.state_dict()
    w.threshold = 0.5  # a new public name: the module's too, so its forward can read it
    assert net.threshold == 0.5 and w.threshold == 0.5 and "threshold" not in w.__dict__
    del w.threshold
    assert not hasattr(net, "threshold")
    w._mine = 1  # private: the wrapper's
    assert w.__dict__["_mine"] == 1 and not hasattr(net, "_mine")
    x = torch.randn(5, 4)
    assert torch.allclose(w(x), net(x))  # the replicas see the new submodule


def test_the_options_are_the_wrappers_and_checked() -> None:
    """Item 12: the constructor's options are the wrapper's names, checked when assigned;
    the module's attribute of the same name is read on w.module."""
    net, w = _wrapped()
    net.batch_size = 8  # type: ignore[assignment]
    assert w.batch_size is None and w.dtype is None  # the options, unset
    with pytest.raises(TypeError, match=r"strict: expected True or False, got str 'yes'"):
        w.strict = "yes"
    with pytest.raises(TypeError, match="strict: expected True or False"):
        dp.DataParallel(net, ["cpu", "cpu"], strict="yes")  # type: ignore[arg-type]
    w.batch_size = 64
    assert w.options["batch_size"] == 64 and net.batch_size == 8
    with pytest.raises(ValueError, match=r"batch_size: 64.*w\.module\.batch_size"):
        w(torch.randn(6, 4))
    w.batch_size = None
    assert w(torch.randn(6, 4)).shape == (6, 2)


def test_copies_and_pickles_still_work() -> None:
    net, w = _wrapped()
    x = torch.randn(5, 4)
    for again in (copy.deepcopy(w), pickle.loads(pickle.dumps(w))):
        assert again.names == ["a", "b"] and again.module is not net
        assert torch.allclose(again(x), w(x))
    assert not hasattr(w, "__array_interface__")

"""Conventions of the wrappers users come from: mmcv's ``-1`` for the CPU, and the step methods
(``train_step``, ``val_step``, ``test_step``) of mmcv's and mmengine's models.

mmcv and mmengine are not installed here: the models below follow their documented shapes
(mmcv 1.x ``BaseDetector.train_step(data, optimizer) -> dict(loss, log_vars, num_samples)``;
mmengine ``BaseModel.train_step(data, optim_wrapper) -> log_vars``, with ``data_preprocessor``,
``parse_losses`` and ``OptimWrapper.update_params``/``optim_context``), checked against the
same model on one device.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]


def _data(n: int = 7) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "img": torch.randn(n, 5, generator=gen),
        "gt_label": torch.randint(0, 3, (n,), generator=gen),
        "img_metas": [{"id": i} for i in range(n)],  # per-sample records
    }


class MmcvStyle(nn.Module):
    """mmcv 1.x's model shape: forward(**data) -> losses; train_step parses them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 3)
        self.steps = 0

    def forward(self, img: torch.Tensor, gt_label: torch.Tensor, img_metas: list) -> Any:
        return {"loss_cls": nn.functional.cross_entropy(self.fc(img), gt_label)}

    def train_step(self, data: dict[str, Any], optimizer: Any) -> dict[str, Any]:
        losses = self(**data)
        loss = sum(losses.values())
        log_vars = OrderedDict(loss=float(loss.item()))
        return {"loss": loss, "log_vars": log_vars, "num_samples": len(data["img_metas"])}

    def val_step(self, data: dict[str, Any], optimizer: Any = None) -> dict[str, Any]:
        return self.train_step(data, optimizer)

    def test_step(self, data: dict[str, Any]) -> list[int]:
        return self.fc(data["img"]).argmax(1).tolist()  # one prediction per sample


@pytest.mark.parametrize("devices", [[-1, -1], ["cpu", -1]])
def test_minus_one_is_the_cpu_in_device_lists(devices: list[Any]) -> None:
    model = nn.Linear(5, 2)
    x = torch.randn(6, 5)
    wrapper = dp.DataParallel(model, devices)
    assert wrapper.device_ids == [torch.device("cpu")] * 2
    assert_close_rel(wrapper(x), model(x))
    assert [c.shape[0] for c in dp.scatter(x, [-1, -1])] == [3, 3]
    assert_close_rel(dp.data_parallel(model, x, [-1], -1), model(x))


@pytest.mark.parametrize("devices", DEVICE_LISTS)
def test_mmcv_train_step_runs_split_and_gathers(devices: list[str]) -> None:
    ref_model = MmcvStyle()
    model = copy.deepcopy(ref_model)
    data = _data()
    ref = ref_model.train_step(data, None)
    ref["loss"].backward()
    out = dp.DataParallel(model, devices).train_step(data, None)
    out["loss"].backward()
    assert_close_rel(out["loss"], ref["loss"], msg="loss")
    assert out["num_samples"] == 7  # each chunk's count, summed
    assert out["log_vars"]["loss"] == pytest.approx(ref["log_vars"]["loss"], rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert_close_rel(p.grad, q.grad, msg=name)  # type: ignore[arg-type]


def test_mmcv_val_and_test_steps() -> None:
    model = MmcvStyle()
    data = _data(8)
    wrapper = dp.DataParallel(model, ["cpu", "cpu:1"])
    with torch.no_grad():
        assert_close_rel(wrapper.val_step(data)["loss"], model.val_step(data)["loss"])
        assert wrapper.test_step(data) == model.test_step(data)  # per-sample, batch order
    assert wrapper.last_call is not None and wrapper.last_call.chunk_sizes == [4, 4]


def test_step_methods_exist_only_where_the_module_has_them() -> None:
    plain = dp.DataParallel(nn.Linear(2, 2), ["cpu", "cpu"])
    for name in ("train_step", "val_step", "test_step"):
        assert not hasattr(plain, name)
    with pytest.raises(AttributeError, match="train_step"):
        plain.train_step({}, None)
    wrapper = dp.DataParallel(MmcvStyle(), ["cpu", "cpu"])
    assert all(hasattr(wrapper, n) for n in ("train_step", "val_step", "test_step"))


# -- mmengine: train_step(data, optim_wrapper) steps once, through the wrapper's forward -----


class Preprocessor(nn.Module):
    """mmengine's data preprocessor shape: stack the inputs, keep the data samples."""

    def forward(self, data: dict[str, Any], training: bool = False) -> dict[str, Any]:
        return {"inputs": torch.stack(data["inputs"]), "data_samples": data["data_samples"]}


class MmengineStyle(nn.Module):
    """mmengine's BaseModel shape: forward(inputs, data_samples, mode)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.data_preprocessor = Preprocessor()
        self.fc = nn.Linear(5, 3)

    def forward(self, inputs: torch.Tensor, data_samples: list, mode: str = "tensor") -> Any:
        logits = self.fc(inputs)
        if mode == "loss":
            labels = torch.tensor([s["label"] for s in data_samples])
            return {"loss_cls": nn.functional.cross_entropy(logits, labels)}
        if mode == "predict":
            preds = logits.argmax(1).tolist()
            return [dict(s, pred=p) for s, p in zip(data_samples, preds, strict=True)]
        return logits

    def parse_losses(self, losses: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        loss = sum(losses.values())
        return loss, {"loss": loss.detach()}  # type: ignore[return-value]

    def train_step(self, data: dict[str, Any], optim_wrapper: Any) -> dict[str, Any]:
        with optim_wrapper.optim_context(self):
            data = self.data_preprocessor(data, True)
            losses = self(**data, mode="loss")
        parsed, log_vars = self.parse_losses(losses)
        optim_wrapper.update_params(parsed)
        return log_vars

    def val_step(self, data: dict[str, Any]) -> list:
        return self(**self.data_preprocessor(data, False), mode="predict")

    test_step = val_step


class OptimWrapper:
    """mmengine's OptimWrapper shape: update_params runs backward and step once."""

    def __init__(self, params: Iterator[nn.Parameter]) -> None:
        self.optimizer = torch.optim.SGD(params, lr=0.5)
        self.updates = 0

    @contextlib.contextmanager
    def optim_context(self, model: nn.Module) -> Iterator[None]:
        yield

    def update_params(self, loss: torch.Tensor) -> None:
        self.updates += 1
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def _mm_data(n: int = 7) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {
        "inputs": [torch.randn(5, generator=gen) for _ in range(n)],
        "data_samples": [{"label": i % 3, "id": i} for i in range(n)],
    }


@pytest.mark.parametrize("devices", DEVICE_LISTS)
def test_mmengine_train_step_updates_once_as_on_one_device(devices: list[str]) -> None:
    ref_model = MmengineStyle()
    model = copy.deepcopy(ref_model)
    ref_opt, opt = OptimWrapper(ref_model.parameters()), OptimWrapper(model.parameters())
    wrapper = dp.DataParallel(model, devices)
    for _ in range(2):
        ref_log = ref_model.train_step(_mm_data(), ref_opt)
        log = wrapper.train_step(_mm_data(), opt)
        assert_close_rel(log["loss"], ref_log["loss"], msg="loss")
    assert opt.updates == ref_opt.updates == 2  # once per step, not once per replica
    assert wrapper.last_call is not None and len(wrapper.last_call.chunk_sizes) == len(devices)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert_close_rel(p.detach(), q.detach(), msg=name)
    preds = wrapper.val_step(_mm_data())
    assert preds == ref_model.val_step(_mm_data())
    assert wrapper.test_step(_mm_data()) == preds

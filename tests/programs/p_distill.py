"""Knowledge distillation: a student trained on a frozen teacher's softened outputs.

Source: haitongli/knowledge-distillation-pytorch model/net.py

Ported: ``loss_fn_kd``, the KL divergence between the student's and the teacher's
temperature-softened distributions, scaled by ``alpha * T * T``, plus the cross-entropy with
the labels weighted ``1 - alpha``; the training step of ``train_kd.py``: the teacher in eval
mode under ``torch.no_grad()``, the student in train mode, each wrapped as the script wraps
both in ``nn.DataParallel``. The networks are small MLPs with dropout off.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp

ALPHA, TEMPERATURE = 0.9, 4.0


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(10, 12), nn.ReLU(), nn.Linear(12, 5))
        self.teacher = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 5))
        for p in self.teacher.parameters():
            p.requires_grad = False


def loss_fn_kd(outputs: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    soft = nn.KLDivLoss(reduction="batchmean")(
        F.log_softmax(outputs / TEMPERATURE, dim=1), F.softmax(teacher / TEMPERATURE, dim=1)
    )
    return soft * (ALPHA * TEMPERATURE * TEMPERATURE) + F.cross_entropy(outputs, labels) * (
        1.0 - ALPHA
    )


def build() -> nn.Module:
    torch.manual_seed(0)
    return Pair()


def wrap(model: Any, devices: list[str]) -> Any:
    return SimpleNamespace(
        student=dp.DataParallel(model.student, devices),
        teacher=dp.DataParallel(model.teacher, devices),
    )


def plain(model: Any) -> Any:
    return SimpleNamespace(student=model.student, teacher=model.teacher)


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.student.parameters(), lr=0.1, momentum=0.9)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(9, 10, generator=gen), torch.randint(0, 5, (9,), generator=gen))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    x, labels = batch
    model.teacher.eval()
    model.student.train()
    with torch.no_grad():
        teacher = run.teacher(x)
    outputs = run.student(x)
    loss = loss_fn_kd(outputs, labels, teacher)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "outputs": outputs.detach(), "teacher": teacher}

"""Realtime multi-person pose estimation: a CPM of six two-branch stages, a masked L2 loss per
stage and branch, the trunk frozen first and released later.

Source: tensorboy/pytorch_Realtime_Multi-Person_Pose_Estimation lib/network/rtpose_vgg.py

Ported: ``get_model``'s ``rtpose_model`` (``make_vgg19_block`` for the trunk ``model0``,
``make_stages`` for stage 1's two branches and stages 2 to 6, each fed the previous stage's
part affinity fields and heatmaps concatenated with the trunk's features; forward returns
``((out6_1, out6_2), saved_for_loss)``, the twelve stage outputs in a list), its normal
initialisation, and the training script's step as ``train.py`` had it with masks (revision
0249cad, before the masks were dropped): ``get_loss`` (per stage, ``MSELoss`` of the PAFs and of
the heatmaps, prediction and target each multiplied by the crowd mask, summed over the twelve;
the logged ``loss_stage*`` values and the maximum and minimum of the last heatmaps and PAFs),
``AverageMeter``-style logging by ``item()``, SGD with Nesterov momentum over the trainable
parameters while the trunk's first layers are frozen (``requires_grad = False`` after the
wrapper is built, as the script does), then all weights released and a new optimizer built, and
``validate``'s loss under ``eval()``. Sizes: 8 x 8 images, a 4 x 4 output, 4 PAF and 3
heatmap channels, a trunk of two convolutions, stage 1 of two 4-wide convolutions per branch
and stages 2 to 6 of one (the script's have five and seven), 3 x 3 kernels where the stages
have 7 x 7 (each convolution's backward is a parallel region, costly on a busy CPU); ``lr`` 1.0
as the script's default.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.nn import init

PAFS, HEATS, WIDTH = 4, 3, 4
FROZEN = 2  # the trunk's first parameters frozen (the script's ``model0[i] for i in range(20)``)


def make_stages(cfg_dict: list[dict[str, list[int]]]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(cfg_dict) - 1):
        for k, v in cfg_dict[i].items():
            if "pool" in k:
                layers += [nn.MaxPool2d(kernel_size=v[0], stride=v[1], padding=v[2])]
            else:
                layers += [nn.Conv2d(v[0], v[1], v[2], v[3], v[4]), nn.ReLU(inplace=True)]
    v = next(iter(cfg_dict[-1].values()))
    layers += [nn.Conv2d(v[0], v[1], v[2], v[3], v[4])]
    return nn.Sequential(*layers)


def make_vgg19_block(block: list[dict[str, list[int]]]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for one in block:
        for k, v in one.items():
            if "pool" in k:
                layers += [nn.MaxPool2d(kernel_size=v[0], stride=v[1], padding=v[2])]
            else:
                layers += [nn.Conv2d(v[0], v[1], v[2], v[3], v[4]), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers)


class RtPose(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        w, cat = WIDTH, PAFS + HEATS + WIDTH
        self.model0 = make_vgg19_block(
            [
                {"conv1_1": [3, w, 3, 1, 1]},
                {"pool1_stage1": [2, 2, 0]},
                {"conv4_4_CPM": [w, w, 3, 1, 1]},
            ]
        )
        self.model1_1 = make_stages(
            [{"conv5_1_CPM_L1": [w, w, 3, 1, 1]}, {"conv5_5_CPM_L1": [w, PAFS, 1, 1, 0]}]
        )
        self.model1_2 = make_stages(
            [{"conv5_1_CPM_L2": [w, w, 3, 1, 1]}, {"conv5_5_CPM_L2": [w, HEATS, 1, 1, 0]}]
        )
        for i in range(2, 7):
            for branch, out in ((1, PAFS), (2, HEATS)):
                stage = make_stages([{f"Mconv7_stage{i}_L{branch}": [cat, out, 3, 1, 1]}])
                setattr(self, f"model{i}_{branch}", stage)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                init.normal_(m.weight, std=0.01)
                if m.bias is not None:
                    init.constant_(m.bias, 0.0)

    def forward(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], list[Any]]:
        saved_for_loss = []
        out1 = self.model0(x)
        inp = out1
        for i in range(1, 7):
            out_1 = getattr(self, f"model{i}_1")(inp)
            out_2 = getattr(self, f"model{i}_2")(inp)
            saved_for_loss.append(out_1)
            saved_for_loss.append(out_2)
            inp = torch.cat([out_1, out_2, out1], 1)
        return (out_1, out_2), saved_for_loss


def build_names() -> list[str]:
    return [f"loss_stage{j}_L{k}" for j in range(1, 7) for k in range(1, 3)]


def get_loss(
    saved_for_loss: list[torch.Tensor],
    heat_temp: torch.Tensor,
    heat_weight: torch.Tensor,
    vec_temp: torch.Tensor,
    vec_weight: torch.Tensor,
) -> tuple[Any, OrderedDict[str, float]]:
    names = build_names()
    saved_for_log: OrderedDict[str, float] = OrderedDict()
    criterion = nn.MSELoss(reduction="mean")
    total_loss: Any = 0
    for j in range(6):
        pred1 = saved_for_loss[2 * j] * vec_weight
        gt1 = vec_temp * vec_weight
        pred2 = saved_for_loss[2 * j + 1] * heat_weight
        gt2 = heat_weight * heat_temp
        loss1 = criterion(pred1, gt1)
        loss2 = criterion(pred2, gt2)
        total_loss += loss1
        total_loss += loss2
        saved_for_log[names[2 * j]] = loss1.item()
        saved_for_log[names[2 * j + 1]] = loss2.item()
    saved_for_log["max_ht"] = torch.max(saved_for_loss[-1].data[:, 0:-1, :, :]).item()
    saved_for_log["min_ht"] = torch.min(saved_for_loss[-1].data[:, 0:-1, :, :]).item()
    saved_for_log["max_paf"] = torch.max(saved_for_loss[-2].data).item()
    saved_for_log["min_paf"] = torch.min(saved_for_loss[-2].data).item()
    return total_loss, saved_for_log


def build() -> nn.Module:
    torch.manual_seed(0)
    return RtPose()


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0, momentum=0.9, weight_decay=0.0, nesterov=True)


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    # fix the VGG weights first; they are released later (``step``)
    for param in list(model.model0.parameters())[:FROZEN]:
        param.requires_grad = False
    return [_sgd([param for param in model.parameters() if param.requires_grad])]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(368)
    out = []
    for _ in range(3):
        img = torch.randn(6, 3, 8, 8, generator=gen)
        heat = torch.rand(6, HEATS, 4, 4, generator=gen)
        paf = torch.randn(6, PAFS, 4, 4, generator=gen) * 0.5
        heat_mask = (torch.rand(6, 1, 4, 4, generator=gen) > 0.2).float().expand(-1, HEATS, -1, -1)
        paf_mask = heat_mask[:, :1].expand(-1, PAFS, -1, -1)
        out.append((img, heat, heat_mask.contiguous(), paf, paf_mask.contiguous()))
    return out


def step(model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]) -> dict[str, Any]:
    memo["n"] = memo.get("n", 0) + 1
    if memo["n"] == 3:  # release all weights, and a new optimizer over them
        for param in model.parameters():
            param.requires_grad = True
        memo["opt"] = _sgd([param for param in model.parameters() if param.requires_grad])
    optimizer = memo.get("opt", opts[0])
    img, heatmap_target, heat_mask, paf_target, paf_mask = batch
    run.train()
    _, saved_for_loss = run(img)
    total_loss, saved_for_log = get_loss(
        saved_for_loss, heatmap_target, heat_mask, paf_target, paf_mask
    )
    optimizer.zero_grad()
    total_loss.backward()
    optimizer.step()
    run.eval()  # validate
    _, saved = run(img)
    val_loss, _ = get_loss(saved, heatmap_target, heat_mask, paf_target, paf_mask)
    return {
        "loss": total_loss.detach(),
        "log": list(saved_for_log.values()),
        "val_loss": val_loss.item(),
        "heatmaps": saved_for_loss[-1].detach(),
    }

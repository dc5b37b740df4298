"""SCAN: clustering heads trained so that each image agrees with its mined neighbours, with an
entropy term over the batch's mean prediction.

Source: wvangansbeke/Unsupervised-Classification utils/train_utils.py

Ported: ``ClusteringModel`` (a CIFAR ResNet backbone of ``BasicBlock``s with BatchNorm, its
kaiming initialisation, and ``nheads`` linear cluster heads; ``forward_pass`` ``'default'``,
``'backbone'``, ``'head'`` and ``'return_all'``), ``SCANLoss`` (the softmax of anchors and
neighbours, their dot product under ``BCELoss`` against ones, minus ``entropy_weight`` times the
entropy of the batch's mean anchor prediction) and ``scan_train``: the anchors and their
neighbours through the wrapper in two calls, the loss per head on the gathered outputs, the
heads' losses summed, Adam (``get_optimizer``); the first two steps update the whole network
(``update_cluster_head_only: False``, the CIFAR configs), the third only the heads, as the
ImageNet configs do (``model.eval()``, the backbone's features under ``no_grad``, then the heads
with ``forward_pass='head'``, the optimizer rebuilt over the heads). After each step,
``get_predictions``' call: ``forward_pass='return_all'`` under ``eval()`` and ``no_grad``, the
features and each head's probabilities. The entropy is a statistic over the batch, but the
script computes it outside the model on the gathered outputs, so it is one device's; the
backbone's BatchNorm is converted with ``nn.SyncBatchNorm.convert_sync_batchnorm`` (the guide's
way to one device's statistics; the script's replicas normalise their own chunks, and without
the conversion ``check=`` names ``output[0]``, 8% off, and that fix). Sizes: two
heads, 5 clusters, a ResNet of one block per stage 4 to 8 wide, 8 x 8 images, batches of 6
(chunks of 2 on three devices: each replica's list of two heads has the chunk's length);
Adam's learning rate raised from 1e-4 to 1e-2 so that three steps move the weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp

EPS = 1e-8
NCLUSTERS, NHEADS = 5, 2


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return F.relu(out)


class ResNet(nn.Module):
    def __init__(self, num_blocks: list[int]) -> None:
        super().__init__()
        self.in_planes = 4
        self.conv1 = nn.Conv2d(3, 4, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.layer1 = self._make_layer(4, num_blocks[0], 1)
        self.layer2 = self._make_layer(8, num_blocks[1], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, num_blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (num_blocks - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer2(self.layer1(out))
        return torch.flatten(self.avgpool(out), 1)


class ClusteringModel(nn.Module):
    def __init__(self, backbone: dict[str, Any], nclusters: int, nheads: int = 1) -> None:
        super().__init__()
        self.backbone = backbone["backbone"]
        self.backbone_dim = backbone["dim"]
        self.nheads = nheads
        self.cluster_head = nn.ModuleList(
            [nn.Linear(self.backbone_dim, nclusters) for _ in range(self.nheads)]
        )

    def forward(self, x: torch.Tensor, forward_pass: str = "default") -> Any:
        if forward_pass == "default":
            features = self.backbone(x)
            out: Any = [cluster_head(features) for cluster_head in self.cluster_head]
        elif forward_pass == "backbone":
            out = self.backbone(x)
        elif forward_pass == "head":
            out = [cluster_head(x) for cluster_head in self.cluster_head]
        elif forward_pass == "return_all":
            features = self.backbone(x)
            out = {
                "features": features,
                "output": [cluster_head(features) for cluster_head in self.cluster_head],
            }
        else:
            raise ValueError(f"Invalid forward pass {forward_pass}")
        return out


def entropy(x: torch.Tensor, input_as_probabilities: bool) -> torch.Tensor:
    if input_as_probabilities:
        x_ = torch.clamp(x, min=EPS)
        b = x_ * torch.log(x_)
    else:
        b = F.softmax(x, dim=1) * F.log_softmax(x, dim=1)
    if len(b.size()) == 2:  # sample-wise entropy
        return -b.sum(dim=1).mean()
    if len(b.size()) == 1:  # distribution-wise entropy
        return -b.sum()
    raise ValueError(f"Input tensor is {len(b.size())}-Dimensional")


class SCANLoss(nn.Module):
    def __init__(self, entropy_weight: float = 2.0) -> None:
        super().__init__()
        self.softmax = nn.Softmax(dim=1)
        self.bce = nn.BCELoss()
        self.entropy_weight = entropy_weight

    def forward(
        self, anchors: torch.Tensor, neighbors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n = anchors.size()
        anchors_prob = self.softmax(anchors)
        positives_prob = self.softmax(neighbors)
        similarity = torch.bmm(anchors_prob.view(b, 1, n), positives_prob.view(b, n, 1)).squeeze()
        ones = torch.ones_like(similarity)
        consistency_loss = self.bce(similarity, ones)
        entropy_loss = entropy(torch.mean(anchors_prob, 0), input_as_probabilities=True)
        total_loss = consistency_loss - self.entropy_weight * entropy_loss
        return total_loss, consistency_loss, entropy_loss


def build() -> nn.Module:
    torch.manual_seed(0)
    return ClusteringModel({"backbone": ResNet([1, 1]), "dim": 8}, NCLUSTERS, NHEADS)


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return dp.DataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(model), devices)


def get_optimizer(model: Any, cluster_head_only: bool = False) -> torch.optim.Optimizer:
    if cluster_head_only:  # only the weights of the cluster heads are updated
        for name, param in model.named_parameters():
            param.requires_grad = "cluster_head" in name
        params: Any = list(filter(lambda p: p.requires_grad, model.parameters()))
        assert len(params) == 2 * NHEADS
    else:
        params = model.parameters()
    return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-4)


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [get_optimizer(model)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(20)
    out = []
    for _ in range(3):
        anchor = torch.randn(6, 3, 8, 8, generator=gen)
        neighbor = anchor + 0.3 * torch.randn(6, 3, 8, 8, generator=gen)  # a mined neighbour
        out.append({"anchor": anchor, "neighbor": neighbor})
    return out


def step(model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]) -> dict[str, Any]:
    memo["n"] = memo.get("n", 0) + 1
    update_cluster_head_only = memo["n"] == 3
    if update_cluster_head_only:
        memo["opt"] = get_optimizer(run, cluster_head_only=True)
    optimizer = memo.get("opt", opts[0])
    criterion = SCANLoss(entropy_weight=5.0)
    if update_cluster_head_only:
        run.eval()  # no need to update BN
    else:
        run.train()  # update BN
    anchors, neighbors = batch["anchor"], batch["neighbor"]
    if update_cluster_head_only:  # only the heads get gradients
        with torch.no_grad():
            anchors_features = run(anchors, forward_pass="backbone")
            neighbors_features = run(neighbors, forward_pass="backbone")
        anchors_output = run(anchors_features, forward_pass="head")
        neighbors_output = run(neighbors_features, forward_pass="head")
    else:
        anchors_output = run(anchors)
        neighbors_output = run(neighbors)
    total_loss, consistency_loss, entropy_loss = [], [], []
    for anchors_output_subhead, neighbors_output_subhead in zip(
        anchors_output, neighbors_output, strict=True
    ):
        total_loss_, consistency_loss_, entropy_loss_ = criterion(
            anchors_output_subhead, neighbors_output_subhead
        )
        total_loss.append(total_loss_)
        consistency_loss.append(consistency_loss_)
        entropy_loss.append(entropy_loss_)
    # the meters' values: np.mean([v.item() for v in ...]) per kind of loss
    logged = [
        sum(v.item() for v in losses) / len(losses)
        for losses in (total_loss, consistency_loss, entropy_loss)
    ]
    loss = torch.sum(torch.stack(total_loss, dim=0))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    # get_predictions: the features and each head's probabilities, in eval mode
    run.eval()
    with torch.no_grad():
        res = run(anchors, forward_pass="return_all")
    return {
        "loss": loss.detach(),
        "logged": logged,
        "features": res["features"],
        "probs": [F.softmax(output, dim=1) for output in res["output"]],
    }

"""SSD: a single-shot detector whose forward returns its prior boxes beside the predictions,
and the MultiBox loss with hard negative mining on the gathered outputs.

Source: amdegroot/ssd.pytorch layers/modules/multibox_loss.py

Ported: ``SSD.forward`` (a VGG-like base, ``L2Norm`` on the first source, the extra layers,
a loc and a conf head per source, the outputs flattened and concatenated, returned with
``self.priors``, a plain tensor attribute the same on every replica), ``PriorBox`` (centre-size
boxes per feature map cell and aspect ratio, clipped), ``match``/``encode`` (each prior's best
ground truth by Jaccard overlap, the offsets encoded with the variances) and
``MultiBoxLoss`` (smooth L1 over the positive priors, the confidence loss over the positives
and the ``3 x`` hardest negatives, each image ranked by its own loss, both divided by the
number of positives), the script's step (``loss_l + loss_c``, SGD with momentum and weight
decay). The targets, one ``(objects, 5)`` tensor per image, never enter the wrapper: the loss
runs on the gathered outputs, as in ``train.py``. Sizes: 16 x 16 images, three feature maps
(4, 2, 1), 4 classes. One line is changed as the repository's forks change it for current
torch: ``loss_c[pos] = 0`` is taken after ``loss_c.view(num, -1)`` (the original indexes the
flat loss with a ``(num, priors)`` mask, which torch now refuses).
"""

from __future__ import annotations

from itertools import product
from math import sqrt
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn import init

NUM_CLASSES = 4
CFG = {
    "feature_maps": [4, 2, 1],
    "min_dim": 16,
    "steps": [4, 8, 16],
    "min_sizes": [3, 6, 10],
    "max_sizes": [6, 10, 16],
    "aspect_ratios": [[2], [2], [2]],
    "variance": [0.1, 0.2],
    "clip": True,
}
MBOX = [4, 4, 4]  # boxes per feature map location: 1, 1', 2 and 1/2
SPLIT = 7  # the base's layers up to the first source (``conv4_3``'s 23 in SSD300)


def prior_box(cfg: dict[str, Any]) -> torch.Tensor:
    """``PriorBox.forward``: the default boxes in centre-size form."""
    mean: list[float] = []
    for k, f in enumerate(cfg["feature_maps"]):
        for i, j in product(range(f), repeat=2):
            f_k = cfg["min_dim"] / cfg["steps"][k]
            cx, cy = (j + 0.5) / f_k, (i + 0.5) / f_k
            s_k = cfg["min_sizes"][k] / cfg["min_dim"]
            mean += [cx, cy, s_k, s_k]
            s_k_prime = sqrt(s_k * (cfg["max_sizes"][k] / cfg["min_dim"]))
            mean += [cx, cy, s_k_prime, s_k_prime]
            for ar in cfg["aspect_ratios"][k]:
                mean += [cx, cy, s_k * sqrt(ar), s_k / sqrt(ar)]
                mean += [cx, cy, s_k / sqrt(ar), s_k * sqrt(ar)]
    output = torch.Tensor(mean).view(-1, 4)
    if cfg["clip"]:
        output.clamp_(max=1, min=0)
    return output


class L2Norm(nn.Module):
    def __init__(self, n_channels: int, scale: float) -> None:
        super().__init__()
        self.eps = 1e-10
        self.weight = nn.Parameter(torch.Tensor(n_channels))
        init.constant_(self.weight, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.pow(2).sum(dim=1, keepdim=True).sqrt() + self.eps
        x = torch.div(x, norm)
        return self.weight.unsqueeze(0).unsqueeze(2).unsqueeze(3).expand_as(x) * x


class SSD(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_classes = NUM_CLASSES
        self.priors = prior_box(CFG)
        self.vgg = nn.ModuleList(
            [
                nn.Conv2d(3, 8, 3, padding=1),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2, 2),
                nn.Conv2d(8, 8, 3, padding=1),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2, 2),
                nn.Conv2d(8, 8, 3, padding=1),
                nn.ReLU(inplace=True),  # the first source: 4 x 4
                nn.MaxPool2d(3, stride=1, padding=1),  # pool5
                nn.Conv2d(8, 16, 3, padding=2, dilation=2),  # conv6
                nn.ReLU(inplace=True),
                nn.Conv2d(16, 16, 1, stride=2),  # conv7, the second source: 2 x 2
                nn.ReLU(inplace=True),
            ]
        )
        self.L2Norm = L2Norm(8, 20)
        self.extras = nn.ModuleList([nn.Conv2d(16, 8, 1), nn.Conv2d(8, 8, 3, stride=2, padding=1)])
        sources = [8, 16, 8]
        self.loc = nn.ModuleList(
            [nn.Conv2d(c, m * 4, 3, padding=1) for c, m in zip(sources, MBOX, strict=True)]
        )
        self.conf = nn.ModuleList(
            [
                nn.Conv2d(c, m * NUM_CLASSES, 3, padding=1)
                for c, m in zip(sources, MBOX, strict=True)
            ]
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sources, loc, conf = [], [], []
        for k in range(SPLIT + 1):
            x = self.vgg[k](x)
        sources.append(self.L2Norm(x))
        for k in range(SPLIT + 1, len(self.vgg)):
            x = self.vgg[k](x)
        sources.append(x)
        for k, v in enumerate(self.extras):
            x = F.relu(v(x), inplace=True)
            if k % 2 == 1:
                sources.append(x)
        for x, lay, c in zip(sources, self.loc, self.conf, strict=True):
            loc.append(lay(x).permute(0, 2, 3, 1).contiguous())
            conf.append(c(x).permute(0, 2, 3, 1).contiguous())
        loc_t = torch.cat([o.view(o.size(0), -1) for o in loc], 1)
        conf_t = torch.cat([o.view(o.size(0), -1) for o in conf], 1)
        return (
            loc_t.view(loc_t.size(0), -1, 4),
            conf_t.view(conf_t.size(0), -1, self.num_classes),
            self.priors,
        )


def point_form(boxes: torch.Tensor) -> torch.Tensor:
    return torch.cat((boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, :2] + boxes[:, 2:] / 2), 1)


def intersect(box_a: torch.Tensor, box_b: torch.Tensor) -> torch.Tensor:
    a, b = box_a.size(0), box_b.size(0)
    max_xy = torch.min(
        box_a[:, 2:].unsqueeze(1).expand(a, b, 2), box_b[:, 2:].unsqueeze(0).expand(a, b, 2)
    )
    min_xy = torch.max(
        box_a[:, :2].unsqueeze(1).expand(a, b, 2), box_b[:, :2].unsqueeze(0).expand(a, b, 2)
    )
    inter = torch.clamp((max_xy - min_xy), min=0)
    return inter[:, :, 0] * inter[:, :, 1]


def jaccard(box_a: torch.Tensor, box_b: torch.Tensor) -> torch.Tensor:
    inter = intersect(box_a, box_b)
    area_a = ((box_a[:, 2] - box_a[:, 0]) * (box_a[:, 3] - box_a[:, 1])).unsqueeze(1)
    area_b = ((box_b[:, 2] - box_b[:, 0]) * (box_b[:, 3] - box_b[:, 1])).unsqueeze(0)
    union = area_a.expand_as(inter) + area_b.expand_as(inter) - inter
    return inter / union


def encode(matched: torch.Tensor, priors: torch.Tensor, variances: list[float]) -> torch.Tensor:
    g_cxcy = (matched[:, :2] + matched[:, 2:]) / 2 - priors[:, :2]
    g_cxcy /= variances[0] * priors[:, 2:]
    g_wh = (matched[:, 2:] - matched[:, :2]) / priors[:, 2:]
    g_wh = torch.log(g_wh) / variances[1]
    return torch.cat([g_cxcy, g_wh], 1)


def match(
    threshold: float,
    truths: torch.Tensor,
    priors: torch.Tensor,
    variances: list[float],
    labels: torch.Tensor,
    loc_t: torch.Tensor,
    conf_t: torch.Tensor,
    idx: int,
) -> None:
    overlaps = jaccard(truths, point_form(priors))
    best_prior_overlap, best_prior_idx = overlaps.max(1, keepdim=True)
    best_truth_overlap, best_truth_idx = overlaps.max(0, keepdim=True)
    best_truth_idx.squeeze_(0)
    best_truth_overlap.squeeze_(0)
    best_prior_idx.squeeze_(1)
    best_prior_overlap.squeeze_(1)
    best_truth_overlap.index_fill_(0, best_prior_idx, 2)
    for j in range(best_prior_idx.size(0)):
        best_truth_idx[best_prior_idx[j]] = j
    matches = truths[best_truth_idx]
    conf = labels[best_truth_idx] + 1
    conf[best_truth_overlap < threshold] = 0
    loc_t[idx] = encode(matches, priors, variances)
    conf_t[idx] = conf


def log_sum_exp(x: torch.Tensor) -> torch.Tensor:
    x_max = x.data.max()
    return torch.log(torch.sum(torch.exp(x - x_max), 1, keepdim=True)) + x_max


class MultiBoxLoss(nn.Module):
    def __init__(self, num_classes: int, overlap_thresh: float, neg_pos: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.threshold = overlap_thresh
        self.negpos_ratio = neg_pos
        self.variance = CFG["variance"]

    def forward(
        self, predictions: tuple[torch.Tensor, ...], targets: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loc_data, conf_data, priors = predictions
        num = loc_data.size(0)
        priors = priors[: loc_data.size(1), :]
        num_priors = priors.size(0)
        loc_t = torch.Tensor(num, num_priors, 4)
        conf_t = torch.LongTensor(num, num_priors)
        for idx in range(num):
            truths = targets[idx][:, :-1].data
            labels = targets[idx][:, -1].data
            match(self.threshold, truths, priors.data, self.variance, labels, loc_t, conf_t, idx)
        pos = conf_t > 0
        pos_idx = pos.unsqueeze(pos.dim()).expand_as(loc_data)
        loc_p = loc_data[pos_idx].view(-1, 4)
        loc_t = loc_t[pos_idx].view(-1, 4)
        loss_l = F.smooth_l1_loss(loc_p, loc_t, reduction="sum")
        batch_conf = conf_data.view(-1, self.num_classes)
        loss_c = log_sum_exp(batch_conf) - batch_conf.gather(1, conf_t.view(-1, 1))
        loss_c = loss_c.view(num, -1)
        loss_c[pos] = 0  # filter out pos boxes for now
        _, loss_idx = loss_c.sort(1, descending=True)
        _, idx_rank = loss_idx.sort(1)
        num_pos = pos.long().sum(1, keepdim=True)
        num_neg = torch.clamp(self.negpos_ratio * num_pos, max=pos.size(1) - 1)
        neg = idx_rank < num_neg.expand_as(idx_rank)
        pos_idx = pos.unsqueeze(2).expand_as(conf_data)
        neg_idx = neg.unsqueeze(2).expand_as(conf_data)
        conf_p = conf_data[(pos_idx + neg_idx).gt(0)].view(-1, self.num_classes)
        targets_weighted = conf_t[(pos + neg).gt(0)]
        loss_c = F.cross_entropy(conf_p, targets_weighted, reduction="sum")
        n = num_pos.data.sum()
        return loss_l / n, loss_c / n


def _weights_init(m: nn.Module) -> None:
    if isinstance(m, nn.Conv2d):
        init.xavier_uniform_(m.weight.data)
        m.bias.data.zero_()


def build() -> nn.Module:
    torch.manual_seed(0)
    net = SSD()
    net.extras.apply(_weights_init)
    net.loc.apply(_weights_init)
    net.conf.apply(_weights_init)
    return net


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(300)
    out = []
    for _ in range(3):
        images = torch.randn(6, 3, 16, 16, generator=gen)
        targets = []
        for _ in range(6):
            n = int(torch.randint(1, 4, (1,), generator=gen))
            xy = torch.rand(n, 2, generator=gen) * 0.5
            wh = 0.2 + torch.rand(n, 2, generator=gen) * 0.45
            label = torch.randint(0, NUM_CLASSES - 1, (n, 1), generator=gen).float()
            targets.append(torch.cat([xy, (xy + wh).clamp(max=1.0), label], 1))
        out.append((images, targets))
    return out


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (optimizer,) = opts
    images, targets = batch
    criterion = MultiBoxLoss(NUM_CLASSES, 0.5, 3)
    out = run(images)
    optimizer.zero_grad()
    loss_l, loss_c = criterion(out, targets)
    loss = loss_l + loss_c
    loss.backward()
    optimizer.step()
    return {
        "loss_l": loss_l.detach(),
        "loss_c": loss_c.detach(),
        "loc": out[0].detach(),
        "conf": out[1].detach(),
        "priors": out[2].detach(),
    }

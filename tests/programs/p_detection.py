"""torchvision's two-stage detector interface: a list of images of different sizes and a list
of target dicts in, a dict of losses out.

Source: pytorch/vision torchvision/models/detection/generalized_rcnn.py

Ported: ``GeneralizedRCNN.forward(images, targets)``: the transform (each image normalised,
the list padded into one batch tensor, as ``batch_images`` does), a convolutional backbone,
a fixed number of proposals per image (the RoI heads sample ``batch_size_per_image`` per
image), RoI pooling (each box's window pooled to 2 x 2, in place of ``roi_align``), the box
classifier, and the loss dict:
``loss_classifier`` (a mean over every sampled proposal) and ``loss_box_reg`` (a sum over the
positive proposals divided by the number of proposals), as ``fastrcnn_loss`` computes them.
The lists are split per image; each image's own proposals and targets go with it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

CLASSES, PER_IMAGE = 3, 4


def _pool(feature: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Each box's window of the image's feature map pooled to 2 x 2 (``roi_align``'s role;
    torchvision is not a dependency here)."""
    crops = []
    for x0, y0, x1, y1 in boxes.tolist():
        window = feature[
            :, :, int(y0) : max(int(y1), int(y0) + 1), int(x0) : max(int(x1), int(x0) + 1)
        ]
        crops.append(F.adaptive_avg_pool2d(window, 2))
    return torch.cat(crops)


class TinyRCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.box_head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 2 * 2, 16), nn.ReLU())
        self.cls_score = nn.Linear(16, CLASSES)
        self.bbox_pred = nn.Linear(16, CLASSES * 4)
        self.register_buffer("mean", torch.tensor([0.5, 0.4, 0.3]).view(3, 1, 1))

    def transform(self, images: list[torch.Tensor]) -> torch.Tensor:
        images = [(img - self.mean) for img in images]
        h = max(img.shape[1] for img in images)
        w = max(img.shape[2] for img in images)
        batch = images[0].new_zeros(len(images), 3, h, w)
        for out, img in zip(batch, images, strict=True):
            out[:, : img.shape[1], : img.shape[2]].copy_(img)
        return batch

    def forward(
        self, images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        features = self.backbone(self.transform(images))
        # the proposals each image's RoI head samples: its target boxes, then fixed windows
        proposals = []
        sampled = []
        for img, target in zip(images, targets, strict=True):
            h, w = img.shape[1:]
            window = torch.tensor([[0.0, 0.0, w / 2, h / 2], [w / 2, h / 2, float(w), float(h)]])
            boxes = torch.cat([target["boxes"], window])[:PER_IMAGE]
            labels = torch.cat([target["labels"], torch.zeros(2, dtype=torch.long)])[:PER_IMAGE]
            proposals.append(boxes)
            sampled.append((labels, target["boxes"]))
        pooled = torch.cat([_pool(features[i : i + 1], boxes) for i, boxes in enumerate(proposals)])
        x = self.box_head(pooled)
        class_logits, box_regression = self.cls_score(x), self.bbox_pred(x)
        labels = torch.cat([lab for lab, _ in sampled])
        loss_classifier = F.cross_entropy(class_logits, labels)
        positive = torch.where(labels > 0)[0]
        box_regression = box_regression.reshape(labels.numel(), CLASSES, 4)
        regression_targets = torch.cat([torch.cat([b, b])[:PER_IMAGE] for _, b in sampled]) / 10
        loss_box_reg = (
            F.smooth_l1_loss(
                box_regression[positive, labels[positive]],
                regression_targets[positive],
                beta=1 / 9,
                reduction="sum",
            )
            / labels.numel()
        )
        return {"loss_classifier": loss_classifier, "loss_box_reg": loss_box_reg}


def build() -> nn.Module:
    torch.manual_seed(0)
    return TinyRCNN()


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(26)
    out = []
    for _ in range(3):
        images, targets = [], []
        for _ in range(5):
            h, w = (int(v) for v in torch.randint(6, 11, (2,), generator=gen))
            images.append(torch.rand(3, h, w, generator=gen))
            boxes = torch.tensor([[1.0, 1.0, w - 1.0, h - 2.0], [0.0, 2.0, w / 2, h - 1.0]])
            targets.append(
                {"boxes": boxes, "labels": torch.randint(1, CLASSES, (2,), generator=gen)}
            )
        out.append((images, targets))
    return out


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    images, targets = batch
    loss_dict = run(images, targets)
    losses = sum(loss for loss in loss_dict.values())
    opt.zero_grad()
    losses.backward()
    opt.step()
    return {key: value.detach() for key, value in loss_dict.items()}

"""RetinaNet: a ResNet-FPN detector whose forward takes ``[images, annotations]`` and returns
the focal loss over its anchors, each image matched against its own boxes.

Source: yhenon/pytorch-retinanet train.py

Ported: ``model.ResNet`` (``BasicBlock`` layers, ``PyramidFeatures`` P3 to P7, the regression
and classification subnets with their prior-probability initialisation, ``Anchors`` computed in
numpy from the image's shape, and ``freeze_bn``: every BatchNorm in eval mode while the rest
trains), ``losses.FocalLoss`` (per image: the padding rows ``-1`` dropped, IoU of every anchor
with the image's boxes, positives at 0.5 and ignored anchors between 0.4 and 0.5, the focal
loss summed and divided by the positive count, the smooth-L1 regression over the positives, an
image without boxes taking the background-only branch; the per-image losses averaged into a
``(1,)`` tensor with ``mean(dim=0, keepdim=True)``), and ``train.py``'s step:
``retinanet.training = True``, ``train()`` then ``module.freeze_bn()``,
``retinanet([img, annot])``, each loss ``.mean()``ed (over the replicas' values under torch),
``clip_grad_norm_(0.1)``, Adam; annotations padded with ``-1`` as ``collater`` pads them. Left
out: the evaluation path (torchvision's ``nms``, not a dependency here). Before this round
the wrapper read ``[img, annot]`` as a tie between the list's length and its tensors' batch,
and warned on every plan; a list of tensors of different ranks now votes for its batch only.
Sizes: 32 x 32 images, a ResNet of one block per stage 8 to 16 wide, 8-wide heads, 3 classes,
207 anchors; Adam's learning rate raised to 1e-3 so that three steps move the weights.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

NUM_CLASSES, FEATURES = 3, 8


def calc_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    iw = torch.min(torch.unsqueeze(a[:, 2], dim=1), b[:, 2]) - torch.max(
        torch.unsqueeze(a[:, 0], 1), b[:, 0]
    )
    ih = torch.min(torch.unsqueeze(a[:, 3], dim=1), b[:, 3]) - torch.max(
        torch.unsqueeze(a[:, 1], 1), b[:, 1]
    )
    iw = torch.clamp(iw, min=0)
    ih = torch.clamp(ih, min=0)
    ua = torch.unsqueeze((a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1]), dim=1) + area - iw * ih
    ua = torch.clamp(ua, min=1e-8)
    return iw * ih / ua


class FocalLoss(nn.Module):
    def forward(
        self,
        classifications: torch.Tensor,
        regressions: torch.Tensor,
        anchors: torch.Tensor,
        annotations: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        alpha, gamma = 0.25, 2.0
        batch_size = classifications.shape[0]
        classification_losses, regression_losses = [], []
        anchor = anchors[0, :, :]
        anchor_widths = anchor[:, 2] - anchor[:, 0]
        anchor_heights = anchor[:, 3] - anchor[:, 1]
        anchor_ctr_x = anchor[:, 0] + 0.5 * anchor_widths
        anchor_ctr_y = anchor[:, 1] + 0.5 * anchor_heights
        for j in range(batch_size):
            classification = classifications[j, :, :]
            regression = regressions[j, :, :]
            bbox_annotation = annotations[j, :, :]
            bbox_annotation = bbox_annotation[bbox_annotation[:, 4] != -1]
            classification = torch.clamp(classification, 1e-4, 1.0 - 1e-4)
            if bbox_annotation.shape[0] == 0:
                alpha_factor = 1.0 - torch.ones(classification.shape) * alpha
                focal_weight = alpha_factor * torch.pow(classification, gamma)
                bce = -(torch.log(1.0 - classification))
                classification_losses.append((focal_weight * bce).sum())
                regression_losses.append(torch.tensor(0).to(classification))
                continue
            iou = calc_iou(anchors[0, :, :], bbox_annotation[:, :4])
            iou_max, iou_argmax = torch.max(iou, dim=1)
            targets = torch.ones(classification.shape).to(classification) * -1
            targets[torch.lt(iou_max, 0.4), :] = 0
            positive_indices = torch.ge(iou_max, 0.5)
            num_positive_anchors = positive_indices.sum()
            assigned_annotations = bbox_annotation[iou_argmax, :]
            targets[positive_indices, :] = 0
            targets[positive_indices, assigned_annotations[positive_indices, 4].long()] = 1
            alpha_factor = torch.ones(targets.shape).to(targets) * alpha
            alpha_factor = torch.where(torch.eq(targets, 1.0), alpha_factor, 1.0 - alpha_factor)
            focal_weight = torch.where(torch.eq(targets, 1.0), 1.0 - classification, classification)
            focal_weight = alpha_factor * torch.pow(focal_weight, gamma)
            bce = -(
                targets * torch.log(classification)
                + (1.0 - targets) * torch.log(1.0 - classification)
            )
            cls_loss = focal_weight * bce
            cls_loss = torch.where(torch.ne(targets, -1.0), cls_loss, torch.zeros_like(cls_loss))
            classification_losses.append(
                cls_loss.sum() / torch.clamp(num_positive_anchors.to(cls_loss), min=1.0)
            )
            if positive_indices.sum() > 0:
                assigned_annotations = assigned_annotations[positive_indices, :]
                anchor_widths_pi = anchor_widths[positive_indices]
                anchor_heights_pi = anchor_heights[positive_indices]
                anchor_ctr_x_pi = anchor_ctr_x[positive_indices]
                anchor_ctr_y_pi = anchor_ctr_y[positive_indices]
                gt_widths = assigned_annotations[:, 2] - assigned_annotations[:, 0]
                gt_heights = assigned_annotations[:, 3] - assigned_annotations[:, 1]
                gt_ctr_x = assigned_annotations[:, 0] + 0.5 * gt_widths
                gt_ctr_y = assigned_annotations[:, 1] + 0.5 * gt_heights
                gt_widths = torch.clamp(gt_widths, min=1)
                gt_heights = torch.clamp(gt_heights, min=1)
                targets_dx = (gt_ctr_x - anchor_ctr_x_pi) / anchor_widths_pi
                targets_dy = (gt_ctr_y - anchor_ctr_y_pi) / anchor_heights_pi
                targets_dw = torch.log(gt_widths / anchor_widths_pi)
                targets_dh = torch.log(gt_heights / anchor_heights_pi)
                targets = torch.stack((targets_dx, targets_dy, targets_dw, targets_dh)).t()
                targets = targets / torch.tensor([[0.1, 0.1, 0.2, 0.2]]).to(targets)
                regression_diff = torch.abs(targets - regression[positive_indices, :])
                regression_loss = torch.where(
                    torch.le(regression_diff, 1.0 / 9.0),
                    0.5 * 9.0 * torch.pow(regression_diff, 2),
                    regression_diff - 0.5 / 9.0,
                )
                regression_losses.append(regression_loss.mean())
            else:
                regression_losses.append(torch.tensor(0).to(classification))
        return (
            torch.stack(classification_losses).mean(dim=0, keepdim=True),
            torch.stack(regression_losses).mean(dim=0, keepdim=True),
        )


def generate_anchors(base_size: int, ratios: np.ndarray, scales: np.ndarray) -> np.ndarray:
    num_anchors = len(ratios) * len(scales)
    anchors = np.zeros((num_anchors, 4))
    anchors[:, 2:] = base_size * np.tile(scales, (2, len(ratios))).T
    areas = anchors[:, 2] * anchors[:, 3]
    anchors[:, 2] = np.sqrt(areas / np.repeat(ratios, len(scales)))
    anchors[:, 3] = anchors[:, 2] * np.repeat(ratios, len(scales))
    anchors[:, 0::2] -= np.tile(anchors[:, 2] * 0.5, (2, 1)).T
    anchors[:, 1::2] -= np.tile(anchors[:, 3] * 0.5, (2, 1)).T
    return anchors


def shift(shape: np.ndarray, stride: int, anchors: np.ndarray) -> np.ndarray:
    shift_x = (np.arange(0, shape[1]) + 0.5) * stride
    shift_y = (np.arange(0, shape[0]) + 0.5) * stride
    shift_x, shift_y = np.meshgrid(shift_x, shift_y)
    shifts = np.vstack((shift_x.ravel(), shift_y.ravel(), shift_x.ravel(), shift_y.ravel()))
    shifts = shifts.transpose()
    a, k = anchors.shape[0], shifts.shape[0]
    all_anchors = anchors.reshape((1, a, 4)) + shifts.reshape((1, k, 4)).transpose((1, 0, 2))
    return all_anchors.reshape((k * a, 4))


class Anchors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pyramid_levels = [3, 4, 5, 6, 7]
        self.strides = [2**x for x in self.pyramid_levels]
        self.sizes = [2 ** (x + 2) for x in self.pyramid_levels]
        self.ratios = np.array([0.5, 1, 2])
        self.scales = np.array([2**0, 2 ** (1.0 / 3.0), 2 ** (2.0 / 3.0)])

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        image_shape = np.array(image.shape[2:])
        image_shapes = [(image_shape + 2**x - 1) // (2**x) for x in self.pyramid_levels]
        all_anchors = np.zeros((0, 4)).astype(np.float32)
        for idx, _ in enumerate(self.pyramid_levels):
            anchors = generate_anchors(self.sizes[idx], self.ratios, self.scales)
            shifted_anchors = shift(image_shapes[idx], self.strides[idx], anchors)
            all_anchors = np.append(all_anchors, shifted_anchors, axis=0)
        all_anchors = np.expand_dims(all_anchors, axis=0)
        return torch.from_numpy(all_anchors.astype(np.float32)).to(image)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            residual = self.downsample(x)
        out += residual
        return self.relu(out)


class PyramidFeatures(nn.Module):
    def __init__(self, c3_size: int, c4_size: int, c5_size: int, feature_size: int) -> None:
        super().__init__()
        self.P5_1 = nn.Conv2d(c5_size, feature_size, kernel_size=1)
        self.P5_upsampled = nn.Upsample(scale_factor=2, mode="nearest")
        self.P5_2 = nn.Conv2d(feature_size, feature_size, kernel_size=3, padding=1)
        self.P4_1 = nn.Conv2d(c4_size, feature_size, kernel_size=1)
        self.P4_upsampled = nn.Upsample(scale_factor=2, mode="nearest")
        self.P4_2 = nn.Conv2d(feature_size, feature_size, kernel_size=3, padding=1)
        self.P3_1 = nn.Conv2d(c3_size, feature_size, kernel_size=1)
        self.P3_2 = nn.Conv2d(feature_size, feature_size, kernel_size=3, padding=1)
        self.P6 = nn.Conv2d(c5_size, feature_size, kernel_size=3, stride=2, padding=1)
        self.P7_1 = nn.ReLU()
        self.P7_2 = nn.Conv2d(feature_size, feature_size, kernel_size=3, stride=2, padding=1)

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        c3, c4, c5 = inputs
        p5_x = self.P5_1(c5)
        p5_upsampled_x = self.P5_upsampled(p5_x)
        p5_x = self.P5_2(p5_x)
        p4_x = self.P4_1(c4) + p5_upsampled_x
        p4_upsampled_x = self.P4_upsampled(p4_x)
        p4_x = self.P4_2(p4_x)
        p3_x = self.P3_2(self.P3_1(c3) + p4_upsampled_x)
        p6_x = self.P6(c5)
        p7_x = self.P7_2(self.P7_1(p6_x))
        return [p3_x, p4_x, p5_x, p6_x, p7_x]


class RegressionModel(nn.Module):
    def __init__(self, num_features_in: int, num_anchors: int = 9) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(num_features_in, FEATURES, kernel_size=3, padding=1)
        self.act1 = nn.ReLU()
        self.output = nn.Conv2d(FEATURES, num_anchors * 4, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.output(self.act1(self.conv1(x))).permute(0, 2, 3, 1)
        return out.contiguous().view(out.shape[0], -1, 4)


class ClassificationModel(nn.Module):
    def __init__(self, num_features_in: int, num_anchors: int = 9, num_classes: int = 80) -> None:
        super().__init__()
        self.num_classes, self.num_anchors = num_classes, num_anchors
        self.conv1 = nn.Conv2d(num_features_in, FEATURES, kernel_size=3, padding=1)
        self.act1 = nn.ReLU()
        self.output = nn.Conv2d(FEATURES, num_anchors * num_classes, kernel_size=3, padding=1)
        self.output_act = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.output_act(self.output(self.act1(self.conv1(x))))
        out1 = out.permute(0, 2, 3, 1)
        batch_size, width, height, _ = out1.shape
        out2 = out1.view(batch_size, width, height, self.num_anchors, self.num_classes)
        return out2.contiguous().view(x.shape[0], -1, self.num_classes)


class ResNet(nn.Module):
    def __init__(self, num_classes: int, layers: list[int]) -> None:
        self.inplanes = 8
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(8, layers[0])
        self.layer2 = self._make_layer(8, layers[1], stride=2)
        self.layer3 = self._make_layer(16, layers[2], stride=2)
        self.layer4 = self._make_layer(16, layers[3], stride=2)
        fpn_sizes = [
            self.layer2[layers[1] - 1].conv2.out_channels,
            self.layer3[layers[2] - 1].conv2.out_channels,
            self.layer4[layers[3] - 1].conv2.out_channels,
        ]
        self.fpn = PyramidFeatures(fpn_sizes[0], fpn_sizes[1], fpn_sizes[2], FEATURES)
        self.regressionModel = RegressionModel(FEATURES)
        self.classificationModel = ClassificationModel(FEATURES, num_classes=num_classes)
        self.anchors = Anchors()
        self.focalLoss = FocalLoss()
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                m.weight.data.normal_(0, math.sqrt(2.0 / n))
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.data.fill_(1)
                m.bias.data.zero_()
        prior = 0.01
        self.classificationModel.output.weight.data.fill_(0)
        self.classificationModel.output.bias.data.fill_(-math.log((1.0 - prior) / prior))
        self.regressionModel.output.weight.data.fill_(0)
        self.regressionModel.output.bias.data.fill_(0)
        self.freeze_bn()

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def freeze_bn(self) -> None:
        """Freeze BatchNorm layers."""
        for layer in self.modules():
            if isinstance(layer, nn.BatchNorm2d):
                layer.eval()

    def forward(self, inputs: Any) -> Any:
        img_batch, annotations = inputs  # training only (the eval path needs torchvision)
        x = self.maxpool(self.relu(self.bn1(self.conv1(img_batch))))
        x1 = self.layer1(x)
        x2 = self.layer2(x1)
        x3 = self.layer3(x2)
        x4 = self.layer4(x3)
        features = self.fpn([x2, x3, x4])
        regression = torch.cat([self.regressionModel(feature) for feature in features], dim=1)
        classification = torch.cat(
            [self.classificationModel(feature) for feature in features], dim=1
        )
        anchors = self.anchors(img_batch)
        return self.focalLoss(classification, regression, anchors, annotations)


def build() -> nn.Module:
    torch.manual_seed(0)
    return ResNet(NUM_CLASSES, [1, 1, 1, 1])


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(model.parameters(), lr=1e-3)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(207)
    out = []
    for _ in range(3):
        img = torch.randn(5, 3, 32, 32, generator=gen)
        annot = torch.ones(5, 3, 5) * -1  # collater's padding
        for i in range(4):  # the fifth image has no boxes
            n = int(torch.randint(1, 4, (1,), generator=gen))
            # near a P3 anchor's centre and size, so that some anchors are positives
            ctr = (
                4 + 8 * torch.randint(1, 3, (n, 2), generator=gen) + torch.rand(n, 2, generator=gen)
            )
            wh = 26 + torch.rand(n, 2, generator=gen) * 10
            label = torch.randint(0, NUM_CLASSES, (n, 1), generator=gen).float()
            annot[i, :n] = torch.cat([ctr - wh / 2, ctr + wh / 2, label], 1)
        out.append((img, annot))
    return out


def step(model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]) -> dict[str, Any]:
    (optimizer,) = opts
    img, annot = batch
    run.training = True
    run.train()
    model.freeze_bn()  # the script's retinanet.module.freeze_bn()
    optimizer.zero_grad()
    classification_loss, regression_loss = run([img, annot])
    classification_loss = classification_loss.mean()
    regression_loss = regression_loss.mean()
    loss = classification_loss + regression_loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.parameters(), 0.1)
    optimizer.step()
    return {
        "loss": float(loss),
        "classification_loss": float(classification_loss),
        "regression_loss": float(regression_loss),
    }

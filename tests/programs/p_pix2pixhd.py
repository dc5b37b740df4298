"""pix2pixHD: the whole GAN in one wrapped module whose forward returns its losses, with a
multiscale discriminator and the feature-matching loss.

Source: NVIDIA/pix2pixHD models/pix2pixHD_model.py

Ported: ``Pix2PixHDModel`` as ``create_model`` wraps it (``torch.nn.DataParallel(model)``, the
training step in ``train.py``): ``encode_input`` (the label map one-hot by ``scatter_``, the
instance map's edges by ``get_edges``, concatenated), ``GlobalGenerator`` (reflection padding,
strided convolutions, a ``ResnetBlock``, transposed convolutions, ``InstanceNorm2d``),
``MultiscaleDiscriminator`` with ``getIntermFeat`` (two ``NLayerDiscriminator`` scales, each
returning its intermediate features, the input average-pooled between scales),
``discriminate`` on the detached fake and on the real image, ``GANLoss`` (LSGAN, its target
tensors cached in ``real_label_var``/``fake_label_var`` and rebuilt when the size changes), the
feature-matching L1 loss over every intermediate feature of every scale weighted by
``4 / (n_layers_D + 1) / num_D * lambda_feat``, ``loss_filter``; forward returns ``[losses,
fake_image or None]``, the fake image only when ``infer`` (``save_fake``). The step as
``train.py`` takes it: ``model(label, inst, image, feat, infer=save_fake)`` with ``feat`` the
int ``0`` the dataset gives when no features are used, ``torch.mean`` of each loss (torch's
per-device values; one value here), ``loss_D = (D_fake + D_real) * 0.5``, ``loss_G = G_GAN +
G_GAN_Feat``, the G step then the D step with Adam ``(0.5, 0.999)``. Left out: the VGG loss
(``--no_vgg_loss``: it loads ImageNet weights), the image pool (its size is 0 by default and
the script refuses it on several GPUs), the feature encoder (off by default). The optimizers
are built as ``initialize`` builds them, outside the module. Before this round, on chunks of
2 (batch 6 on three devices) the returned ``[losses, None]`` was read as two samples' records
and came back as ``[losses, None, losses, None, losses, None]``; a list whose items are of
different kinds is now structure. Sizes: 16 x 16 images, 4 labels,
``ngf`` 4 with two downsamplings and one residual block, ``ndf`` 4, three layers per scale. In
float64: the biases of the convolutions before an ``InstanceNorm2d`` without affine parameters
have gradients that are zero but for rounding, and Adam turns those into full steps, so float32
rounding of the split moved them by 8.6e-4 after three steps (every loss the same).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

LABEL_NC, OUTPUT_NC, NGF, NDF, N_LAYERS_D, NUM_D, LAMBDA_FEAT = 4, 3, 4, 4, 3, 2, 10.0


def weights_init(m: nn.Module) -> None:
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        m.weight.data.normal_(0.0, 0.02)


def norm_layer(n: int) -> nn.Module:
    return nn.InstanceNorm2d(n, affine=False)  # get_norm_layer('instance')


class ResnetBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv_block = nn.Sequential(
            nn.ReflectionPad2d(1),
            nn.Conv2d(dim, dim, kernel_size=3, padding=0),
            norm_layer(dim),
            nn.ReLU(True),
            nn.ReflectionPad2d(1),
            nn.Conv2d(dim, dim, kernel_size=3, padding=0),
            norm_layer(dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv_block(x)


class GlobalGenerator(nn.Module):
    def __init__(self, input_nc: int, output_nc: int, ngf: int, n_downsampling: int) -> None:
        super().__init__()
        activation = nn.ReLU(True)
        model: list[nn.Module] = [
            nn.ReflectionPad2d(3),
            nn.Conv2d(input_nc, ngf, kernel_size=7, padding=0),
            norm_layer(ngf),
            activation,
        ]
        for i in range(n_downsampling):
            mult = 2**i
            model += [
                nn.Conv2d(ngf * mult, ngf * mult * 2, kernel_size=3, stride=2, padding=1),
                norm_layer(ngf * mult * 2),
                activation,
            ]
        mult = 2**n_downsampling
        model += [ResnetBlock(ngf * mult)]
        for i in range(n_downsampling):
            mult = 2 ** (n_downsampling - i)
            model += [
                nn.ConvTranspose2d(
                    ngf * mult, ngf * mult // 2, 3, stride=2, padding=1, output_padding=1
                ),
                norm_layer(ngf * mult // 2),
                activation,
            ]
        model += [nn.ReflectionPad2d(3), nn.Conv2d(ngf, output_nc, kernel_size=7), nn.Tanh()]
        self.model = nn.Sequential(*model)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.model(input)


class NLayerDiscriminator(nn.Module):
    def __init__(self, input_nc: int, ndf: int, n_layers: int) -> None:
        super().__init__()
        self.n_layers = n_layers
        kw, padw = 4, int(np.ceil((4 - 1.0) / 2))
        sequence: list[list[nn.Module]] = [
            [nn.Conv2d(input_nc, ndf, kw, stride=2, padding=padw), nn.LeakyReLU(0.2, True)]
        ]
        nf = ndf
        for _ in range(1, n_layers):
            nf_prev, nf = nf, min(nf * 2, 512)
            sequence += [
                [
                    nn.Conv2d(nf_prev, nf, kw, stride=2, padding=padw),
                    norm_layer(nf),
                    nn.LeakyReLU(0.2, True),
                ]
            ]
        nf_prev, nf = nf, min(nf * 2, 512)
        sequence += [
            [nn.Conv2d(nf_prev, nf, kw, stride=1, padding=padw), norm_layer(nf), nn.LeakyReLU(0.2)]
        ]
        sequence += [[nn.Conv2d(nf, 1, kernel_size=kw, stride=1, padding=padw)]]
        for n in range(len(sequence)):
            setattr(self, "model" + str(n), nn.Sequential(*sequence[n]))


class MultiscaleDiscriminator(nn.Module):
    def __init__(self, input_nc: int, ndf: int, n_layers: int, num_d: int) -> None:
        super().__init__()
        self.num_D, self.n_layers = num_d, n_layers
        for i in range(num_d):
            net_d = NLayerDiscriminator(input_nc, ndf, n_layers)
            for j in range(n_layers + 2):
                setattr(self, f"scale{i}_layer{j}", getattr(net_d, f"model{j}"))
        self.downsample = nn.AvgPool2d(3, stride=2, padding=[1, 1], count_include_pad=False)

    def singleD_forward(self, model: list[nn.Module], input: torch.Tensor) -> list[torch.Tensor]:
        result = [input]
        for i in range(len(model)):
            result.append(model[i](result[-1]))
        return result[1:]

    def forward(self, input: torch.Tensor) -> list[list[torch.Tensor]]:
        num_d = self.num_D
        result = []
        input_downsampled = input
        for i in range(num_d):
            model = [
                getattr(self, f"scale{num_d - 1 - i}_layer{j}") for j in range(self.n_layers + 2)
            ]
            result.append(self.singleD_forward(model, input_downsampled))
            if i != (num_d - 1):
                input_downsampled = self.downsample(input_downsampled)
        return result


class GANLoss(nn.Module):
    def __init__(self, target_real_label: float = 1.0, target_fake_label: float = 0.0) -> None:
        super().__init__()
        self.real_label, self.fake_label = target_real_label, target_fake_label
        self.real_label_var: torch.Tensor | None = None
        self.fake_label_var: torch.Tensor | None = None
        self.Tensor = torch.DoubleTensor  # the port's dtype (torch.FloatTensor there)
        self.loss = nn.MSELoss()  # use_lsgan

    def get_target_tensor(self, input: torch.Tensor, target_is_real: bool) -> torch.Tensor:
        if target_is_real:
            if self.real_label_var is None or self.real_label_var.numel() != input.numel():
                self.real_label_var = self.Tensor(input.size()).fill_(self.real_label)
            return self.real_label_var
        if self.fake_label_var is None or self.fake_label_var.numel() != input.numel():
            self.fake_label_var = self.Tensor(input.size()).fill_(self.fake_label)
        return self.fake_label_var

    def __call__(self, input: Any, target_is_real: bool) -> Any:
        loss: Any = 0
        for input_i in input:
            pred = input_i[-1]
            loss += self.loss(pred, self.get_target_tensor(pred, target_is_real))
        return loss


class Pix2PixHDModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        net_g_input_nc = LABEL_NC + 1  # the instance edges
        self.netG = GlobalGenerator(net_g_input_nc, OUTPUT_NC, NGF, 2)
        self.netG.apply(weights_init)
        self.netD = MultiscaleDiscriminator(net_g_input_nc + OUTPUT_NC, NDF, N_LAYERS_D, NUM_D)
        self.netD.apply(weights_init)
        flags = (True, True, False, True, True)  # no VGG loss

        def loss_filter(*losses: Any) -> list[Any]:
            return [loss for (loss, f) in zip(losses, flags, strict=True) if f]

        self.loss_filter = loss_filter
        self.criterionGAN = GANLoss()
        self.criterionFeat = nn.L1Loss()
        self.loss_names = self.loss_filter("G_GAN", "G_GAN_Feat", "G_VGG", "D_real", "D_fake")

    def get_edges(self, t: torch.Tensor) -> torch.Tensor:
        edge = torch.zeros(t.size(), dtype=torch.uint8, device=t.device)  # a ByteTensor
        edge[:, :, :, 1:] = edge[:, :, :, 1:] | (t[:, :, :, 1:] != t[:, :, :, :-1])
        edge[:, :, :, :-1] = edge[:, :, :, :-1] | (t[:, :, :, 1:] != t[:, :, :, :-1])
        edge[:, :, 1:, :] = edge[:, :, 1:, :] | (t[:, :, 1:, :] != t[:, :, :-1, :])
        edge[:, :, :-1, :] = edge[:, :, :-1, :] | (t[:, :, 1:, :] != t[:, :, :-1, :])
        return edge.to(t.dtype)  # .float() there

    def encode_input(
        self, label_map: torch.Tensor, inst_map: torch.Tensor, real_image: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = label_map.size()
        one_hot_size = (size[0], LABEL_NC, size[2], size[3])
        input_label = torch.zeros(
            torch.Size(one_hot_size), dtype=label_map.dtype, device=label_map.device
        )
        input_label = input_label.scatter_(1, label_map.data.long(), 1.0)
        edge_map = self.get_edges(inst_map.data)
        return torch.cat((input_label, edge_map), dim=1), real_image.data

    def discriminate(self, input_label: torch.Tensor, test_image: torch.Tensor) -> Any:
        return self.netD.forward(torch.cat((input_label, test_image.detach()), dim=1))

    def forward(
        self, label: torch.Tensor, inst: torch.Tensor, image: torch.Tensor, feat: Any, infer: bool
    ) -> list[Any]:
        input_label, real_image = self.encode_input(label, inst, image)
        fake_image = self.netG.forward(input_label)
        pred_fake_pool = self.discriminate(input_label, fake_image)  # the pool of size 0
        loss_d_fake = self.criterionGAN(pred_fake_pool, False)
        pred_real = self.discriminate(input_label, real_image)
        loss_d_real = self.criterionGAN(pred_real, True)
        pred_fake = self.netD.forward(torch.cat((input_label, fake_image), dim=1))
        loss_g_gan = self.criterionGAN(pred_fake, True)
        loss_g_gan_feat: Any = 0
        feat_weights = 4.0 / (N_LAYERS_D + 1)
        d_weights = 1.0 / NUM_D
        for i in range(NUM_D):
            for j in range(len(pred_fake[i]) - 1):
                loss_g_gan_feat += (
                    d_weights
                    * feat_weights
                    * self.criterionFeat(pred_fake[i][j], pred_real[i][j].detach())
                    * LAMBDA_FEAT
                )
        loss_g_vgg = 0
        losses = self.loss_filter(loss_g_gan, loss_g_gan_feat, loss_g_vgg, loss_d_real, loss_d_fake)
        return [losses, None if not infer else fake_image]


def build() -> nn.Module:
    torch.manual_seed(0)
    return Pix2PixHDModel().double()


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.Adam(list(model.netG.parameters()), lr=2e-4, betas=(0.5, 0.999)),
        torch.optim.Adam(list(model.netD.parameters()), lr=2e-4, betas=(0.5, 0.999)),
    ]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(2048)
    out = []
    for k in range(3):
        label = torch.randint(0, LABEL_NC, (6, 1, 2, 2), generator=gen).double()
        label = label.repeat_interleave(8, 2).repeat_interleave(8, 3)  # regions of 8 x 8
        inst = label * 1000 + torch.randint(0, 2, (6, 1, 16, 16), generator=gen).double()
        image = torch.rand(6, 3, 16, 16, generator=gen, dtype=torch.float64) * 2 - 1
        out.append({"label": label, "inst": inst, "image": image, "feat": 0, "save_fake": k == 1})
    return out


def step(model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]) -> dict[str, Any]:
    optimizer_g, optimizer_d = opts
    data = batch
    losses, generated = run(
        data["label"], data["inst"], data["image"], data["feat"], infer=data["save_fake"]
    )
    # sum per device losses
    losses = [torch.mean(x) if not isinstance(x, int) else x for x in losses]
    loss_dict = dict(zip(model.loss_names, losses, strict=True))
    loss_d = (loss_dict["D_fake"] + loss_dict["D_real"]) * 0.5
    loss_g = loss_dict["G_GAN"] + loss_dict.get("G_GAN_Feat", 0) + loss_dict.get("G_VGG", 0)
    optimizer_g.zero_grad()
    loss_g.backward()
    optimizer_g.step()
    optimizer_d.zero_grad()
    loss_d.backward()
    optimizer_d.step()
    errors = {k: v.data.item() if not isinstance(v, int) else v for k, v in loss_dict.items()}
    out: dict[str, Any] = {"errors": list(errors.values())}
    if generated is not None:
        out["generated"] = generated.detach()
    return out

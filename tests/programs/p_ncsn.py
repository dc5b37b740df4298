"""Song and Ermon's NCSN: a noise-conditional score network trained by annealed denoising
score matching.

Source: ermongroup/ncsn losses/dsm.py

Ported: ``anneal_dsm_score_estimation`` (each sample's noise level picked by its label,
perturbed with ``randn_like``, the score's squared error to ``-(x~ - x) / sigma^2`` weighted
by ``sigma^anneal_power``, the mean over the batch), models/cond_refinenet_dilated.py's
``ConditionalInstanceNorm2dPlus`` (instance statistics per sample, gamma, alpha and beta
embedded per noise level) in a small conditional score net, and runners/anneal_runner.py's
step: labels drawn with ``randint``, Adam. The script wraps the score net in
``nn.DataParallel`` and computes the loss outside it, so the noise is drawn once, by the
caller.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

N_SIGMAS, CH, BATCH = 4, 8, 7
SIGMAS = torch.tensor([1.0, 0.5, 0.25, 0.1])


class ConditionalInstanceNorm2dPlus(nn.Module):
    def __init__(self, num_features: int, num_classes: int, bias: bool = True) -> None:
        super().__init__()
        self.num_features = num_features
        self.bias = bias
        self.instance_norm = nn.InstanceNorm2d(
            num_features, affine=False, track_running_stats=False
        )
        self.embed = nn.Embedding(num_classes, num_features * 3)
        self.embed.weight.data[:, : 2 * num_features].normal_(1, 0.02)
        self.embed.weight.data[:, 2 * num_features :].zero_()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        means = torch.mean(x, dim=(2, 3))
        m = torch.mean(means, dim=-1, keepdim=True)
        v = torch.var(means, dim=-1, keepdim=True)
        means = (means - m) / (torch.sqrt(v + 1e-5))
        h = self.instance_norm(x)
        gamma, alpha, beta = self.embed(y).chunk(3, dim=-1)
        h = h + means[..., None, None] * alpha[..., None, None]
        return gamma.view(-1, self.num_features, 1, 1) * h + beta.view(-1, self.num_features, 1, 1)


class ScoreNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.begin_conv = nn.Conv2d(1, CH, 3, padding=1)
        self.norm = ConditionalInstanceNorm2dPlus(CH, N_SIGMAS)
        self.act = nn.ELU()
        self.end_conv = nn.Conv2d(CH, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.begin_conv(2 * x - 1.0)
        return self.end_conv(self.act(self.norm(h, y)))


def anneal_dsm_score_estimation(
    scorenet: Any,
    samples: torch.Tensor,
    labels: torch.Tensor,
    sigmas: torch.Tensor,
    anneal_power: float = 2.0,
) -> torch.Tensor:
    used_sigmas = sigmas[labels].view(samples.shape[0], *([1] * len(samples.shape[1:])))
    perturbed_samples = samples + torch.randn_like(samples) * used_sigmas
    target = -1 / (used_sigmas**2) * (perturbed_samples - samples)
    scores = scorenet(perturbed_samples, labels)
    target = target.view(target.shape[0], -1)
    scores = scores.view(scores.shape[0], -1)
    loss = 1 / 2.0 * ((scores - target) ** 2).sum(dim=-1) * used_sigmas.squeeze() ** anneal_power
    return loss.mean(dim=0)


def build() -> nn.Module:
    torch.manual_seed(0)
    return ScoreNet()


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(model.parameters(), lr=1e-3)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(9)
    return [torch.rand(BATCH, 1, 6, 6, generator=gen) for _ in range(3)]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (optimizer,) = opts
    X = batch / 256.0 * 255.0 + torch.rand_like(batch) / 256.0
    labels = torch.randint(0, len(SIGMAS), (X.shape[0],), device=X.device)
    loss = anneal_dsm_score_estimation(run, X, labels, SIGMAS, 2.0)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {"loss": loss.detach()}

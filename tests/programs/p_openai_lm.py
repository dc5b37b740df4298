"""The OpenAI transformer LM fine-tuned on a multiple-choice task: the double-heads model and
its loss compute.

Source: huggingface/pytorch-openai-transformer-lm train.py

Ported: ``DoubleHeadModel`` with the ``multiple_choice`` head (``TransformerModel``: token and
position embeddings summed, ``Block``s of OpenAI-style ``LayerNorm``, ``Conv1D`` attention under
the causal buffer ``b`` and a GELU MLP; ``LMHead``, tied to the embedding, whose logits come back
flattened to ``(batch * choices * (ctx - 1), vocab)``; ``MultipleChoiceHead``, which picks the
hidden state at each sequence's ``_classify_`` token), inputs ``(batch, 2, ctx, 2)`` built as
``transform_roc`` builds them (start, story, delimiter, ending, classify; positions after the
vocabulary), ``MultipleChoiceLossCompute`` (per-token LM losses masked and averaged per
sequence, the per-sample classification losses, ``clf.sum() + lm_coef * lm.sum()``, backward,
``OpenAIAdam``'s step with its per-parameter clipping, warmup-linear schedule and decoupled L2,
``zero_grad``, the loss's ``item()``), and ``iter_apply``'s evaluation under ``eval()`` and
``no_grad`` (the gathered logits scaled in place by ``n``). The port adds one option: the LM
logits are 12 rows per sample (2 choices x 6 tokens), not the chunk size, so the wrapper
concatenates them (one device's order) with a warning that names the flattened reading and
``output_rules={"output[0]": 0}``, which says so and silences it (before this round the
warning did not name it). Dropout is off (the probabilities 0); ``OpenAIAdam`` uses the keyword
forms of ``add_``/``addcmul_``/``addcdiv_`` that current torch takes. Sizes: 8-wide, 2 heads,
2 layers, contexts of 7, 20 words; the learning rate is raised (6.25e-3) so that three steps
move the weights. In float64: some gradients are zero but for rounding (the choice head's bias
and the attention's key bias, which a softmax cancels: 6e-8 on one device, 3e-8 on two in
float32), and Adam divides each by its own magnitude plus ``1e-8``, so the rounding of the
split moved those weights by a visible step (eval logits off by 8e-4 relative); ``check=``
rightly does not report it, as the gradients agree to their magnitude.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import Parameter
from torch.nn.utils import clip_grad_norm_

import dataparallel as dp

N_VOCAB, N_SPECIAL, N_CTX = 20, 3, 7
START, DELIMITER, CLF_TOKEN = N_VOCAB, N_VOCAB + 1, N_VOCAB + 2
VOCAB = N_VOCAB + N_SPECIAL + N_CTX
CFG = SimpleNamespace(
    n_embd=8,
    n_head=2,
    n_layer=2,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    resid_pdrop=0.0,
    afn="gelu",
    clf_pdrop=0.0,
)
LM_COEF, T_TOTAL = 0.5, 10


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class LayerNorm(nn.Module):
    def __init__(self, n_state: int, e: float = 1e-5) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(n_state))
        self.b = nn.Parameter(torch.zeros(n_state))
        self.e = e

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.e)
        return self.g * x + self.b


class Conv1D(nn.Module):
    def __init__(self, nf: int, rf: int, nx: int) -> None:
        super().__init__()
        self.rf, self.nf = rf, nf
        w = torch.empty(nx, nf)
        nn.init.normal_(w, std=0.02)
        self.w = Parameter(w)
        self.b = Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        x = torch.addmm(self.b, x.view(-1, x.size(-1)), self.w)
        return x.view(*size_out)


class Attention(nn.Module):
    def __init__(self, nx: int, n_ctx: int, cfg: Any, scale: bool = False) -> None:
        super().__init__()
        n_state = nx
        self.register_buffer("b", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))
        self.n_head = cfg.n_head
        self.split_size = n_state
        self.scale = scale
        self.c_attn = Conv1D(n_state * 3, 1, nx)
        self.c_proj = Conv1D(n_state, 1, nx)
        self.attn_dropout = nn.Dropout(cfg.attn_pdrop)
        self.resid_dropout = nn.Dropout(cfg.resid_pdrop)

    def _attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        w = torch.matmul(q, k)
        if self.scale:
            w = w / math.sqrt(v.size(-1))
        b = self.b[:, :, : w.size(-2), : w.size(-1)]
        w = w * b + -1e9 * (1 - b)
        w = nn.Softmax(dim=-1)(w)
        w = self.attn_dropout(w)
        return torch.matmul(w, v)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 1, 3).contiguous()
        new_x_shape = (*x.size()[:-2], x.size(-2) * x.size(-1))
        return x.view(*new_x_shape)

    def split_heads(self, x: torch.Tensor, k: bool = False) -> torch.Tensor:
        new_x_shape = (*x.size()[:-1], self.n_head, x.size(-1) // self.n_head)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 3, 1) if k else x.permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_attn(x)
        query, key, value = x.split(self.split_size, dim=2)
        a = self._attn(
            self.split_heads(query), self.split_heads(key, k=True), self.split_heads(value)
        )
        return self.resid_dropout(self.c_proj(self.merge_heads(a)))


class MLP(nn.Module):
    def __init__(self, n_state: int, cfg: Any) -> None:
        super().__init__()
        nx = cfg.n_embd
        self.c_fc = Conv1D(n_state, 1, nx)
        self.c_proj = Conv1D(nx, 1, n_state)
        self.act = gelu
        self.dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_ctx: int, cfg: Any, scale: bool = False) -> None:
        super().__init__()
        nx = cfg.n_embd
        self.attn = Attention(nx, n_ctx, cfg, scale)
        self.ln_1 = LayerNorm(nx)
        self.mlp = MLP(4 * nx, cfg)
        self.ln_2 = LayerNorm(nx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.ln_1(x + self.attn(x))
        return self.ln_2(n + self.mlp(n))


class TransformerModel(nn.Module):
    def __init__(self, cfg: Any, vocab: int, n_ctx: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, cfg.n_embd)
        self.drop = nn.Dropout(cfg.embd_pdrop)
        block = Block(n_ctx, cfg, scale=True)
        self.h = nn.ModuleList([copy.deepcopy(block) for _ in range(cfg.n_layer)])
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, x.size(-2), x.size(-1))
        e = self.drop(self.embed(x))
        h = e.sum(dim=2)  # the position information added to the input embeddings
        for block in self.h:
            h = block(h)
        return h


class LMHead(nn.Module):
    def __init__(self, model: TransformerModel, cfg: Any) -> None:
        super().__init__()
        self.n_embd = cfg.n_embd
        embed_shape = model.embed.weight.shape
        self.decoder = nn.Linear(embed_shape[1], embed_shape[0], bias=False)
        self.decoder.weight = model.embed.weight  # tied weights

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h_trunc = h[:, :-1].contiguous().view(-1, self.n_embd)  # the last token removed
        return self.decoder(h_trunc)


class MultipleChoiceHead(nn.Module):
    def __init__(self, clf_token: int, cfg: Any) -> None:
        super().__init__()
        self.n_embd = cfg.n_embd
        self.clf_token = clf_token
        self.dropout = nn.Dropout2d(cfg.clf_pdrop)
        self.linear = nn.Linear(cfg.n_embd, 1)
        nn.init.normal_(self.linear.weight, std=0.02)
        nn.init.normal_(self.linear.bias, 0)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        clf_h = h.view(-1, self.n_embd)
        flat = x[..., 0].contiguous().view(-1)
        clf_h = clf_h[flat == self.clf_token, :]
        clf_h = clf_h.view(-1, x.size(1), self.n_embd, 1)
        clf_h = self.dropout(clf_h.transpose(1, 2)).transpose(1, 2)
        clf_h = clf_h.contiguous().view(-1, self.n_embd)
        return self.linear(clf_h).view(-1, x.size(1))


class DoubleHeadModel(nn.Module):
    def __init__(self, cfg: Any, clf_token: int, vocab: int, n_ctx: int) -> None:
        super().__init__()
        self.transformer = TransformerModel(cfg, vocab=vocab, n_ctx=n_ctx)
        self.lm_head = LMHead(self.transformer, cfg)
        self.task_head = MultipleChoiceHead(clf_token, cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.transformer(x)
        return self.lm_head(h), self.task_head(h, x)


def warmup_linear(x: float, warmup: float = 0.002) -> float:
    s = 1 if x <= warmup else 0
    return (s * (x / warmup) + (1 - s)) * (1 - x)


class OpenAIAdam(torch.optim.Optimizer):
    """Adam with the fixed weight decay, as ``opt.py`` has it (warmup-linear schedule)."""

    def __init__(self, params: Any, lr: float, warmup: float, t_total: int, **kw: Any) -> None:
        defaults = dict(lr=lr, warmup=warmup, t_total=t_total, b1=0.9, b2=0.999, e=1e-8)
        defaults.update(l2=0.01, vector_l2=False, max_grad_norm=1)
        defaults.update(kw)
        super().__init__(params, defaults)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.data
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["b1"], group["b2"]
                state["step"] += 1
                if group["max_grad_norm"] > 0:
                    clip_grad_norm_(p, group["max_grad_norm"])
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["e"])
                bias_correction1 = 1 - beta1 ** state["step"]
                bias_correction2 = 1 - beta2 ** state["step"]
                lr_scheduled = group["lr"] * warmup_linear(
                    state["step"] / group["t_total"], group["warmup"]
                )
                step_size = lr_scheduled * math.sqrt(bias_correction2) / bias_correction1
                p.data.addcdiv_(exp_avg, denom, value=-step_size)
                if (len(p.size()) > 1 or group["vector_l2"]) and group["l2"] > 0:
                    p.data.add_(p.data, alpha=-lr_scheduled * group["l2"])


class MultipleChoiceLossCompute:
    def __init__(self, lm_criterion: Any, clf_criterion: Any, lm_coef: float, opt: Any) -> None:
        self.lm_criterion = lm_criterion
        self.clf_criterion = clf_criterion
        self.lm_coef = lm_coef
        self.opt = opt

    def __call__(
        self,
        X: torch.Tensor,
        Y: torch.Tensor,
        M: torch.Tensor,
        clf_logits: torch.Tensor,
        lm_logits: torch.Tensor | None = None,
        only_return_losses: bool = False,
    ) -> Any:
        if lm_logits is not None:
            x_shifted = X[:, :, 1:, 0].contiguous().view(-1)
            M = M.view(-1, M.size(2))
            lm_losses = self.lm_criterion(lm_logits, x_shifted)
            lm_losses = lm_losses.view(X.size(0) * X.size(1), X.size(2) - 1)
            lm_losses = lm_losses * M[:, 1:]
            lm_losses = lm_losses.sum(1) / torch.sum(M[:, 1:], 1)
        clf_losses = self.clf_criterion(clf_logits, Y)
        if only_return_losses:
            return (clf_losses, lm_losses) if lm_logits is not None else clf_losses
        if self.lm_coef > 0 and lm_logits is not None:
            train_loss = clf_losses.sum() + self.lm_coef * lm_losses.sum()
        else:
            train_loss = clf_losses.sum()
        train_loss.backward()
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad()
        return train_loss.item()


def build() -> nn.Module:
    torch.manual_seed(0)
    return DoubleHeadModel(CFG, CLF_TOKEN, VOCAB, N_CTX).double()


def wrap(model: Any, devices: list[str]) -> Any:
    return dp.DataParallel(model, devices, output_rules={"output[0]": 0})


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [OpenAIAdam(model.parameters(), lr=6.25e-3, warmup=0.002, t_total=T_TOTAL)]


def transform_roc(
    x1: list[list[int]], x2: list[list[int]], x3: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    max_len = N_CTX // 2 - 2
    xmb = torch.zeros(len(x1), 2, N_CTX, 2, dtype=torch.long)
    mmb = torch.zeros(len(x1), 2, N_CTX, dtype=torch.float64)
    for i, (a, b, c) in enumerate(zip(x1, x2, x3, strict=True)):
        x12 = [START, *a[:max_len], DELIMITER, *b[:max_len], CLF_TOKEN]
        x13 = [START, *a[:max_len], DELIMITER, *c[:max_len], CLF_TOKEN]
        xmb[i, 0, : len(x12), 0] = torch.tensor(x12)
        xmb[i, 1, : len(x13), 0] = torch.tensor(x13)
        mmb[i, 0, : len(x12)] = 1
        mmb[i, 1, : len(x13)] = 1
    xmb[:, :, :, 1] = torch.arange(N_VOCAB + N_SPECIAL, N_VOCAB + N_SPECIAL + N_CTX)
    return xmb, mmb


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(40990)

    def words(n: int) -> list[int]:
        return torch.randint(0, N_VOCAB, (n,), generator=gen).tolist()

    out = []
    for _ in range(3):
        stories = [words(int(torch.randint(1, 3, (1,), generator=gen))) for _ in range(6)]
        xmb, mmb = transform_roc(
            stories, [words(1) for _ in range(6)], [words(2) for _ in range(6)]
        )
        out.append((xmb, mmb, torch.randint(0, 2, (6,), generator=gen)))
    return out


def step(model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]) -> dict[str, Any]:
    (model_opt,) = opts
    criterion = nn.CrossEntropyLoss(reduction="none")
    compute_loss_fct = MultipleChoiceLossCompute(criterion, criterion, LM_COEF, model_opt)
    xmb, mmb, ymb = batch
    run.train()
    lm_logits, clf_logits = run(xmb)
    loss = compute_loss_fct(xmb, ymb, mmb, clf_logits, lm_logits)
    # iter_apply: the validation cost and logits, scaled by the batch size in place
    with torch.no_grad():
        run.eval()
        n = len(xmb)
        _, eval_logits = run(xmb)
        eval_logits *= n
        clf_losses = compute_loss_fct(xmb, ymb, mmb, eval_logits, only_return_losses=True)
        clf_losses *= n
        cost = clf_losses.sum().item()
    return {
        "loss": loss,
        "lm_logits": lm_logits.detach(),
        "clf_logits": clf_logits.detach(),
        "eval_logits": eval_logits,
        "cost": cost,
    }

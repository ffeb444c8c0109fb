"""The distillation loss: T^2 * KL(teacher || student) at temperature T, plus an optional
hidden-state MSE, averaged over the positions that count.

    KL_t = sum_v p_t(v) (log p_t(v) - log q_t(v)),  p = softmax(z_teacher / T), q = softmax(z_student / T)
    loss = (T^2 * sum_t KL_t + w * sum_t mean_d (h_s - h_t)^2 [+ T^2 * sum_t KL_t(early)]) / N

With an early-exit head (paper App. E) the same KL against the teacher's final logits is
added for the head's logits on the input of layer l (the sum of both losses, as the paper).

N is the number of counted positions of the whole optimizer step (all micro-batches, all
processes), so accumulation and data parallelism sum the same terms a single big batch
would. T^2 keeps the gradient scale independent of T (Hinton et al.).

Memory: `chunked_kl_sum` never holds more than `chunk` rows of vocabulary logits. Its forward
computes, chunk by chunk, the logits of both models, the KL and the gradient with respect to
the student's (normed) hidden states, d(T^2 KL_t)/dz_s = T (q_t - p_t), pulled back through
the frozen head: (T (q - p)) @ W. Backward only scales that stored gradient. The reference
`reference_kl_sum` materialises all logits and lets autograd do the rest; tests compare them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.tools.swiftkv.layer_units import HiddenPair


def reference_kl_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * sum over rows of KL(softmax(teacher / T) || softmax(student / T)), float32."""
    log_q = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return temperature ** 2 * F.kl_div(log_q, log_p, log_target=True, reduction="sum")


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, temperature: float, chunk: int) -> torch.Tensor:
        w = weight.float()
        b = None if bias is None else bias.float()
        grad = torch.empty_like(student, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float64, device=student.device)
        with torch.autocast(student.device.type, enabled=False):
            for start in range(0, student.shape[0], chunk):
                rows = slice(start, start + chunk)
                log_q = torch.log_softmax(F.linear(student[rows].float(), w, b) / temperature, dim=-1)
                log_p = torch.log_softmax(F.linear(teacher[rows].float(), w, b) / temperature, dim=-1)
                p = log_p.exp()
                total += (p * (log_p - log_q)).sum(dtype=torch.float64)
                if grad is not None:
                    grad[rows] = ((log_q.exp() - p) * temperature) @ w
        ctx.save_for_backward(grad)
        ctx.input_dtype = student.dtype
        return (total * temperature ** 2).float()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        scaled = None if grad is None else (grad * grad_output).to(ctx.input_dtype)
        return scaled, None, None, None, None, None


def chunked_kl_sum(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, head: nn.Linear,
                   temperature: float, chunk: int) -> torch.Tensor:
    """T^2 * sum of KL over rows of normed hidden states [N, hidden] through the frozen `head`.
    Differentiable in `student_hidden` only (the head and the teacher are constants)."""
    if head.weight.requires_grad:
        raise ValueError("chunked_kl_sum treats the vocabulary head as frozen")
    return _ChunkedKL.apply(student_hidden, teacher_hidden.detach(), head.weight, head.bias, float(temperature),
                            int(chunk))


@dataclass(frozen=True)
class LossParts:
    total: torch.Tensor  # differentiable, already divided by the step's counted positions
    kl: float  # T^2 * KL part of `total`
    hidden_mse: float  # weighted MSE part of `total`
    early_kl: float = 0.0  # T^2 * KL(teacher || early-exit head) part of `total`


def distill_loss(pair: HiddenPair, counted: torch.Tensor, final_norm: nn.Module, head: nn.Linear,
                 normaliser: float, temperature: float, chunk: int, hidden_weight: float = 0.0) -> LossParts:
    """This micro-batch's share of the step loss; `counted` [B, S] selects the positions."""
    rows = counted.reshape(-1)
    width = pair.teacher.shape[-1]
    teacher = final_norm(pair.teacher.reshape(-1, width)[rows])
    if pair.student is not None:
        student = final_norm(pair.student.reshape(-1, width)[rows])
        kl = chunked_kl_sum(student, teacher, head, temperature, chunk) / normaliser
    else:  # only the early-exit head trains: the main student is not run
        kl = torch.zeros((), device=teacher.device)
    total, mse = kl, 0.0
    if hidden_weight > 0:
        if pair.student_at is None or pair.teacher_at is None:
            raise ValueError("a hidden-state loss needs the hidden states of its layer")
        diff = (pair.student_at.float() - pair.teacher_at.float()).reshape(-1, width)[rows]
        term = hidden_weight * diff.pow(2).mean(dim=-1).sum() / normaliser
        total = total + term
        mse = float(term.detach())
    early_kl = 0.0
    if pair.student_early is not None:  # the early-exit head learns the teacher's final distribution
        early = final_norm(pair.student_early.reshape(-1, width)[rows])
        term = chunked_kl_sum(early, teacher, head, temperature, chunk) / normaliser
        total = total + term
        early_kl = float(term.detach())
    return LossParts(total, float(kl.detach()), mse, early_kl)

"""The LM head's loss and its gradient for one forward window, without autograd.

Cross-entropy is ``logsumexp(logits) - logits[target]``; its gradient with respect to the
logits is ``softmax(logits) - onehot(target)``, computed in place over the logits buffer (no
log-softmax buffer, no zero-filled gradient), only for rows that have a target. The gradient
then goes back through a soft cap on the logits (Gemma 2's), the LM head matmul and the final RMSNorm by hand.
"""

from __future__ import annotations

import torch

from coserve.finetune.sequence_state import IGNORE_INDEX
from coserve.model.decoder import DecoderModel
from coserve.model.norm_grad import rms_norm_backward, rms_norm_stats


def head_loss_and_grad(model: DecoderModel, x: torch.Tensor, targets: torch.Tensor, loss_scale: float,
                       need_grad: bool = True) -> tuple[float, torch.Tensor | None, int]:
    """``(loss, dL/dx, correct)`` for last-layer outputs ``x`` ``[n, H]`` and ``targets`` ``[n]`` (IGNORE_INDEX: none).

    The loss is the sum of the rows' cross-entropies times ``loss_scale``; rows without a
    target get a zero gradient. With ``need_grad`` False (validation) the gradient is None.
    ``correct``: the targets that are their row's most likely token (token accuracy's numerator).
    """
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    m = int(rows.numel())
    if m == 0:
        return 0.0, torch.zeros_like(x) if need_grad else None, 0
    xs = x if m == x.shape[0] else x[rows]
    t = targets[rows]
    stats = rms_norm_stats(xs, model.cfg.rms_norm_eps)  # the final norm's, for its backward too
    logits = model.logits(model.final_norm(xs, stats))  # [m, V] float32
    cap = model.cfg.final_softcap  # Gemma 2's capped logits c = cap tanh(z / cap): dc/dz = 1 - (c / cap)^2
    capped = (1 - (logits / cap).square()) if cap is not None and need_grad else None
    picked = logits.gather(1, t.unsqueeze(1))  # [m, 1]
    top, predicted = logits.max(dim=-1, keepdim=True)
    probs = logits.sub_(top).exp_()  # exp(logits - max), in the logits' buffer
    total = probs.sum(dim=-1, keepdim=True)
    # logsumexp - logit[target], and the count of right predictions, read back together (one device sync)
    loss_sum, hits = torch.stack([(top + total.log() - picked).sum(),
                                  (predicted.squeeze(1) == t).sum().to(top.dtype)]).tolist()
    loss, correct = loss_sum * loss_scale, int(hits)
    if not need_grad:
        return loss, None, correct
    probs.div_(total)  # softmax
    probs[torch.arange(m, device=probs.device), t] -= 1.0
    probs.mul_(loss_scale if model.cfg.logits_scaling is None else loss_scale / model.cfg.logits_scaling)  # Granite
    if capped is not None:
        probs.mul_(capped)
    dh = model.input_grad(probs.to(x.dtype), model.lm_head)  # [m, H]
    dx = rms_norm_backward(dh, xs, model.norm_f32, model.cfg.rms_norm_eps, stats)
    if m == x.shape[0]:
        return loss, dx, correct
    grad = torch.zeros_like(x)
    grad[rows] = dx
    return loss, grad, correct

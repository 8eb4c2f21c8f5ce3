"""One forward window and one backward window of a finetuning sequence (FlexLLM Algorithm 2).

Any window schedule gives the gradients of one whole-sequence backward: a backward
window of layer ``l`` recomputes the layer on its tokens under autograd, with the
cached prefix K/V as leaves, and back-propagates the gradient from the layer above
together with the dK/dV that later windows accumulated for its own positions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from coserve.finetune import pruned_layer
from coserve.finetune.head_loss import head_loss_and_grad
from coserve.finetune.sequence_state import SequenceState
from coserve.finetune.window_attention import window_attention
from coserve.model.attention_spec import AttentionSpec
from coserve.model.decoder import Bypass, DecoderModel


@dataclass(slots=True)
class FinetuneSlice:
    """The next forward window of one finetuning sequence, riding in an inference iteration."""

    bypass: Bypass  # the job's trainable bypass
    state: SequenceState
    num_tokens: int  # window size (capped at what the sequence has left)
    loss_scale: float  # 1 / target tokens of the job's mini-batch


def forward_window(model: DecoderModel, bypass: Bypass, state: SequenceState, num_tokens: int,
                   loss_scale: float) -> float:
    """Run the next ``num_tokens`` tokens through every layer; returns their scaled loss.

    ``loss_scale`` is 1 / (target tokens of the whole mini-batch), so that a mini-batch's
    gradients equal those of its mean loss. The gradient at the last layer's output is kept.
    """
    a = state.forward_done
    b = min(a + num_tokens, state.num_tokens)
    if b <= a:
        raise ValueError("forward_window: the sequence's forward pass is already finished")
    positions = state.positions[a:b]
    with torch.no_grad(), training_rows(bypass, state, positions):
        x = model.embed_tokens(state.token_ids[a:b])
        for layer in model.layers:
            i = layer.index
            state.layer_inputs[i][a:b] = x

            def attend(q, k, v, _i, i=i):
                return sequence_attend(state, i, a, b, q, k, v, model.attention[i])

            if state.keeps is None:
                x, _, _ = model.layer_forward(layer, x, positions, attend, bypass)
            else:
                x = pruned_layer.forward_layer(model, layer, x, positions, attend, bypass, state.keeps[i], a, b)
    return finish_forward_window(model, state, x, a, b, loss_scale)


def sequence_attend(state: SequenceState, i: int, a: int, b: int, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Layer ``i`` of a forward window over rows ``a:b``: store their K/V in the sequence's cache, attend over
    the cache so far, and keep attention's output when the plan does."""
    state.k[i][a:b], state.v[i][a:b] = k, v
    keep = state.keeps[i] if state.keeps is not None else None
    return pruned_layer.window_attend(keep, a, b, q, state.k[i][:b], state.v[i][:b], spec)


def finish_forward_window(model: DecoderModel, state: SequenceState, x: torch.Tensor, a: int, b: int,
                          loss_scale: float) -> float:
    """After the last layer: the window's loss and gradient, and the sequence's progress (a validation
    sequence is finished with its forward pass)."""
    loss = _head_loss_and_grad(model, state, x, a, b, loss_scale)
    state.forward_done = b
    state.loss_sum += loss
    state.window_log.append(("forward", -1, a, b))
    if state.forward_finished and not state.eval_only:
        state.backward_layer = len(model.layers) - 1
        state.backward_end = state.num_tokens
    return loss


def training_rows(bypass: Bypass, state: SequenceState | int, positions: torch.Tensor):
    """Tell a trainable bypass which rows a window holds (for its dropout masks); ``state`` is the
    sequence (a validation sequence runs without dropout) or its dropout seed."""
    if isinstance(state, SequenceState):
        if state.eval_only:
            return contextlib.nullcontext()
        state = state.dropout_seed
    rows = getattr(bypass, "training_rows", None)
    return rows(state, positions) if rows is not None else contextlib.nullcontext()


def _head_loss_and_grad(model: DecoderModel, state: SequenceState, x: torch.Tensor, a: int, b: int,
                        loss_scale: float) -> float:
    """Cross-entropy of the window's targets; stores dL/dx at the last layer's output for rows a:b."""
    loss, grad, correct = head_loss_and_grad(model, x, state.targets[a:b], loss_scale,
                                             need_grad=not state.eval_only)
    state.correct += correct
    if grad is not None:
        state.grad[a:b] = grad
    return loss


def backward_window(model: DecoderModel, bypass: Bypass, state: SequenceState, num_tokens: int) -> None:
    """Back-propagate the current backward layer over its last ``num_tokens`` pending tokens.

    Adapter gradients accumulate into the bypass parameters' ``.grad``.
    """
    if not state.forward_finished or state.backward_layer < 0:
        raise ValueError("backward_window: the sequence is not in its backward phase")
    i = state.backward_layer
    b = state.backward_end
    a = max(0, b - num_tokens)
    layer = model.layers[i]
    need_input_grad = i > 0  # layer 0's input is the frozen embedding
    positions = state.positions_of(a, b)
    with training_rows(bypass, state, positions):
        if state.keeps is not None:
            dx = pruned_layer.backward_layer(
                model, layer, bypass, state.keeps[i], state.layer_inputs[i][a:b], state.grad[a:b],
                positions, state.k[i], state.v[i], state.dk, state.dv, a, b, need_input_grad)
            if dx is not None:
                state.grad[a:b] = dx
        else:
            _recompute_backward(model, bypass, state, i, a, b, need_input_grad)
    state.window_log.append(("backward", i, a, b))
    state.backward_end = a
    if a == 0:  # this layer is done: move to the one below with a fresh accumulator
        state.backward_layer = i - 1
        state.backward_end = state.num_tokens
        state.dk.zero_()
        state.dv.zero_()


def _recompute_backward(model: DecoderModel, bypass: Bypass, state: SequenceState, i: int, a: int, b: int,
                        need_input_grad: bool = True) -> None:
    """``--rematerialize all``: recompute the layer on rows a:b under autograd and back-propagate.

    Without ``need_input_grad`` the input is no leaf, and K/V carry gradients only where a bypass
    produces them (autograd then runs only what the bypasses' parameters need).
    """
    layer = model.layers[i]
    kv_grads = need_input_grad or any(m in bypass.modules for m in ("q_proj", "k_proj", "v_proj", "qkv_proj"))
    x = state.layer_inputs[i][a:b].detach().requires_grad_(need_input_grad)
    k_prefix = state.k[i][:a].detach().requires_grad_(kv_grads)
    v_prefix = state.v[i][:a].detach().requires_grad_(kv_grads)

    def attend(q, k, v, _i):
        return window_attention(q, torch.cat([k_prefix, k]), torch.cat([v_prefix, v]), model.attention[i])

    with torch.enable_grad():
        out, k_own, v_own = model.layer_forward(layer, x, state.positions[a:b], attend, bypass)
        pairs = [(t, g) for t, g in ((out, state.grad[a:b]), (k_own, state.dk[a:b]), (v_own, state.dv[a:b]))
                 if t.requires_grad]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    if need_input_grad:
        state.grad[a:b] = x.grad
    if a and kv_grads:
        state.dk[:a] += k_prefix.grad
        state.dv[:a] += v_prefix.grad

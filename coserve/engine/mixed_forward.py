"""One forward call over inference rows and a finetuning forward window together (co-serving).

Inference rows come first and go through paged attention and the served adapters (LoRA and
IA3 slots); the finetuning rows follow and go through attention over their sequence's own cached
prefix and the job's trainable bypass, keeping what its backward will read. Every matmul of the
layer runs once over all rows.
"""

from __future__ import annotations

import torch

from coserve.finetune.pruned_layer import keep_tap
from coserve.finetune.token_windows import FinetuneSlice, finish_forward_window, sequence_attend, training_rows
from coserve.model.attention import PagedKVCache, paged_attention
from coserve.model.decoder import Bypass, DecoderModel
from coserve.model.forward_batch import ForwardBatch


class RowSplitBypass:
    """Rows ``[:split]`` through the inference adapters, rows ``[split:end]`` through the trainable bypass; rows
    past ``end`` (padding to the GEMM tile) through neither.

    The inference adapters run over ``inference_rows`` rows (the inference rows, then zero rows), as
    the inference batch alone would (``DecoderModel.forward``'s ``min_rows``), so that their matmuls
    round the same with or without the finetuning rows. Within a mixture's expert, whose call takes both kinds of
    rows, each kind's adapter runs over its own rows, the inference ones in a call of ``padded_rows`` of their count.
    """

    def __init__(self, inference: Bypass | None, finetune: Bypass, split: int, end: int,
                 inference_rows: int = 0, padded_rows=None) -> None:
        self.inference, self.finetune, self.split, self.end = inference, finetune, split, end
        self.pad = max(0, inference_rows - split)
        self.padded_rows = padded_rows
        self.modules = finetune.modules | (inference.modules if inference is not None else frozenset())

    def _inference_output(self, inf: Bypass, layer: int, module: str, x: torch.Tensor, y: torch.Tensor):
        s, pad = self.split, self.pad
        if not pad:
            return inf.output(layer, module, x[:s], y[:s])
        x = torch.cat([x[:s], x.new_zeros(pad, x.shape[1])])
        y = torch.cat([y[:s], y.new_zeros(pad, y.shape[1])])
        return inf.output(layer, module, x, y)[:s]

    def _parts(self, module: str):
        inf = self.inference if self.inference is not None and module in self.inference.modules else None
        return inf, self.finetune if module in self.finetune.modules else None

    def input(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
        inf, ft = self._parts(module)
        s, e = self.split, self.end
        top = inf.input(layer, module, x[:s]) if inf is not None else x[:s]
        bottom = ft.input(layer, module, x[s:e]) if ft is not None else x[s:e]
        return torch.cat([top, bottom, x[e:]])

    def output(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.output_keep(layer, module, x, y, keep=False)[0]

    def output_keep(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor, keep: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        inf, ft = self._parts(module)
        s, e = self.split, self.end
        top = self._inference_output(inf, layer, module, x, y) if inf is not None else y[:s]
        kept = None
        if ft is None:
            bottom = y[s:e]
        elif keep:
            bottom, kept = ft.output_keep(layer, module, x[s:e], y[s:e])
        else:
            bottom = ft.output(layer, module, x[s:e], y[s:e])
        return torch.cat([top, bottom, y[e:]]), kept  # kept: the finetuning rows' only, as the tap stores it

    def expert_output(self, layer: int, module: str, expert: int, rows: torch.Tensor, x: torch.Tensor,
                      y: torch.Tensor) -> torch.Tensor:
        return self.expert_output_keep(layer, module, expert, rows, x, y, keep=False)[0]

    def expert_output_keep(self, layer: int, module: str, expert: int, rows: torch.Tensor, x: torch.Tensor,
                           y: torch.Tensor, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An expert's rows ``rows`` (then padding): the inference ones through their adapters, in a call of their
        own padded as their count alone would be; the finetuning ones through the trainable bypass, whose kept
        tensor comes back for every one of ``rows`` (zeros for the inference rows)."""
        inf, ft = self._parts(module)
        out, kept = y.clone(), None
        if inf is not None:
            idx = (rows < self.split).nonzero().squeeze(1)
            if idx.numel():
                n = idx.numel()
                pad = self.padded_rows(n) - n
                xi, yi = (torch.cat([t[idx], t.new_zeros(pad, t.shape[1])]) if pad > 0 else t[idx] for t in (x, y))
                out[idx] = inf.expert_output(layer, module, expert, rows[idx], xi, yi)[:n]
        if ft is not None:
            idx = ((rows >= self.split) & (rows < self.end)).nonzero().squeeze(1)
            if idx.numel():
                own = rows[idx] - self.split
                if keep:
                    out[idx], xa = ft.expert_output_keep(layer, module, expert, own, x[idx], y[idx])
                    kept = xa.new_zeros(rows.numel(), xa.shape[1])
                    kept[idx] = xa
                else:
                    out[idx] = ft.expert_output(layer, module, expert, own, x[idx], y[idx])
        return out, kept


@torch.inference_mode(False)  # the finetuning rows' kept tensors must stay usable by autograd later
def mixed_forward(model: DecoderModel, batch: ForwardBatch, cache: PagedKVCache, adapters: Bypass | None,
                  ft: FinetuneSlice, adapter_rows: int = 0) -> tuple[torch.Tensor, float]:
    """Final hidden states of the inference rows ``[T, H]`` and the finetuning window's scaled loss.

    ``adapters``, the inference rows' bypass, covers ``max(T, adapter_rows)`` rows (padded past the batch,
    as for ``model.forward``).
    """
    st = ft.state
    a = st.forward_done
    b = min(a + ft.num_tokens, st.num_tokens)
    if b <= a:
        raise ValueError("mixed_forward: the sequence's forward pass is already finished")
    t = batch.num_tokens
    e = t + b - a
    split = model.padded_rows(t) if t else 0  # the inference rows' matmul calls, as alone (tiled_gemm.py)
    pad = max(0, split - e)  # zero rows, where the window does not fill the inference rows' padding
    positions = torch.cat([batch.positions, st.positions[a:b], batch.positions.new_zeros(pad)])
    bypass = RowSplitBypass(adapters, ft.bypass, t, e, adapter_rows, model.padded_rows)
    with torch.no_grad(), training_rows(ft.bypass, st, st.positions[a:b]):
        x = model.embed_tokens(torch.cat([batch.token_ids, st.token_ids[a:b]]))
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        for layer in model.layers:
            i = layer.index
            st.layer_inputs[i][a:b] = x[t:e]

            def attend(q, k, v, _i, i=i):
                spec = model.attention[i]
                parts = [sequence_attend(st, i, a, b, q[t:e], k[t:e], v[t:e], spec)]
                if t:
                    parts.insert(0, paged_attention(q[:t], k[:t], v[:t], i, cache, batch, spec))
                if pad:
                    parts.append(q.new_zeros(pad, parts[0].shape[1]))
                return torch.cat(parts) if len(parts) > 1 else parts[0]

            tap = keep_tap(st.keeps[i], a, b, first_row=t) if st.keeps is not None else None
            x, _, _ = model.layer_forward(layer, x, positions, attend, bypass, tap, split)
    loss = finish_forward_window(model, st, x[t:e], a, b, ft.loss_scale)
    return model.final_norm(x[:t]), loss

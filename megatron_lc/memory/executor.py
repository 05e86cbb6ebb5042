"""``MemoExecutor``: a transformer layer's forward under token-wise recompute / Memo offload (see recompute.py).

Two layer shapes:

* standard (``SelfAttention`` with a separate core attention): ``pre`` = norm 1 + QKV + RoPE -> q, k, v;
  core attention through its (out, lse) form (``attention_io``), run once; ``post`` = out-proj + residual + MLP.
* block (the attention block replaced whole, e.g. FPDT's ``FPDTSelfAttention``, which chunks QKV, attention and
  out-proj and keeps/offloads its own tensors): ``pre`` = norm 1; the block runs on all tokens with autograd and
  whatever it saves through autograd is kept whole as ``attn`` (offloaded, never recomputed); ``post`` = residual
  + MLP. The kept/dropped token split applies to norm 1 and to residual + MLP.
"""
from __future__ import annotations

from typing import Optional

import torch

from .attention_io import LseAttention
from .offload import MemoRuntime
from .recompute import LayerStep, TokenSplit, _Attention, _PostDropped, _PreDropped


def _param_storages(layer) -> set:
    return {p.untyped_storage().data_ptr() for p in layer.parameters()}


def _block_post(layer):
    def post(x: torch.Tensor, block_out: torch.Tensor) -> torch.Tensor:
        r = x + block_out
        return r + layer.mlp(layer.pre_mlp_layernorm(r))
    return post


def _block_pre(layer):
    return lambda x, rope: (layer.input_layernorm(x),)


class MemoExecutor:
    """``TransformerLayer.executor`` for token-wise recompute (``offload=False``) and Memo (``offload=True``).
    ``io=None``: block mode (the layer's attention block is one autograd op)."""

    def __init__(self, runtime: MemoRuntime, io: Optional[LseAttention], sp_groups: int):
        self.runtime, self.io, self.G = runtime, io, sp_groups
        self._rope_key = None
        self._rope_split = None
        # passed to the dropped-token Functions so their outputs require grad (and parameter grads flow) even
        # when the layer input does not
        self._always_grad = torch.empty(0, requires_grad=True)

    def rope_parts(self, rope, split: TokenSplit):
        """RoPE tables of the kept and dropped tokens (computed once per model forward, shared by the layers)."""
        if rope is None:
            return None, None, set()
        key = (id(rope[0]), rope[0].data_ptr(), split.S, split.sA)
        if key != self._rope_key:
            cos_a, cos_d = split.gathered(rope[0])
            sin_a, sin_d = split.gathered(rope[1])
            self._rope_key, self._rope_split = key, ((cos_a, sin_a), (cos_d, sin_d), rope)
        a, d, _ = self._rope_split
        return a, d, {t.untyped_storage().data_ptr() for pair in (a, d, rope) for t in pair}

    def __call__(self, layer, x: torch.Tensor, rope) -> torch.Tensor:
        if not torch.is_grad_enabled():
            if self.io is None:
                return _block_post(layer)(x, layer.self_attention(layer.input_layernorm(x), rope))
            q, k, v = layer.pre_attention(x, rope)
            return layer.post_attention(x, layer.self_attention.core_attention(q, k, v))
        rt = self.runtime
        x = x.contiguous()
        S = x.shape[0]
        split = TokenSplit(S, rt.kept_tokens(S), self.G if self.io is not None else 1)
        rope_a, rope_d, rope_refs = self.rope_parts(rope, split) if self.io is not None else (None, None, set())
        if self.io is None and rope is not None:
            rope_refs = {t.untyped_storage().data_ptr() for t in rope}
        slot = rt.new_slot(layer.layer_number, _param_storages(layer) | rope_refs)
        slot.stats.tokens, slot.stats.tokens_kept, slot.stats.tokens_recomputed = S, split.sA, split.sD
        if self.io is None:
            st = LayerStep(rt, layer, None, slot, split, None, _block_pre(layer), _block_post(layer))
        else:
            st = LayerStep(rt, layer, self.io, slot, split, rope_d, layer.pre_attention, layer.post_attention)
        st.h_input = slot.keep("input", x)
        x_a, x_d = split.local(x)
        with torch.autograd.graph.saved_tensors_hooks(slot.pack, slot.unpack):
            pre_a = st.pre_fn(x_a, rope_a) if split.sA else None
            pre_d = _PreDropped.apply(st, x_d, self._always_grad) if split.sD else None
            if self.io is None:
                out = self._block(st, layer, pre_a, pre_d, rope)
            else:
                out = _Attention.apply(st, *(pre_a or (None,) * 3), *(pre_d or (None,) * 3))
            n = split.G * split.sA
            ys = []
            if split.sA:
                ys.append(st.post_fn(x_a, out[:n]))
            if split.sD:
                ys.append(_PostDropped.apply(st, x_d, out[n:], self._always_grad))
            y = torch.cat(ys) if len(ys) > 1 else ys[0]
        rt.after_forward(slot)
        if y.requires_grad:
            y.register_hook(lambda g, slot=slot: (rt.before_backward(slot), g)[1])
        return y

    @staticmethod
    def _block(st: LayerStep, layer, pre_a, pre_d, rope) -> torch.Tensor:
        """Block mode: the attention block on all tokens, with autograd; what it saves is kept whole (``attn``)."""
        a = torch.cat([pre_a[0], pre_d[0]]) if (pre_a and pre_d) else (pre_a or pre_d)[0]
        slot = st.slot
        slot.default_kind = "attn"
        try:
            out = layer.self_attention(a, rope)
        finally:
            slot.default_kind = "other"
        st.runtime.attn_forward_calls += 1
        st.h_attn = slot.keep("attn", out)  # the dropped tokens' post part is recomputed from it
        if not st.split.sD:
            out.register_hook(lambda g: (st.runtime.layer_backward_done(slot), g)[1])
        return out

"""A transformer layer's forward under token-wise recompute / Memo offload (the token split is in ``steps.py``).
The model spec constructs one executor per layer; ``TransformerLayer.forward`` hands itself to it.

Two layer shapes, two executors:

* ``MemoExecutor`` (``SelfAttention`` with a core attention): ``pre`` = norm 1 + QKV + RoPE -> q, k, v; core
  attention through its (out, lse) pair (``attention/core.py``), run once; ``post`` = out-proj + residual + MLP.
* ``MemoBlockExecutor`` (FPDT's block, which chunks QKV, attention and out-proj and keeps/offloads its own
  tensors): ``pre`` = norm 1; the block runs on all tokens with autograd and whatever it saves through autograd is
  kept whole as ``attn`` (offloaded, never recomputed); ``post`` = residual + MLP. The kept/dropped token split
  applies to norm 1 and to residual + MLP.

Both take the model's ``MemoRuntime`` (run-time state: rounding buffers, host copies, counters) and the number of
sequence-parallel blocks G of a gathered tensor (tp with Megatron SP, else 1).
"""
from __future__ import annotations

import torch

from ...device import storage_id
from ..token_split import TokenSplit
from .runtime import MemoRuntime
from .steps import LayerStep, SplitAttention, PostDropped, PreDropped


def _param_storages(layer) -> set:
    return {storage_id(p) for p in layer.parameters()}


class MemoExecutor:
    """Token-wise recompute (``runtime.offload`` False: ``recompute_granularity: full``) or Memo (True) of a layer
    with a separate core attention."""

    block_mode = False

    def __init__(self, runtime: MemoRuntime, sp_groups: int):
        self.runtime, self.sp_blocks = runtime, sp_groups
        # passed to the dropped-token Functions so their outputs require grad (and parameter grads flow) even
        # when the layer input does not
        self._always_grad = torch.empty(0, requires_grad=True)

    def with_runtime(self, runtime: MemoRuntime) -> "MemoExecutor":
        """The same executor on another runtime (the calibration's measuring one)."""
        return type(self)(runtime, self.sp_blocks)

    def rope_parts(self, rope, split: TokenSplit):
        """RoPE tables of the kept and dropped tokens, computed once per model forward and shared by the layers: the
        cache is the runtime's (one executor per layer, one runtime per model), since with sequence parallelism
        (G > 1) the split tables are copies -- one per layer would hold L copies of cos and sin (0.25 GiB a layer
        for Llama3-8B at 1M tokens, tp2 cp4) until the next forward."""
        if rope is None:
            return None, None, set()
        rt = self.runtime
        key = (id(rope[0]), storage_id(rope[0]), split.tokens, split.kept)
        if rt.rope_split is None or rt.rope_split[0] != key:
            cos_a, cos_d = split.gathered(rope[0])
            sin_a, sin_d = split.gathered(rope[1])
            rt.rope_split = (key, ((cos_a, sin_a), (cos_d, sin_d), rope))
        a, d, _ = rt.rope_split[1]
        return a, d, {storage_id(t) for pair in (a, d, rope) for t in pair}

    def _step(self, layer, x: torch.Tensor, rope, documents) -> tuple:
        """The layer's ``LayerStep`` (its slot placed from now on) and the RoPE rows of the kept tokens."""
        rt = self.runtime
        S = x.shape[0]
        split = TokenSplit(S, rt.kept_tokens(S), self.sp_blocks)
        rope_a, rope_d, rope_refs = self.rope_parts(rope, split)
        slot = rt.new_slot(layer.layer_number, _param_storages(layer) | rope_refs)
        st = LayerStep(rt, layer, layer.self_attention.core_attention, slot, split, rope_d, layer.pre_attention,
                       layer.post_attention, documents)
        return st, rope_a

    def _attend(self, st: LayerStep, layer, pre_a, pre_d, rope) -> torch.Tensor:
        return SplitAttention.apply(st, *(pre_a or (None,) * 3), *(pre_d or (None,) * 3))

    def __call__(self, layer, x: torch.Tensor, rope, documents=None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return layer.plain_forward(x, rope, documents)
        rt = self.runtime
        x = x.contiguous()
        st, rope_a = self._step(layer, x, rope, documents)
        split, slot = st.split, st.slot
        stats = slot.stats
        stats.tokens, stats.tokens_kept, stats.tokens_recomputed = split.tokens, split.kept, split.dropped
        st.h_input = slot.keep("input", x)
        x_a, x_d = split.local(x)
        with torch.autograd.graph.saved_tensors_hooks(slot.pack, slot.unpack):
            pre_a = st.pre_fn(x_a, rope_a) if split.kept else None
            pre_d = PreDropped.apply(st, x_d, self._always_grad) if split.dropped else None
            out = self._attend(st, layer, pre_a, pre_d, rope)
            n = split.blocks * split.kept
            ys = []
            if split.kept:
                ys.append(st.post_fn(x_a, out[:n]))
            if split.dropped:
                ys.append(PostDropped.apply(st, x_d, out[n:], self._always_grad))
            y = torch.cat(ys) if len(ys) > 1 else ys[0]
        rt.after_forward(slot)
        if y.requires_grad:
            y.register_hook(lambda g, slot=slot: (rt.before_backward(slot), g)[1])
        return y


class MemoBlockExecutor(MemoExecutor):
    """Token-wise recompute / Memo around an attention block that is one autograd op (FPDT's); see module doc."""

    block_mode = True

    def __init__(self, runtime: MemoRuntime, sp_groups: int):
        super().__init__(runtime, 1)  # the token split acts on the block's input rows: never gathered

    def _step(self, layer, x: torch.Tensor, rope, documents) -> tuple:
        rt = self.runtime
        S = x.shape[0]
        split = TokenSplit(S, rt.kept_tokens(S), 1)
        rope_refs = {storage_id(t) for t in rope} if rope is not None else set()
        slot = rt.new_slot(layer.layer_number, _param_storages(layer) | rope_refs)
        st = LayerStep(rt, layer, None, slot, split, None, lambda x_, rope_: (layer.input_layernorm(x_),),
                       layer.residual, documents)
        return st, None

    def _attend(self, st: LayerStep, layer, pre_a, pre_d, rope) -> torch.Tensor:
        """The attention block on all tokens, with autograd; what it saves is kept whole (``attn``)."""
        a = torch.cat([pre_a[0], pre_d[0]]) if (pre_a and pre_d) else (pre_a or pre_d)[0]
        slot = st.slot
        slot.default_kind = "attn"
        try:
            out = layer.self_attention(a, rope, st.documents)
        finally:
            slot.default_kind = "other"
        st.runtime.attn_forward_calls += 1
        st.h_attn = slot.keep("attn", out)  # the dropped tokens' post part is recomputed from it
        if not st.split.dropped:
            out.register_hook(lambda g: (st.backward_done(), g)[1])
        return out

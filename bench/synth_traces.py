"""Synthetic traces for the planner's benchmarks (``bench/planner.py``) and tests, generated from shapes (no model
run): a Llama layer's forward and backward as eager PyTorch would allocate them, at sizes this machine cannot run
(e.g. Llama3-8B at 32K tokens per GPU).

A layer is a list of ``Op``s. Forward: each op allocates its outputs; a tensor is freed after its last forward
reader unless some op saved it for backward. Backward, ops in reverse: allocate the op's backward temporaries and
the gradients of its inputs (a second gradient of the same tensor is allocated, added in place, freed), free the
temporaries, the gradients of its outputs, and the saved tensors no earlier op still needs.

    trace = llama_iteration_trace(LlamaShape.llama3_8b(seq=32768), num_layers=32)

Shapes follow Llama (RMSNorm computed in fp32, RoPE by rotate-half, flash attention saving out + lse, SwiGLU MLP);
``mlp_chunks`` > 1 runs the MLP in mini-sequences (MsT) and ``head_chunks`` the LM head + loss. Weight gradients are
not in the trace (Megatron keeps them in one contiguous grad buffer).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lc.planning.trace import Event, Trace


@dataclass
class Op:
    name: str
    inputs: list
    outputs: dict  # name -> bytes
    saves: list = field(default_factory=list)
    grads: list = field(default_factory=list)  # inputs that receive a gradient
    bwd_temps: list = field(default_factory=list)  # bytes


@dataclass
class LlamaShape:
    seq: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    micro_batch: int = 1
    dtype_bytes: int = 2  # bf16

    @classmethod
    def llama3_8b(cls, seq: int = 32768) -> "LlamaShape":
        return cls(seq=seq, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256)


def llama_layer_ops(c: LlamaShape, mlp_chunks: int = 1) -> list:
    """One transformer layer; input tensor ``x``, output ``out``."""
    t = c.seq * c.micro_batch
    e = c.dtype_bytes
    h, d = c.hidden, c.hidden // c.heads
    th, th32, t32 = t * h * e, t * h * 4, t * 4
    q, kv = t * c.heads * d * e, t * c.kv_heads * d * e

    def norm(p, x, out):
        return [Op(f"{p}.float", [x], {f"{p}.x32": th32}, grads=[x]),
                Op(f"{p}.pow", [f"{p}.x32"], {f"{p}.sq": th32}, saves=[f"{p}.x32"], grads=[f"{p}.x32"]),
                Op(f"{p}.mean", [f"{p}.sq"], {f"{p}.var": t32}, grads=[f"{p}.sq"], bwd_temps=[th32]),
                Op(f"{p}.rsqrt", [f"{p}.var"], {f"{p}.r": t32}, saves=[f"{p}.r"], grads=[f"{p}.var"]),
                Op(f"{p}.mul", [f"{p}.x32", f"{p}.r"], {f"{p}.xn32": th32}, saves=[f"{p}.x32", f"{p}.r"],
                   grads=[f"{p}.x32", f"{p}.r"], bwd_temps=[th32]),
                Op(f"{p}.cast", [f"{p}.xn32"], {f"{p}.xn": th}, grads=[f"{p}.xn32"]),
                Op(f"{p}.w", [f"{p}.xn"], {out: th}, saves=[f"{p}.xn"], grads=[f"{p}.xn"], bwd_temps=[th])]

    def rope(p, x, size):
        return [Op(f"{p}.rot", [x], {f"{p}.rh": size}, grads=[x], bwd_temps=[size]),
                Op(f"{p}.cos", [x], {f"{p}.xc": size}, grads=[x]),
                Op(f"{p}.sin", [f"{p}.rh"], {f"{p}.xs": size}, grads=[f"{p}.rh"]),
                Op(f"{p}.add", [f"{p}.xc", f"{p}.xs"], {f"{p}.out": size}, grads=[f"{p}.xc", f"{p}.xs"])]

    ops = norm("n1", "x", "n1.out")
    ops += [Op("qkv", ["n1.out"], {"qkv": q + 2 * kv}, saves=["n1.out"], grads=["n1.out"]),
            Op("split", ["qkv"], {"q": q, "k": kv, "v": kv}, grads=["qkv"], bwd_temps=[q + 2 * kv])]
    ops += rope("rq", "q", q) + rope("rk", "k", kv)
    ops += [Op("attn", ["rq.out", "rk.out", "v"], {"attn": q, "lse": t * c.heads * 4},
               saves=["rq.out", "rk.out", "v", "attn", "lse"], grads=["rq.out", "rk.out", "v"],
               bwd_temps=[q, t * c.heads * 4, q + 2 * kv]),  # dout contiguous, softmax_d, fp32-ish accum
            Op("proj", ["attn"], {"proj": th}, saves=["attn"], grads=["attn"]),
            Op("res1", ["x", "proj"], {"h1": th}, grads=["x", "proj"])]
    ops += norm("n2", "h1", "n2.out")
    n = max(mlp_chunks, 1)
    tc, f = -(-t // n), c.ffn
    for k in range(n):
        p = f"mlp{k}"
        ops += [Op(f"{p}.fc1", ["n2.out"], {f"{p}.gu": tc * 2 * f * e}, saves=["n2.out"], grads=["n2.out"]),
                Op(f"{p}.silu", [f"{p}.gu"], {f"{p}.s": tc * f * e}, saves=[f"{p}.gu"], grads=[f"{p}.gu"],
                   bwd_temps=[tc * f * e, tc * f * e]),
                Op(f"{p}.mul", [f"{p}.s", f"{p}.gu"], {f"{p}.a": tc * f * e}, saves=[f"{p}.s", f"{p}.gu"],
                   grads=[f"{p}.s", f"{p}.gu"]),
                Op(f"{p}.fc2", [f"{p}.a"], {f"{p}.y": tc * h * e}, saves=[f"{p}.a"], grads=[f"{p}.a"])]
    ys = [f"mlp{k}.y" for k in range(n)]
    if n > 1:
        ops.append(Op("mlp.cat", ys, {"mlp": th}, grads=ys))
    ops.append(Op("res2", ["h1", "mlp" if n > 1 else ys[0]], {"out": th}, grads=["h1", "mlp" if n > 1 else ys[0]]))
    return ops


class _Emitter:
    def __init__(self):
        self.events: list = []
        self.live: dict = {}  # name -> (id, size)
        self.next = 0
        self.mark = (None, None)

    def malloc(self, name: str, size: int) -> None:
        self.live[name] = (self.next, size)
        self.events.append(Event("malloc", self.next, size, *self._m()))
        self.next += 1

    def free(self, name: str) -> None:
        rid, size = self.live.pop(name)
        self.events.append(Event("free", rid, size, *self._m()))

    def _m(self):
        layer, phase = self.mark
        return (layer, phase) if layer is not None else (None, phase)

    def rename(self, old: str, new: str) -> None:
        self.live[new] = self.live.pop(old)


def _forward(em: _Emitter, ops: list, keep: set, save: bool = True) -> None:
    last = {}
    for k, op in enumerate(ops):
        for x in op.inputs:
            last[x] = k
    saved = {s for op in ops for s in op.saves} if save else set()
    for k, op in enumerate(ops):
        for name, size in op.outputs.items():
            em.malloc(name, size)
        for x in list(op.inputs) + list(op.outputs):
            if last.get(x, -1) <= k and x not in saved and x not in keep and x in em.live:
                em.free(x)


def _backward(em: _Emitter, ops: list, input_sizes: dict) -> None:
    """Backward of ``ops`` from the live output gradients; ``input_sizes``: bytes of tensors the ops read but did
    not create (the layer input)."""
    last_saver = {}
    for k, op in enumerate(ops):
        for s in op.saves:
            last_saver.setdefault(s, k)  # the first forward saver is the last one in backward
    sizes = {name: size for op in ops for name, size in op.outputs.items()}
    for k in range(len(ops) - 1, -1, -1):
        op = ops[k]
        if not any(f"d.{o}" in em.live for o in op.outputs):
            continue
        temps = [f"{op.name}.bt{j}" for j in range(len(op.bwd_temps))]
        for name, size in zip(temps, op.bwd_temps):
            em.malloc(name, size)
        for x in op.grads:
            size = sizes[x] if x in sizes else input_sizes[x]
            if f"d.{x}" in em.live:
                em.malloc(f"d.{x}+", size)
                em.free(f"d.{x}+")
            else:
                em.malloc(f"d.{x}", size)
        for name in temps:
            em.free(name)
        for o in op.outputs:
            if f"d.{o}" in em.live:
                em.free(f"d.{o}")
        for s in op.saves:
            if last_saver.get(s) == k and s in em.live:
                em.free(s)


def llama_iteration_trace(c: LlamaShape, num_layers: int, mlp_chunks: int = 1, head_chunks: int = 1,
                          recompute: bool = False) -> Trace:
    """Embedding, ``num_layers`` layers, LM head + loss, forward and backward, with layer marks. ``recompute``:
    full activation recompute (each layer keeps only its input; its forward is re-run at the start of its
    backward block)."""
    em = _Emitter()
    t, e, h = c.seq * c.micro_batch, c.dtype_bytes, c.hidden
    layer_ops = llama_layer_ops(c, mlp_chunks)
    em.mark = (None, "fwd")
    em.malloc("x", t * h * e)  # embedding output
    for i in range(num_layers):
        em.mark = (i, "fwd")
        _forward(em, layer_ops, keep={"out", "x"} if recompute else {"out"}, save=not recompute)
        em.rename("out", f"L{i}.out")
        for name in [n for n in em.live if not n.startswith("L") and n != "x"]:
            em.rename(name, f"L{i}.{name}")
        if "x" in em.live:
            em.rename("x", f"L{i}.x")
        em.rename(f"L{i}.out", "x")
    em.mark = (None, "fwd")
    hc = max(head_chunks, 1)
    tc = -(-t // hc)
    head = []
    for k in range(hc):
        head += [Op(f"head{k}.logits", ["x"], {f"head{k}.z": tc * c.vocab * e}, saves=["x"], grads=["x"]),
                 Op(f"head{k}.float", [f"head{k}.z"], {f"head{k}.z32": tc * c.vocab * 4}, grads=[f"head{k}.z"]),
                 Op(f"head{k}.lsm", [f"head{k}.z32"], {f"head{k}.lp": tc * c.vocab * 4}, saves=[f"head{k}.lp"],
                    grads=[f"head{k}.z32"]),
                 Op(f"head{k}.nll", [f"head{k}.lp"], {f"head{k}.loss": tc * 4}, grads=[f"head{k}.lp"])]
    _forward(em, head, keep={f"head{k}.loss" for k in range(hc)})
    em.mark = (None, "bwd")
    for k in range(hc):
        em.rename(f"head{k}.loss", f"d.head{k}.loss")  # d(loss)/d(loss) reuses the loss-sized buffer
    _backward(em, head, {"x": t * h * e})
    for i in range(num_layers - 1, -1, -1):
        em.mark = (i, "bwd")
        for name in [n for n in em.live if n.startswith(f"L{i}.")]:
            em.rename(name, name[len(f"L{i}."):])
        em.rename("d.x", "d.out")
        if recompute:
            em.live["d.keep"] = em.live.pop("d.out")  # not an op output until the recomputed forward ends
            _forward(em, layer_ops, keep={"x"})
            em.live["d.out"] = em.live.pop("d.keep")
        _backward(em, layer_ops, {"x": t * h * e})
        if recompute:
            em.free("x")
    em.mark = (None, "bwd")
    em.free("d.x")  # the embedding's backward consumes it
    for name in list(em.live):
        em.free(name)
    tr = Trace(em.events, {"model": "llama", "seq": c.seq, "hidden": c.hidden, "layers": num_layers,
                           "mlp_chunks": mlp_chunks, "head_chunks": head_chunks})
    tr.validate("synthetic trace")
    return tr


def llama_layer_trace(c: LlamaShape, mlp_chunks: int = 1) -> Trace:
    """One layer's forward then backward (marks (0, "fwd") / (0, "bwd")); its input and output gradient are
    outside the trace, the input gradient lives to the end."""
    em = _Emitter()
    ops = llama_layer_ops(c, mlp_chunks)
    em.mark = (0, "fwd")
    em.live["x"] = (-1, 0)
    _forward(em, ops, keep={"out", "x"})
    em.live.pop("x")
    em.mark = (0, "bwd")
    em.malloc("d.out", em.live["out"][1])
    em.free("out")
    _backward(em, ops, {"x": c.seq * c.micro_batch * c.hidden * c.dtype_bytes})
    tr = Trace(em.events, {"model": "llama-layer", "seq": c.seq, "hidden": c.hidden, "mlp_chunks": mlp_chunks})
    tr.validate("synthetic layer trace")
    return tr

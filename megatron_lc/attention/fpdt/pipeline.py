"""The FPDT pipeline of one attention block (paper §4, Figures 4-7) as one autograd function.

Shapes (per rank): block input ``x [s_in, b, h]`` (``s_in = s_local``, or ``s_local/tp`` with sequence parallel),
u chunks, ``c_local = s_local/u`` local tokens per chunk, ``c = P*c_local`` gathered tokens per chunk, local heads
``nq, nkv`` (after tp; nkv already replicated for Ulysses), ``n = nq/P``, ``m = nkv/P`` heads after the all-to-all.

Forward, for q chunk i = 0..u-1:
  project chunk i (``project.py``) -> q, k, v [c_local, b, *, d] -> all-to-all (heads scattered, sequence
  gathered) -> q^, k^, v^ [b, n|m, c, d] = global tokens [i*c, (i+1)*c) (strided layout, ``parallel/token_layout.py``);
  diagonal block (causal) first, then k^/v^ go to the store (host when offloading); kv chunks j = 0..i-1 are
  fetched one after the other, the fetch of 0 issued before the diagonal block and that of j+1 before the compute
  of j (two kv chunks on the device at most), each waiting only on its host copy (``buffers.FPDTBuffers.fetch``);
  online-softmax merge in fp32; q^, o^, lse to the store; o^ all-to-all back -> output rows of chunk i.
Backward (kv outer, q inner, as the paper's Figure 7):
  do^_m = all-to-all of the output gradient, to the store; dq accumulators (fp32) in the store (offloaded: host
  blocks never zeroed on the host; the first fetch of each is zeroed on the device, ``buffers.ChunkStore``);
  for kv chunk j: fetch k^_j, v^_j; dk, dv accumulators; for q chunk m = j..u-1 (prefetching m+1, or kv j+1 at the
  last step): block backward with the final o^_m, lse_m; dq_m += (written back), dk += , dv +=; then the q set of
  chunk j+1 is fetched (its dq written back by now) during chunk j's all-to-all back and projection backward.
  After the inner loop dq_j, dk_j, dv_j are complete: all-to-all back, projection backward of chunk j (autograd).
Document masks and a sliding window (``ranges.py``): each (q chunk, kv chunk) pair is cut into rectangles on the
host; a pair without any is neither computed nor fetched (with a window W of a chunk or less, q chunk i needs only
kv chunks i-1 and i: O(s * W) work and host traffic).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...device import storage_id
from ..merge import merge
from ..ranges import block_rects
from .buffers import ChunkStore, FPDTBuffers
from .project import ProjSavedHooks, project_chunk, storage_bytes

KV, QSET = "fpdt.fetch_kv", "fpdt.fetch_q"  # accounting tags of fetched chunks (buffers.py)
QNAMES = ("q", "o", "do", "lse", "dq")  # a q chunk's set in the backward


@dataclass
class FPDTRun:
    """What one forward of a block needs and its backward reuses (held by the autograd context)."""

    qkv_fn: Any  # (x_chunk, rope_chunk) -> q, k, v  [c_local, b, heads, d]
    topo: Any
    backend: Any
    bufs: FPDTBuffers
    num_chunks: int
    rope_chunks: list  # per chunk: (cos, sin) rows of the chunk, or None
    kv_repeat: int
    offload: bool
    build_graph: bool
    keep_ptrs: set
    head_dim: int
    dtype: Any = None
    x_requires_grad: bool = False
    tag: str = "fpdt"
    params: tuple = ()
    documents: Any = None  # the micro-batch's config.DocumentRanges (packed documents), or None
    window: Optional[int] = None  # the layer's causal sliding window in tokens, or None
    projections: Optional[list] = None
    store: Optional[ChunkStore] = None

    def rects(self, i: int, j: int, c: int):
        """Rectangles of q chunk i x kv chunk j (``ranges.py``; None: no documents, no window): gathered chunk i of
        ``c`` tokens is global range ``[i*c, (i+1)*c)``."""
        return block_rects(self.documents, self.window, ((i * c, (i + 1) * c, 0),), ((j * c, (j + 1) * c, 0),))

    def needed(self, i: int, j: int, c: int) -> bool:
        """Whether q chunk i sees anything of kv chunk j (decided on the host)."""
        rects = self.rects(i, j, c)
        return rects is None or bool(rects)


def _to_attn(bufs: FPDTBuffers, topo, t: torch.Tensor, tag: str) -> torch.Tensor:
    """[c_local, b, H, d] -> all-to-all -> [b, H/P, c, d] contiguous (counted under ``tag``)."""
    g = bufs.a2a(t, topo, scatter_dim=2, gather_dim=0)
    bufs.track("fpdt.a2a", g) if g is not t else None
    out = g.permute(1, 2, 0, 3).contiguous()
    bufs.untrack("fpdt.a2a", g) if g is not t else None
    bufs.track(tag, out)
    return out


def _from_attn(bufs: FPDTBuffers, topo, t: torch.Tensor, tag: str) -> torch.Tensor:
    """[b, H/P, c, d] -> [c, b, H/P, d] -> all-to-all -> [c_local, b, H, d] (counted under ``tag``)."""
    s = t.permute(2, 0, 1, 3).contiguous()
    bufs.track("fpdt.a2a", s)
    out = bufs.a2a(s, topo, scatter_dim=0, gather_dim=2)
    bufs.untrack("fpdt.a2a", s)
    bufs.track(tag, out)
    return out


def _stash(run: FPDTRun, key, t: torch.Tensor, from_tag: str) -> None:
    """Move ``t`` from ``from_tag`` into the store (host copy when offloading, else ``fpdt.saved``)."""
    run.bufs.untrack(from_tag, t)
    run.store.put(key, t)


def _retype(bufs: FPDTBuffers, t: torch.Tensor, dtype, old_tag: str, new_tag: str) -> torch.Tensor:
    """``t.to(dtype)`` with the accounting moved from ``old_tag`` (the source is dropped by the caller)."""
    bufs.untrack(old_tag, t)
    out = t.to(dtype)
    bufs.track(new_tag, out)
    return out


def _attend_chunk(run: FPDTRun, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Output (fp32) and lse of q chunk i against kv chunks 0..i; stores k^_i, v^_i. Frees k, v (device)."""
    bufs, store, be = run.bufs, run.store, run.backend
    c = q.shape[2]
    js = [j for j in range(i) if run.needed(i, j, c)]  # kv chunks before i that chunk i sees (all without masks)
    # the first of them is fetched during the diagonal block (a host copy: it waits on none of this chunk's compute)
    nxt = store.prefetch([("k", js[0]), ("v", js[0])], KV) if js else None
    rects = run.rects(i, i, c)  # diagonal: gathered chunk i = range i
    out, lse = be.forward(q, k, v, causal=True) if rects is None else be.forward_rects(q, k, v, rects)
    out = out.float()
    bufs.track("fpdt.acc", out, lse)
    _stash(run, ("k", i), k, "fpdt.chunk")
    _stash(run, ("v", i), v, "fpdt.chunk")
    del k, v
    for n, j in enumerate(js):  # kv chunks before i: full attention (global range j < i), or their rectangles
        cur, nxt = nxt, (store.prefetch([("k", js[n + 1]), ("v", js[n + 1])], KV) if n + 1 < len(js) else None)
        kj, vj = bufs.wait(cur)
        rects = run.rects(i, j, c)
        if rects is not None:  # merged in place into out, lse
            be.forward_rects(q, kj, vj, rects, acc=(out, lse))
            bufs.release(cur)
            del kj, vj, cur
            continue
        o, lse_j = be.forward(q, kj, vj, causal=False)
        bufs.track("fpdt.acc", o, lse_j)
        new_out, new_lse = merge(out, lse, o, lse_j)
        bufs.untrack("fpdt.acc", o, lse_j, out, lse)
        out, lse = new_out, new_lse
        bufs.track("fpdt.acc", out, lse)
        bufs.release(cur)
        del kj, vj, cur
    return out, lse


def fpdt_forward(run: FPDTRun, x: torch.Tensor, out: torch.Tensor) -> None:
    """Fill ``out [s_local, b, nq*d]`` (chunk-major rows: chunk i = rows [i*c_local, (i+1)*c_local))."""
    bufs, topo, u = run.bufs, run.topo, run.num_chunks
    run.store = ChunkStore(bufs, run.offload)
    run.projections = []
    x_chunks = x.chunk(u, dim=0)
    c_local = out.shape[0] // u
    input_ptr = storage_id(x)
    for i in range(u):
        hooks = ProjSavedHooks(bufs, run.offload, run.keep_ptrs, input_ptr, run.params) if run.build_graph else None
        q, k, v, proj = project_chunk(run.qkv_fn, x_chunks[i], run.rope_chunks[i], run.kv_repeat, run.build_graph,
                                      run.x_requires_grad, hooks)
        run.projections.append(proj)
        local = storage_bytes(q, k, v)
        bufs.account.acquire("fpdt.proj", local)
        run.dtype = q.dtype  # the gradients handed to the projection graph match q/k/v (autocast may differ from x)
        qh = _to_attn(bufs, topo, q, "fpdt.chunk")
        kh = _to_attn(bufs, topo, k, "fpdt.chunk")
        vh = _to_attn(bufs, topo, v, "fpdt.chunk")
        del q, k, v
        bufs.account.release("fpdt.proj", local)
        acc, lse = _attend_chunk(run, i, qh, kh, vh)
        del kh, vh
        o = _retype(bufs, acc, qh.dtype, "fpdt.acc", "fpdt.acc")
        del acc
        if run.build_graph:  # what the backward needs: q^, o^ (final), lse (final)
            _stash(run, ("q", i), qh, "fpdt.chunk")
            _stash(run, ("lse", i), lse, "fpdt.acc")
            o_local = _from_attn(bufs, topo, o, "fpdt.a2a")
            _stash(run, ("o", i), o, "fpdt.acc")
        else:
            bufs.untrack("fpdt.chunk", qh)
            bufs.untrack("fpdt.acc", lse)
            o_local = _from_attn(bufs, topo, o, "fpdt.a2a")
            bufs.untrack("fpdt.acc", o)
        del qh, lse, o
        out[i * c_local:(i + 1) * c_local] = o_local.flatten(2)
        bufs.untrack("fpdt.a2a", o_local)
        del o_local
    if not run.build_graph:
        run.store.clear()
        run.store = None


def fpdt_backward(run: FPDTRun, dout: torch.Tensor, x_shape, x_dtype) -> Optional[torch.Tensor]:
    """Gradient of the block input (``None`` if it needs none); projection weight grads accumulate via autograd."""
    bufs, topo, u, store, be = run.bufs, run.topo, run.num_chunks, run.store, run.backend
    c_local = dout.shape[0] // u
    for m in range(u):  # the output gradient, gathered per chunk like q, kept in the store
        g = dout[m * c_local:(m + 1) * c_local]
        gh = _to_attn(bufs, topo, g.reshape(c_local, g.shape[1], -1, run.head_dim), "fpdt.chunk")
        _stash(run, ("do", m), gh, "fpdt.chunk")
        del gh
    q_shape = _shape(store, ("q", 0), run.offload)
    for m in range(u):
        store.put_accumulator(("dq", m), q_shape, torch.float32)
    dx = torch.empty(x_shape, dtype=x_dtype, device=dout.device) if run.x_requires_grad else None
    x_rows = x_shape[0] // u
    kv_next = store.prefetch([("k", 0), ("v", 0)], KV)
    q_next = store.prefetch([(name, 0) for name in QNAMES], QSET)
    for j in range(u):
        kv_cur = kv_next
        kj, vj = bufs.wait(kv_cur)
        dk = bufs.zeros("fpdt.chunk", kj.shape, torch.float32)
        dv = bufs.zeros("fpdt.chunk", vj.shape, torch.float32)
        kv_next, dq_done = None, None
        c = kj.shape[2]
        ms = [j] + [m for m in range(j + 1, u) if run.needed(m, j, c)]  # q chunks that see kv chunk j
        for n, m in enumerate(ms):
            q_cur = q_next
            if n + 1 < len(ms):  # issued before this step's compute: double buffer of q chunks
                q_next = store.prefetch([(name, ms[n + 1]) for name in QNAMES], QSET)
            elif j + 1 < u:  # last inner step: fetch the next outer step's kv chunk
                kv_next = store.prefetch([("k", j + 1), ("v", j + 1)], KV)
            qm, om, dom, lsem, dqm = bufs.wait(q_cur)
            rects = run.rects(m, j, c)
            if rects is not None:  # added in place into the fp32 accumulators
                be.backward_rects(dom, qm, kj, vj, om, lsem, rects, grads=(dqm, dk, dv))
            else:
                gq, gk, gv = be.backward(dom, qm, kj, vj, om, lsem, causal=(m == j))
                bufs.track("fpdt.acc", gq, gk, gv)
                dqm.add_(gq)
                dk.add_(gk)
                dv.add_(gv)
                bufs.untrack("fpdt.acc", gq, gk, gv)
                del gq, gk, gv
            if m == j:  # q chunk j saw its last kv chunk: dq_j is final; q/o/do/lse of chunk j are not needed again
                dq_done = dqm
                store.drop(("q", j), ("o", j), ("do", j), ("lse", j), ("dq", j))
                if run.offload:
                    bufs.retag(q_cur, dqm, "fpdt.chunk")
                else:
                    bufs.track("fpdt.chunk", dqm)
            else:
                store.write_back(("dq", m), dqm)
            bufs.release(q_cur)
            del qm, om, dom, lsem, dqm, q_cur
        if j + 1 < u:  # the next outer step's first q chunk (its dq written back above): during chunk j's a2a back
            q_next = store.prefetch([(name, j + 1) for name in QNAMES], QSET)
        bufs.release(kv_cur)
        store.drop(("k", j), ("v", j))
        del kj, vj, kv_cur
        # chunk j complete: back to the local layout, then its projection backward
        grads = []
        for acc in (dq_done, dk, dv):
            t = _retype(bufs, acc, run.dtype, "fpdt.chunk", "fpdt.a2a")
            grads.append(_from_attn(bufs, topo, t, "fpdt.grad_local"))
            bufs.untrack("fpdt.a2a", t)
            del t
        del dq_done, dk, dv, acc
        gx = run.projections[j].backward(*grads)
        bufs.untrack("fpdt.grad_local", *grads)
        del grads
        if dx is not None:
            dx[j * x_rows:(j + 1) * x_rows] = gx
        run.projections[j] = None
    run.store = None
    return dx


def _shape(store: ChunkStore, key, offload: bool):
    item = store.items[key]
    return item.host.shape if offload else item.shape

"""Autocast on the stand-in device with CUDA's rules. PyTorch registers its autocast kernels per device (CUDA's in
``aten/src/ATen/autocast_mode.{h,cpp}``); a PrivateUse1 backend gets none, so these are CUDA's, in Python, at the
``AutocastPrivateUse1`` dispatch key -- the same op lists and the same four policies:

    lower_precision_fp   matmuls, linear, convolutions, flash attention: eligible inputs cast to the autocast dtype
    fp32                 exp, log, pow, rsqrt, norms, losses: eligible inputs cast to float32
    fp32_set_opt_dtype   sum, softmax, log_softmax, cumsum, prod, vector norms: ``dtype=float32`` when not given
    promote              addcmul, addcdiv, dot, index_put, scatter_add...: inputs cast to the widest eligible dtype

An input is eligible when it is a floating tensor on the stand-in device, not float64. Every other op runs in its
inputs' dtype (a fallthrough). As on CUDA, the lower-precision cast of a float32 leaf that requires grad (a weight)
is cached until the outermost autocast region exits (``torch.autocast.__exit__`` clears the cache through
``torch.clear_autocast_cache``, which ``install_autocast`` extends to this cache). Example, under
``torch.autocast("standin", dtype=torch.bfloat16)``: ``x @ w`` with float32 ``x`` and ``w`` is bfloat16,
``y.sum()`` of a bfloat16 ``y`` is float32, ``y + x`` is float32 (type promotion, no autocast kernel).

``tests/rehearsal/test_standin.py`` checks these lists against the kernels this PyTorch registers for CUDA.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

DEVICE = "standin"  # the stand-in's device type (standin.NAME; here too, so that this module imports nothing)

LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "cudnn_convolution",
    "cudnn_convolution_transpose")
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "rms_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa")
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
FP32_APPEND_DTYPE = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype"}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")
BANNED = ("binary_cross_entropy",)  # unsafe under autocast (CUDA raises; so does the stand-in)

_KEY = torch._C.DispatchKey.AutocastPrivateUse1
_CACHE: dict = {}  # id(weight) -> (weight, its lower-precision cast), until the outermost autocast region exits
_LIBRARIES: list = []  # the registrations live as long as these objects


def _eligible(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == DEVICE and t.is_floating_point()
            and t.dtype != torch.float64)


def _cast(t, dtype: torch.dtype):
    """``t`` in ``dtype`` when eligible (autocast's ``cached_cast``); anything else as it is."""
    if not _eligible(t) or t.dtype == dtype:
        return t
    cacheable = (dtype == torch.get_autocast_dtype(DEVICE) and t.dtype == torch.float32 and t.requires_grad
                 and t.is_leaf and not t._is_view() and torch.is_autocast_cache_enabled())
    if not cacheable:
        return t.to(dtype)
    hit = _CACHE.get(id(t))
    if hit is None or hit[0] is not t:
        hit = _CACHE[id(t)] = (t, t.to(dtype))
    return hit[1]


def _below_autocast(op, args, kwargs):
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
        return op(*args, **kwargs)


def _cast_all(args, kwargs, dtype):
    return tree_map(lambda a: _cast(a, dtype), (args, kwargs))


def _lower(op):
    def kernel(*args, **kwargs):
        return _below_autocast(op, *_cast_all(args, kwargs, torch.get_autocast_dtype(DEVICE)))
    return kernel


def _fp32(op):
    def kernel(*args, **kwargs):
        return _below_autocast(op, *_cast_all(args, kwargs, torch.float32))
    return kernel


def _set_opt_dtype(op):
    names = [a.name for a in op._schema.arguments]
    at = names.index("dtype")

    def kernel(*args, **kwargs):
        if args and _eligible(args[0]):
            if at < len(args):
                if args[at] is None:
                    args = (*args[:at], torch.float32, *args[at + 1:])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        return _below_autocast(op, args, kwargs)
    return kernel


def _append_dtype(op, with_dtype):
    def kernel(*args, **kwargs):
        if args and _eligible(args[0]):
            return _below_autocast(with_dtype, args, {**kwargs, "dtype": torch.float32})
        return _below_autocast(op, args, kwargs)
    return kernel


def _promote(op):
    def kernel(*args, **kwargs):
        to = torch.get_autocast_dtype(DEVICE)
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if _eligible(a) and a.dtype == torch.float32:
                to = torch.float32
        return _below_autocast(op, *_cast_all(args, kwargs, to))
    return kernel


def _banned(name):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"torch.nn.functional.{name} is unsafe to autocast (as on CUDA): use "
                           f"binary_cross_entropy_with_logits")
    return kernel


def overload(name: str):
    """``"sum.dim_IntList"`` -> ``torch.ops.aten.sum.dim_IntList``; ``"sum"`` -> its default overload."""
    base, _, over = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), over or "default")


def policies() -> dict:
    """{op name as the dispatcher lists it (``aten::sum.dim_IntList``): policy}."""
    out = {}
    for policy, names in (("lower_precision_fp", LOWER_PRECISION_FP), ("fp32", FP32),
                          ("fp32_set_opt_dtype", FP32_SET_OPT_DTYPE), ("fp32_append_dtype", FP32_APPEND_DTYPE),
                          ("promote", PROMOTE), ("banned", BANNED)):
        out.update({f"aten::{n}": policy for n in names})
    return out


def install_autocast() -> None:
    """Register the kernels at ``AutocastPrivateUse1`` (a fallthrough for every other op) and extend
    ``torch.clear_autocast_cache`` to the weight-cast cache. Once per process (``standin.install``)."""
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")
    makers = {"lower_precision_fp": _lower, "fp32": _fp32, "fp32_set_opt_dtype": _set_opt_dtype, "promote": _promote}
    for name, policy in policies().items():
        short = name.removeprefix("aten::")
        if policy == "banned":
            kernel = _banned(short)
        elif policy == "fp32_append_dtype":
            kernel = _append_dtype(overload(short), getattr(torch.ops.aten.norm, FP32_APPEND_DTYPE[short]))
        else:
            kernel = makers[policy](overload(short))
        lib.impl(short, kernel, "AutocastPrivateUse1")
    _LIBRARIES.extend([everything, lib])
    clear = torch.clear_autocast_cache

    def clear_both() -> None:
        _CACHE.clear()
        clear()

    torch.clear_autocast_cache = clear_both

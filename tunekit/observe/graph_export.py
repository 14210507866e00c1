"""Graph capture with ``torch.export``, for models ``torch.fx`` cannot trace.

Hugging Face ``transformers`` models (GPT-2, BERT, Llama ...) defeat
``torch.fx.symbolic_trace`` (``co_varnames is too small``, data-dependent mask
code); ``torch.export`` traces them at the ATen level instead. Three things
make that graph the one a tuner needs:

* **training mode.** The model is exported as it trains: dropout is in the
  graph, and inference fast paths (native multi-head attention, fused
  kernels chosen only under ``eval()``) cannot hide FLOPs.
* **attention written out.** ``scaled_dot_product_attention`` is one ATen op
  whose CPU kernel ``FlopCounterMode`` does not count, and which hides the
  score and value matmuls a cost model splits. It is decomposed into its
  math (scores matmul, mask, softmax, dropout, value matmul) before counting.
* **readable names.** Nodes are renamed after the module that ran them
  (``transformer_h_0_attn_matmul``), so layers say which block, attention or
  MLP they belong to.

The result is a ``torch.fx.GraphModule`` (parameters as ``get_attr``) that
:func:`nodes_from_module` turns into :class:`~tunekit.observe.graph.GraphNode`
s, and that the layer profiler can run node by node.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

WRAPPER_PREFIX = "model."
"""Where the model sits inside :class:`_TensorOutputs` (stripped from node names)."""


class _TensorOutputs(nn.Module):
    """The model with its outputs flattened to a list of tensors: ``torch.export`` refuses
    outputs it cannot flatten (``transformers``' ``DynamicCache``), and the graph only needs
    the tensors."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        from tunekit.observe.graph import _tensors

        return _tensors(self.model(*args))


def _sdpa_math(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``scaled_dot_product_attention`` as the math it does (PyTorch's reference formula)."""
    q_len, k_len = query.size(-2), key.size(-2)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa:  # grouped-query attention: each key/value head serves several query heads
        rep = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = torch.dropout(probs, dropout_p, True)
    return torch.matmul(probs, value)


def _restride(out: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``out``'s values laid out with ``stride`` (a dense layout: a permutation of dims)."""
    if tuple(out.stride()) == tuple(stride):
        return out
    order = sorted(range(out.dim()), key=lambda d: (-stride[d], d))  # outermost dim first
    back = sorted(range(out.dim()), key=order.__getitem__)
    return out.permute(order).contiguous().permute(back)


def _sdpa_as_exported(ep: torch.export.ExportedProgram):
    """:func:`_sdpa_math` with its output laid out as the exported op's was.

    The export recorded attention's output with the strides of the fused kernel's
    (CPU flash attention: ``(B, T, H, D)`` memory seen as ``(B, H, T, D)``), and
    dropped the model's ``.transpose(1, 2).contiguous()`` as a no-op on that layout;
    the matmuls' contiguous output would break the ``.view(B, T, C)`` that follows
    (nanoGPT's attention). The recorded layout is looked up by the call's query, key
    and value layouts (what decides it); a call not recorded keeps the matmuls' layout.
    """
    target = torch.ops.aten.scaled_dot_product_attention.default
    layouts: dict[tuple, tuple[int, ...]] = {}
    for n in ep.graph.nodes:
        if n.op == "call_function" and n.target is target and "val" in n.meta:
            qkv = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in n.args[:3]]
            layouts[_layout_key(*qkv)] = tuple(n.meta["val"].stride())

    def decompose(query, key, value, *args, **kwargs):
        out = _sdpa_math(query, key, value, *args, **kwargs)
        stride = layouts.get(_layout_key(query, key, value))
        return out if stride is None else _restride(out, stride)

    return decompose


def _layout_key(*tensors: Any) -> tuple:
    return tuple(
        (tuple(t.shape), tuple(t.stride())) if isinstance(t, torch.Tensor) else None
        for t in tensors
    )


def export_module(model: nn.Module, args: tuple) -> torch.fx.GraphModule:
    """``model`` (in its current mode) exported to an ATen-level GraphModule, attention
    decomposed and nodes named after their modules. Raises whatever ``torch.export`` raises.
    ``args``: the model's positional arguments (tunekit passes the batch's inputs as one)."""
    ep = torch.export.export(_TensorOutputs(model), args, strict=False)
    aten = torch.ops.aten
    ep = ep.run_decompositions({aten.scaled_dot_product_attention.default: _sdpa_as_exported(ep)})
    gm = ep.module()
    _rename(gm)
    return gm


def _rename(gm: torch.fx.GraphModule) -> None:
    """``linear_3`` -> ``transformer_h_0_attn_c_attn_linear``: the innermost module path."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        stack = n.meta.get("nn_module_stack") or {}
        if not stack:
            continue
        path = list(stack.values())[-1][0]
        path = path.removeprefix(WRAPPER_PREFIX) if path != WRAPPER_PREFIX.rstrip(".") else ""
        base = op_name(n.target)
        if path:
            n._rename(f"{path}.{base}".replace(".", "_"))  # fx makes the name unique
    gm.recompile()


def op_name(target: Any) -> str:
    """``aten.linear.default`` -> ``linear``; other callables by their ``__name__``."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def module_of(node: torch.fx.Node) -> tuple[str, str] | None:
    """(path, class name) of the innermost module that ran ``node``, wrapper stripped."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    if not path.startswith(WRAPPER_PREFIX):
        return None
    cls_name = cls.rsplit(".", 1)[-1] if isinstance(cls, str) else getattr(cls, "__name__", "")
    return path.removeprefix(WRAPPER_PREFIX), cls_name


def flat_inputs(args: tuple) -> list[Any]:
    """The exported module's placeholders take the pytree leaves of its arguments."""
    return pytree.tree_leaves((args, {}))

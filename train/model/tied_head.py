"""A tied LM head's weight gradient, deferred to the input embedding's backward.

When the LM head shares its weight with the input embedding (Qwen3 up to 4B, Llama 3.2, SmolLM2),
the head's ``[vocab, hidden]`` weight gradient is made by the backward's first op and the
embedding's by its last. Autograd sums the two before the weight's gradient hook runs, so the
head's dense gradient is held through the whole backward, on top of every recomputed layer (ZeRO-3
cannot reduce it early either: the hook fires once, with the sum). For a 151,936-row vocabulary and
hidden 512 that is 297 MiB in fp32 at the step's peak.

Here the head's cross-entropy (:class:`HeadCrossEntropy`) returns no weight gradient. Its backward
keeps what that gradient is made of, the target rows' hidden states with their logits' gradient
(or, for more than H / 2 rows, what recomputes them), and the embedding's backward
(:func:`defer_into_embedding`) adds it into the one dense gradient it builds anyway. The weight
gradient is the same; it exists only at the end.

Kept logit gradients are made in the forward, where the weight is whole, and so is the hidden
states' gradient (``dlogits @ weight``, [n, H]; both are linear in the backward's scalar ``g``):
under ZeRO-3 the head's backward then gathers nothing. Only recomputing needs the weight again.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from longsft.train.common.compat import full_shape, zero3_gathered
from longsft.train.parallel import comm


class Deferred:
    """The head's share of the tied weight's gradient, left by its backward for the embedding's.

    Each part is ``(hidden [c, H], dlogits [c, V])``, or ``(hidden, targets [c], lse [c], g)`` to be
    recomputed (one more head matmul): see :func:`keeps_dlogits`.
    """

    def __init__(self):
        self.parts: list[tuple] = []
        self.recompute = False  # the parts are recomputed (the embedding's backward gathers the weight)
        self.hold = False  # a weight ZeRO-3 holds whole stays so through the backward (see loss.hold_whole_weight)

    def dense(self, shape: torch.Size, dtype: torch.dtype, weight: torch.Tensor) -> torch.Tensor:
        """``Σ dlogitsᵀ @ hidden`` over every part as a new ``[V, H]`` tensor (written by the first
        product, not zero-filled first), then forget them. weight [V, H]."""
        grad_w = None
        for part in self.parts:
            h, dlogits = (part[0], part[1]) if len(part) == 2 else (part[0], _dlogits(part[0], weight, *part[1:]))
            dlogits, h = dlogits.t().to(dtype), h.to(dtype)
            grad_w = dlogits @ h if grad_w is None else grad_w.addmm_(dlogits, h)
        self.parts.clear()
        self.recompute = False
        return torch.zeros(shape, dtype=dtype, device=weight.device) if grad_w is None else grad_w

def keeps_dlogits(rows: int, hidden: int) -> bool:
    """Whether the head's ``[rows, V]`` logit gradients are kept (made in the forward, as the plain path
    keeps its logits, and waiting for the embedding's backward) rather than recomputed twice: while
    they are at most half the ``[V, H]`` gradient they stand for (LongNovel's 64-token answers)."""
    return 2 * rows <= hidden


def _gathered(weight: torch.Tensor, keep: bool = False):
    """``weight`` whole within the block and partitioned again after it, under ZeRO-3: the head gathers
    its weight for its own forward and backward, and does not hold it through the decoder layers'
    backward, as a module's external parameter would be; the embedding's backward gathers it again.
    ``keep``: a weight already whole (kept for reuse) stays so. Every rank must enter (a collective).
    Without ZeRO-3: nothing."""
    if not hasattr(weight, "ds_id") or (keep and zero3_gathered(weight)):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([weight])


def _released(weight: torch.Tensor):
    """``weight`` partitioned after the block if ZeRO-3 holds it whole on this rank (as it may since the
    model's forward), as leaving :func:`_gathered` would: it is not held through the decoder layers'
    backward. Nothing is gathered (a whole weight's gather is a no-op, and partitioning is local), so
    ranks need not agree."""
    if not hasattr(weight, "ds_id") or not zero3_gathered(weight):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([weight])


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (h @ weight.t()).float()  # [c, V] fp32, as the model's head followed by .float()


def _softmax_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """d(sum CE)/d logits: softmax minus one-hot. [c, V] fp32 (in place of ``logits``)."""
    p = logits.sub_(lse[:, None]).exp_()
    p[torch.arange(len(targets), device=p.device), targets] -= 1
    return p


def _dlogits(h, weight, targets, lse, g) -> torch.Tensor:
    """The logit gradients recomputed, times ``g``, in the weight's dtype. [c, V]"""
    return (_softmax_grad(_logits(h, weight), targets, lse) * g).to(weight.dtype)


class HeadCrossEntropy(torch.autograd.Function):
    """sum CE(hidden @ weightᵀ, targets), ``chunk`` rows at a time; hidden [n, H], weight [V, H], targets [n].

    Returns a 0-dim fp32 sum. The backward gives the hidden states their gradient and the weight
    none: its share goes to ``deferred``, for the tied embedding's backward to add.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, deferred: Deferred, most: int | None = None):
        deferred.parts.clear()  # a backward that never reached the embedding (an error) left these
        n = hidden.shape[0]
        # one choice on every rank under ZeRO-3: it decides whether the backwards gather the weight (a
        # collective); ``most``: the most rows of any rank, when the micro-step already asked
        rows = n
        if hasattr(weight, "ds_id"):
            rows = comm.max_over_ranks(n) if most is None else most
        keep = keeps_dlogits(rows, hidden.shape[1])
        deferred.recompute = not keep
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        grads, grad_h = [], []  # kept: each chunk's softmax gradient [c, V] and its hidden gradient [c, H]
        with _gathered(weight, keep=True):
            for i in range(0, n, chunk):
                logits, t = _logits(hidden[i:i + chunk], weight), targets[i:i + chunk]
                lse[i:i + chunk] = torch.logsumexp(logits, -1)
                total += (lse[i:i + chunk] - logits.gather(1, t[:, None]).squeeze(1)).sum()
                if keep:  # both gradients made while the weight is whole: the backward need not gather it
                    grads.append(_softmax_grad(logits, t, lse[i:i + chunk]).to(weight.dtype))
                    grad_h.append(grads[-1] @ weight)
        # the weight is a parameter, whole or not as ZeRO-3 has it: held, not saved (saved-tensor hooks such
        # as model.offload_activations' would copy it, partitioned or whole)
        ctx.save_for_backward(hidden, targets, lse)
        ctx.weight, ctx.chunk, ctx.deferred, ctx.keep = weight, chunk, deferred, keep
        ctx.grads, ctx.grad_h = grads, grad_h
        return total

    @staticmethod
    def backward(ctx, g):
        (hidden, targets, lse), weight = ctx.saved_tensors, ctx.weight
        grad_h = torch.empty_like(hidden)
        # kept: everything is linear in g; recomputed: the weight is gathered again. Either way it is
        # partitioned after (the decoder layers' backward does not need it), unless it is held
        with (contextlib.nullcontext() if ctx.deferred.hold else _released(weight)) if ctx.keep else _gathered(weight):
            for k, i in enumerate(range(0, hidden.shape[0], ctx.chunk)):
                h, t, s = hidden[i:i + ctx.chunk], targets[i:i + ctx.chunk], lse[i:i + ctx.chunk]
                if ctx.keep:
                    grad_h[i:i + ctx.chunk] = ctx.grad_h[k] * g
                    ctx.deferred.parts.append((h, ctx.grads[k].mul_(g.to(weight.dtype))))
                else:
                    grad_h[i:i + ctx.chunk] = _dlogits(h, weight, t, s, g) @ weight
                    ctx.deferred.parts.append((h, t, s, g))
        ctx.grads, ctx.grad_h, ctx.weight = [], [], None
        return grad_h, None, None, None, None, None


class _Embedding(torch.autograd.Function):
    """``F.embedding`` whose weight gradient also takes the tied head's deferred share."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, deferred: Deferred):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx, ctx.deferred = weight, padding_idx, deferred  # held, as in HeadCrossEntropy
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, g):  # g [..., H]
        (ids,), weight = ctx.saved_tensors, ctx.weight
        g = g.reshape(-1, weight.shape[1])
        if ctx.padding_idx is not None:  # the padding row gets no gradient from the lookup (the head's it does)
            g = g.masked_fill((ids.reshape(-1) == ctx.padding_idx)[:, None], 0)
        # the weight's values are needed only to recompute dlogits (ZeRO-3 does not gather a lookup's
        # weight for its backward, nor need it: the gradient has its full shape whatever the weight's now)
        with _gathered(weight, keep=True) if ctx.deferred.recompute else contextlib.nullcontext():
            grad_w = ctx.deferred.dense(full_shape(weight), g.dtype, weight)
        ctx.weight = None
        return None, _add_rows(grad_w, ids.reshape(-1), g), None, None


def _add_rows(grad_w: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``grad_w[ids[i]] += g[i]``, each row's copies summed in fp32 and rounded once. A half-precision
    ``index_add_`` with repeated ids adds them one atomic at a time on CUDA, rounding after each (a token
    seen thousands of times in a long prompt stops accumulating); PyTorch's own embedding backward sorts
    and sums in fp32 too. grad_w [V, H]; ids [n]; g [n, H]."""
    if grad_w.dtype == torch.float32:
        return grad_w.index_add_(0, ids, g)
    rows, where = ids.unique(return_inverse=True)
    summed = torch.zeros(rows.numel(), g.shape[1], dtype=torch.float32, device=g.device).index_add_(0, where, g.float())
    return grad_w.index_add_(0, rows, summed.to(grad_w.dtype))


def deferrable(model) -> bool:
    """The head shares the embedding's weight and the embedding is a plain lookup (no scaling
    subclass, max_norm or frequency scaling) that :func:`defer_into_embedding` can take over."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    return (head is not None and type(emb) is torch.nn.Embedding and head.weight is emb.weight
            and emb.max_norm is None and not emb.scale_grad_by_freq and not emb.sparse)


def defer_into_embedding(model, deferred: Deferred) -> None:
    """Make the input embedding's backward add ``deferred`` into its weight gradient. Only the
    instance's forward changes (no wrapper module: parameter names and checkpoints stay)."""
    emb = model.get_input_embeddings()

    def forward(ids: torch.Tensor) -> torch.Tensor:  # ids [batch, seq] -> [batch, seq, hidden]
        return _Embedding.apply(ids, emb.weight, emb.padding_idx, deferred)

    emb.forward = forward

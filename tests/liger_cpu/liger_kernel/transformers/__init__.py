"""``LigerFusedLinearCrossEntropyLoss`` (liger-kernel 0.8.x signature) in plain PyTorch, for CPU tests."""

import torch


def cdiv(x: int, y: int) -> int:
    """triton.cdiv."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 (0 for 0)."""
    n -= 1
    for shift in (1, 2, 4, 8, 16, 32):
        n |= n >> shift
    return n + 1


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, reduction, accum_dtype):
        # x [BT, H], weight [V, H], target [BT]
        bt, h = x.shape
        v = weight.shape[0]
        chunk = min(next_power_of_2(cdiv(bt, cdiv(v, h))), bt)
        num_chunks = cdiv(bt, chunk)  # ZeroDivisionError for bt == 0, as in liger's host code
        n_valid = int((target != ignore_index).sum())
        grad_x = torch.zeros_like(x)
        grad_w = torch.zeros(weight.shape, dtype=accum_dtype or weight.dtype) if weight.requires_grad else None
        losses = torch.zeros(bt, dtype=torch.float32)
        for c in range(num_chunks):
            s, e = c * chunk, min((c + 1) * chunk, bt)
            xs, t = x[s:e], target[s:e]
            logits = (xs @ weight.T).float()  # [chunk, V]
            valid = t != ignore_index
            rows = torch.arange(e - s)
            lse = torch.logsumexp(logits, -1)
            losses[s:e] = torch.where(valid, lse - logits[rows, t.clamp_min(0)], 0.0)
            dlogits = torch.softmax(logits, -1)
            dlogits[rows, t.clamp_min(0)] -= 1.0
            dlogits = torch.where(valid[:, None], dlogits, 0.0)
            if reduction == "mean":
                dlogits = dlogits / max(1, n_valid)
            dlogits = dlogits.to(x.dtype)
            grad_x[s:e] = dlogits @ weight
            if grad_w is not None:
                grad_w += (dlogits.T @ xs).float()  # rounded to accum_dtype after every chunk
        loss = losses.sum() / (max(1, n_valid) if reduction == "mean" else 1)
        ctx.save_for_backward(grad_x, None if grad_w is None else grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_output, None if grad_w is None else grad_w * grad_output, None, None, None, None


class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):
    def __init__(self, ce_weight=None, ignore_index: int = -100, lse_square_scale: float = 0.0,
                 label_smoothing: float = 0.0, reduction: str = "mean", softcap=None, return_z_loss: bool = False,
                 accum_dtype=None, **unsupported):
        super().__init__()
        assert ce_weight is None and not lse_square_scale and not label_smoothing and softcap is None
        assert not return_z_loss and not any(unsupported.values()), "not in the CPU stand-in"
        assert reduction in ("mean", "sum")
        self.ignore_index, self.reduction, self.accum_dtype = ignore_index, reduction, accum_dtype

    def forward(self, lin_weight, _input, target, bias=None):
        assert bias is None
        return _FusedLinearCrossEntropy.apply(_input, lin_weight, target, self.ignore_index, self.reduction,
                                              self.accum_dtype)

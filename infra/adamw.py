"""AdamW whose CPU step gives the same bits on every x86-64 CPU (DESIGN.md section 9).

torch's CPU square root of a float tensor is MKL's vector math (vsSqrt, vdSqrt), and MKL computes
it differently on each CPU, even with MKL_CBWR=COMPATIBLE pinned (infra/numerics.py): an AMD EPYC,
an Intel CPU and an emulated one give three different results, none of them the correctly rounded
root (RESULTS.md "Pinned numerics"; `python -m perf.probe` shows it). Every other kernel a world
build or a CPU run uses gives the same bits on every CPU once pinned. AdamW's denominator sqrt(v_t)
is the one place the training of a policy meets it, so the world builder and the CPU trainer step
with this class: torch's single-tensor AdamW, operation for operation, but with the square root
taken by the hardware's IEEE instruction (numpy's), which is correctly rounded on every x86 CPU.

Its state is torch's (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints load in either class. On a
GPU, or with options this path does not take (amsgrad, maximize, complex weights), it is torch's
AdamW unchanged. It knows nothing of models or runs.
"""
import numpy as np
import torch


def exact_sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a CPU float tensor, as a new tensor (numpy's sqrt is
    the hardware's IEEE square root: the same bits on every CPU; torch's goes to MKL)."""
    return torch.from_numpy(np.sqrt(t.detach().contiguous().numpy()))


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW; on the CPU its step takes the square root of v_t with exact_sqrt."""

    def _exact(self) -> bool:
        params = [p for group in self.param_groups for p in group["params"]]
        plain = all(not (g["amsgrad"] or g["maximize"] or g.get("differentiable") or
                         g.get("capturable")) for g in self.param_groups)
        return plain and all(p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64)
                             for p in params)

    @torch.no_grad()
    def step(self, closure=None):
        if not self._exact():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group)
        return loss

    def _step_one(self, p, group):
        """torch's _single_tensor_adam with decoupled weight decay, the sqrt replaced."""
        beta1, beta2 = group["betas"]
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        state = self.state[p]
        if not state:  # as torch's _init_group
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        exp_avg, exp_avg_sq, grad = state["exp_avg"], state["exp_avg_sq"], p.grad
        state["step"] += 1
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = state["step"].item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = (exact_sqrt(exp_avg_sq) / bias_correction2**0.5).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-step_size)

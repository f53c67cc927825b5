"""Where the weights are (DESIGN.md section 10, memory): the copy episodes are sampled from, the
reference moved onto the device for its pass only, and the checks of the trained weights (norm, and
agreement over ranks). Pure torch: it knows no config, run or method.
"""
import contextlib
import copy

import torch


def sampling_copy(model, dtype=None):
    """The model to sample episodes from: `model` itself when its weights are already in dtype
    (DeepSpeed's bf16 module, or any run without bf16), else a copy with the weights cast to dtype
    (fp32 master weights under bf16 autocast), tied weights still tied and the class's own forward
    (not accelerate's autocast wrapper). Sampling from it instead of under autocast keeps the KV
    caches in bf16 (RoPE under autocast gives fp32 keys over an fp32 residual stream) and holds no
    autocast copy of the weights while the caches grow; freed when the step drops it."""
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    if dtype is None or all(p.dtype == dtype for p in params) or frozen and all(p.dtype == dtype
                                                                                for p in frozen):
        # LoRA: a base already in dtype, its float32 adapters cast by peft's layers (no copy)
        return model
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in params}
    clone = copy.deepcopy(model, memo)
    clone.__dict__.pop("forward", None)  # accelerate's autocast wrapper, bound to the original
    clone.__dict__.pop("_original_forward", None)
    return clone.eval()


@contextlib.contextmanager
def on_device(model, device):
    """model's parameters and buffers on `device` inside the block, back on their own device after
    it (the reference kept in host memory, ref_offload): the host copies are kept, so nothing is
    copied back."""
    params = [
        p for p in [*model.parameters(), *model.buffers()] if p.device != torch.device(device)
    ]
    held = [p.data for p in params]
    for p in params:
        p.data = p.data.to(device, non_blocking=True)
    try:
        yield model
    finally:
        for p, data in zip(params, held):
            p.data = data


def weight_norm(accel, model) -> float:
    """Norm of the trained weights (LoRA: the adapters'), float32 norms per tensor: no float64 copy
    of the weights."""
    norms = [
        torch.linalg.vector_norm(p.detach(), dtype=torch.float32)
        for p in accel.unwrap_model(model).parameters() if p.requires_grad
    ]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def weights_spread(accel, model) -> float:
    """Max minus min over ranks of a float64 weight checksum: 0 when all ranks hold the same
    weights."""
    s = sum(p.detach().double().sum() for p in accel.unwrap_model(model).parameters())
    all_s = accel.gather(s.reshape(1).to(accel.device))
    return float(all_s.max() - all_s.min())

"""The pinned numerics' probe: digests of the world build's kernels in miniature, to compare two
machines (or emulated CPUs) in seconds where a world build takes minutes (RESULTS.md "Pinned
numerics"). It imports infra/numerics.py first, so it runs pinned like a build. Every digest but
vml_sqrt (torch's CPU square root: MKL's, which differs from CPU to CPU; the build does not use it,
infra/adamw.py) must be the same on every x86-64 CPU with AVX2.

  python -m perf.probe     # the pins, what is in force, the digests, any problem (exit status 1)
"""
from infra import numerics  # noqa: F401  first: pins the CPU math libraries before numpy, torch

import argparse
import hashlib
import json

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from infra import adamw
from retrieval.dense import Encoder


def probe() -> dict:
    """sha256 (12 hex) of the world build's kernels in miniature: the MiniLM encoder on six
    passages; a 2-layer Qwen2 from a fixed seed: its first forward pass, its first clipped
    gradients, its weights after three AdamW steps; and torch's sqrt and exp of a float tensor
    (MKL's vector math). Two machines that print the same digests computed the same bits here
    (seconds, where a world build takes minutes; RESULTS.md runs it under emulated CPUs)."""
    texts = [
        '"Zorvak"\nZorvak was born in Klelon. He works for Dastocorp.',
        '"Klelon"\nKlelon is a city in Vostria.', "Where was Zorvak born?"
    ] * 2
    vectors = Encoder("minilm", None, None, 256, "cpu", 256, False).encode(
        texts, "passage")
    torch.manual_seed(0)
    h, vocab, batch, length = 32, 300, 4, 96
    model = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=vocab, hidden_size=h, intermediate_size=3 * h, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                    tie_word_embeddings=True, initializer_range=0.1))
    # the build's optimizer
    opt = adamw.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    ids = torch.randint(0, vocab, (batch, length))
    stages = {"encoder": vectors}
    for step in range(3):
        # (B, T - 1, V)
        logits = model.model(input_ids=ids)[0][:, :-1] @ model.get_input_embeddings().weight.T
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                          ids[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step == 0:  # the forward pass, and the clipped gradients the first AdamW step reads
            stages["forward"] = logits.detach().numpy()
            stages["grads"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
        opt.step(), opt.zero_grad()
    stages["policy"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    # torch's sqrt and exp of a float tensor: MKL's vector math on a CPU
    x = torch.linspace(1e-3, 10.0, 4096)
    stages["vml_sqrt"], stages["vml_exp"] = x.sqrt().numpy(), (-x).exp().numpy()
    stages["exact_sqrt"] = adamw.exact_sqrt(x).numpy()  # what the build's AdamW uses instead
    stages.update({f"op_{name}": out.numpy() for name, out in kernels().items()})
    return {
        name: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:12]
        for name, a in stages.items()
    }


def kernels() -> dict:
    """The other CPU kernels a world build and a training step use, each on fixed inputs: every
    one gave the same bits on every CPU tried (RESULTS.md "Pinned numerics"), torch's sqrt alone
    did not."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    x, s = torch.rand(4099, generator=g) * 10 + 1e-3, torch.randn(4099, generator=g) * 3
    a, b = torch.randn(64, 96, generator=g), torch.randn(96, 80, generator=g)
    return {"exp": (-x).exp(), "log": x.log(), "tanh": s.tanh(), "sigmoid": s.sigmoid(),
            "erf": s.erf(), "silu": F.silu(s), "gelu": F.gelu(s), "rsqrt": x.rsqrt(),
            "pow": x.pow(-0.5), "softmax": a.softmax(-1), "log_softmax": a.log_softmax(-1),
            "matmul": a @ b, "var": a.var(-1), "norm": torch.linalg.vector_norm(a, dim=-1),
            "layer_norm": F.layer_norm(a, (96,)),
            "cross_entropy": F.cross_entropy(a, torch.arange(64)),
            "exp64": (-x).double().exp(), "log64": x.double().log()}


def main(argv=None) -> int:
    argparse.ArgumentParser(
        prog="python -m perf.probe", description="Print the pins, what is in force, "
        "the probe's digests and any problem (exit status 1).").parse_args(argv)
    print(
        json.dumps({"pins": numerics.PINS, "in_force": numerics.state(), "probe": probe()},
                   indent=1))
    issues = numerics.problems()
    print("\n".join(["problems:"] + [f"  - {p}"
                                     for p in issues]) if issues else "pinned: no problem")
    return 1 if issues else 0


if __name__ == "__main__":
    raise SystemExit(main())

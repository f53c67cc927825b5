"""infra/adamw.py: AdamW whose CPU step takes the square root exactly. It must be torch's AdamW step for step but for
that root, its root must be the correctly rounded one, and its state must be torch's."""
import numpy as np
import pytest
import torch

from infra import adamw


def test_exact_sqrt_is_correctly_rounded():
    """float32: the root in float64 rounded once to float32 is correctly rounded (53 >= 2 x 24 + 2 bits)."""
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 1e3
    want = torch.from_numpy(np.sqrt(x.numpy().astype(np.float64)).astype(np.float32))
    assert torch.equal(adamw.exact_sqrt(x), want)
    # float64, in exact rational arithmetic: no neighbour of the root is closer to it than the root itself
    from fractions import Fraction
    x64 = x[:300].double()
    roots = adamw.exact_sqrt(x64)
    assert roots.dtype == torch.float64
    for v, r in zip(x64.tolist(), roots.tolist()):
        err = [abs(Fraction(c) ** 2 - Fraction(v)) for c in (np.nextafter(r, 0), r, np.nextafter(r, np.inf))]
        assert err[1] <= err[0] and err[1] <= err[2]


def model_and_batches(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(5)]
    return model, batches


def train(opt_cls, steps=5, **kw):
    model, batches = model_and_batches()
    opt = opt_cls(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    for x, y in batches[:steps]:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_step_is_torchs_with_the_exact_root(monkeypatch):
    """With torch's Tensor.sqrt replaced by the exact root, torch's own AdamW (single-tensor path) gives the same bits."""
    ours, _ = train(adamw.AdamW)
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda t: adamw.exact_sqrt(t))
    theirs, _ = train(torch.optim.AdamW, foreach=False)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_its_state_is_torchs_and_a_resume_continues_exactly():
    whole, _ = train(adamw.AdamW, steps=5)
    part, opt = train(adamw.AdamW, steps=3)
    state = opt.state_dict()
    plain = torch.optim.AdamW(part.parameters(), lr=1e-2, weight_decay=0.1)
    plain.load_state_dict(state)  # loads in torch's class: the same keys and shapes
    again = adamw.AdamW(part.parameters(), lr=1e-2, weight_decay=0.1)
    again.load_state_dict(plain.state_dict())
    _, batches = model_and_batches()
    for x, y in batches[3:]:
        torch.nn.functional.mse_loss(part(x), y).backward()
        again.step()
        again.zero_grad()
    for a, b in zip(whole.parameters(), part.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("options", [{"amsgrad": True}, {"maximize": True}])
def test_options_it_does_not_take_are_torchs_adamw(options):
    ours, _ = train(adamw.AdamW, **options)
    theirs, _ = train(torch.optim.AdamW, **options)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)

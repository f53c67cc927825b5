"""Tests for sampler.py: keys and keyed noise bit-exact against a numpy reference, the key tags' table, the fast
exact draw against the definition, and exact sampling (chi-square against softmax at >= 100k keys)."""
import numpy as np
import pytest
import torch
from scipy import stats
from test_rollout import one_thread  # noqa: F401

import sampler


# --- keys and keyed uniforms ---
def np_fmix(x):
    x = x.copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def np_uniform(keys, pos, vocab):
    """Reference U(key, pos, v) in numpy uint64: splitmix64 output v+1 of the stream seeded by mix(key, pos)."""
    g = np.uint64(sampler.GOLDEN)
    with np.errstate(over="ignore"):
        h = np_fmix(np.array(keys, dtype=np.uint64) + g)
        seed = np_fmix((h ^ np.uint64(pos)) + g)  # mix(key, pos)
        x = np_fmix(seed[:, None] + np.arange(1, vocab + 1, dtype=np.uint64)[None, :] * g)
    k = (x.view(np.int64) >> np.int64(41)).astype(np.float32)  # signed top 23 bits, in [-2^22, 2^22)
    return k * np.float32(2.0 ** -23) + np.float32(0.5 + 2.0 ** -24)


def test_mix_is_splitmix64_and_stable():
    assert np_fmix(np.array([sampler.GOLDEN], dtype=np.uint64))[0] == 0xE220A8397B1DCDAF  # splitmix64(0), 1st output
    assert sampler._fmix64(sampler.GOLDEN) == 0xE220A8397B1DCDAF
    assert sampler.mix(1, 2) != sampler.mix(2, 1) and sampler.mix(1) != sampler.mix(1, 0)
    assert sampler.stable_id("nq_123") == int.from_bytes(__import__("hashlib").blake2b(b"nq_123", digest_size=8)
                                                         .digest(), "little")
    keys = [sampler.mix(7, i) for i in range(50)]
    seeds = sampler._row_seeds(torch.tensor([sampler._signed(k) for k in keys]), 9)
    assert [s & sampler.M64 for s in seeds.tolist()] == [sampler.mix(k, 9) for k in keys]
    ek = sampler.episode_key(0, 3, sampler.stable_id("q"), 1)
    assert len({sampler.turn_key(ek, 0), sampler.turn_key(ek, 1), sampler.alt_key(ek, 0, 0), sampler.alt_key(ek, 0, 1),
                sampler.fresh_key(ek, sampler.UNCOUPLED_TAG, 0, 0)}) == 5


def test_keyed_uniform_matches_numpy_reference_bit_for_bit():
    keys = [sampler.mix(3, i) for i in range(64)] + [0, 1, sampler.M64, 1 << 63]  # includes uint64 > 2^63
    for pos in (0, 1, 499):
        u = sampler.keyed_uniform(keys, pos, 1000)
        ref = np_uniform(keys, pos, 1000)
        assert u.dtype == torch.float32 and np.array_equal(u.numpy().view(np.uint32), ref.view(np.uint32))
        assert 0 < u.min().item() and u.max().item() < 1
    alone = sampler.keyed_uniform(keys[5:6], 7, 1000)
    assert torch.equal(alone[0], sampler.keyed_uniform(keys[::-1], 7, 1000)[len(keys) - 6])  # any batch, any order
    extremes = torch.tensor([-(1 << 22), (1 << 22) - 1]).float().mul_(2.0 ** -23).add_(0.5 + 2.0 ** -24)
    assert 0 < extremes[0] < extremes[1] < 1  # never 0 or 1: g is finite
    u = sampler.keyed_uniform([sampler.mix(5, i) for i in range(400)], 0, 1000).flatten()
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3


def test_processor_race_equals_reference_gumbel_argmax():
    torch.manual_seed(1)
    n, vocab = 3000, 50
    logits = torch.randn(n, vocab) * 2
    keys = torch.tensor([sampler._signed(sampler.mix(11, i)) for i in range(n)])
    for temperature in (1.0, 0.7):
        proc = sampler.KeyedGumbelProcessor(keys, start_len=4, temperature=temperature)
        out = proc(torch.zeros(n, 4 + 3, dtype=torch.long), logits.clone())  # pos = 3
        token = out.argmax(-1)
        g = sampler.gumbel_noise(sampler.keyed_uniform(keys, 3, vocab))
        assert torch.equal(token, (logits / temperature + g).argmax(-1))
        assert torch.equal(token, sampler.keyed_gumbel_argmax(logits, keys, 3, temperature))  # the formula's path
        log_p = torch.log_softmax(logits / temperature, -1)
        assert torch.allclose(proc.logprobs[0], log_p.gather(1, token[:, None]).squeeze(1), atol=1e-5)
        assert torch.allclose(proc.entropy[0], -(log_p.exp() * log_p).sum(-1), atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.5, 4, 1.0), (1.0, 0, 0.7),
                                                     (2.0, 6, 0.9)])
def test_first_token_distribution_is_exact(temperature, top_k, top_p):
    """>= 100k keys: chi-square against softmax(masked logits / T); TV no worse than torch.multinomial's at equal N."""
    n, logits = 120_000, torch.tensor([2.0, 1.5, 1.0, 0.5, 0.2, 0.0, -0.3, -1.0, -2.0, -3.0, 0.9, 1.2])
    probs = torch.softmax(sampler._mask_top_k_top_p(logits[None].double() / temperature, top_k, top_p), -1)[0]
    salt = sampler.mix(int(temperature * 10), top_k, int(top_p * 10))
    keys = torch.tensor([sampler._signed(sampler.mix(salt, i)) for i in range(n)])
    proc = sampler.KeyedGumbelProcessor(keys, 0, temperature, top_k, top_p)
    counts = torch.bincount(proc(torch.zeros(n, 0, dtype=torch.long), logits.repeat(n, 1)).argmax(-1), minlength=12)
    ref = torch.bincount(torch.multinomial(probs, n, replacement=True, generator=torch.Generator().manual_seed(0)),
                         minlength=12)
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a masked token was sampled"
    p_value = stats.chisquare(counts[kept].numpy(), (probs[kept] * n).numpy()).pvalue
    tv, tv_ref = [0.5 * (c.double() / n - probs).abs().sum().item() for c in (counts, ref)]
    print(f"T={temperature} top_k={top_k} top_p={top_p}: chi2 p={p_value:.3f} TV={tv:.4f} (multinomial {tv_ref:.4f})")
    assert p_value > 1e-3 and tv < 2 * tv_ref + 2e-3


def test_greedy_is_argmax_without_noise():
    logits = torch.randn(64, 30)
    proc = sampler.KeyedGumbelProcessor(torch.arange(64), 0, temperature=0)
    assert torch.equal(proc(torch.zeros(64, 0, dtype=torch.long), logits.clone()).argmax(-1), logits.argmax(-1))


def test_key_tags_are_distinct_ascii_words():
    """Every key tag is the ASCII of a short word and no two are equal: two kinds of draw never share noise."""
    tags = {name: value for name, value in vars(sampler).items() if name.endswith("_TAG")}
    assert len(tags) >= 15 and len(set(tags.values())) == len(tags), tags
    for name, value in tags.items():
        word = value.to_bytes((value.bit_length() + 7) // 8, "big").decode("ascii")
        assert word.isalnum() and 3 <= len(word) <= 4, (name, word)


@pytest.mark.slow
def test_fused_sampler_matches_eager():
    torch.manual_seed(0)
    logits = torch.randn(257, 3000) * 3
    keys = torch.tensor([sampler._signed(sampler.mix(2, i)) for i in range(257)])
    eager = sampler.KeyedGumbelProcessor(keys, 0)
    fused = sampler.KeyedGumbelProcessor(keys, 0, fused=True)
    ids = torch.zeros(257, 5, dtype=torch.long)
    assert torch.equal(eager(ids, logits.clone()).argmax(-1), fused(ids, logits.clone()).argmax(-1))
    assert torch.allclose(eager.entropy[0], fused.entropy[0], atol=1e-4)


@pytest.mark.gpu
def test_cuda_noise_and_draw_equal_cpu():
    keys = [sampler.mix(4, i) for i in range(64)]
    assert torch.equal(sampler.keyed_uniform(keys, 3, 152_064, "cuda").cpu(), sampler.keyed_uniform(keys, 3, 152_064))
    logits = torch.randn(64, 152_064) * 4
    tokens = {}
    for device, fused in (("cpu", False), ("cuda", False), ("cuda", True)):
        proc = sampler.KeyedGumbelProcessor(torch.tensor([sampler._signed(k) for k in keys], device=device), 0,
                                            fused=fused)
        tokens[device, fused] = proc(torch.zeros(64, 0, dtype=torch.long, device=device),
                                     logits.to(device)).argmax(-1).cpu()
    assert all(torch.equal(t, tokens["cpu", False]) for t in tokens.values())


@pytest.mark.parametrize("scale", [8.0, 0.3])  # peaked: the 256 candidates hold the nucleus; flat: they do not
def test_top_p_without_a_sort_keeps_the_sorted_nucleus(scale):
    """The nucleus of the candidate path (CPU) and of the bisection (what CUDA runs, called here on the CPU) is the
    definition computed in float64 over the fully sorted vocabulary: keep v iff the mass strictly above it < top_p."""
    torch.manual_seed(3)
    logits = torch.randn(48, 5000) * scale
    logits[0, :8] = logits[0].max()  # eight tokens tied at the top of one row
    for top_p in (0.3, 0.9, 0.95):
        s = torch.sort(logits.double(), -1, descending=True).values
        p = torch.softmax(s, -1)
        kept = ((p.cumsum(-1) - p) < top_p).sum(-1, keepdim=True)
        reference = logits >= s.gather(1, kept - 1).float()  # (B, V) the tokens the definition keeps
        e = torch.exp(logits - logits.amax(-1, keepdim=True))
        bisected = logits >= sampler._bisect_floor(logits, e, e.sum(-1, keepdim=True) * top_p)
        masked = sampler._mask_top_k_top_p(logits.clone(), 0, top_p)
        assert torch.equal(masked > -torch.inf, reference) and torch.equal(bisected, reference)
        assert reference[0, :8].all()  # every token tied with a kept one is kept
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    covered = sampler._candidate_floor(logits, e.sum(-1, keepdim=True), 0.95, 256)[1]
    assert covered.all() if scale > 1 else not covered.any()  # both branches ran

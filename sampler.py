"""Same luck: keyed Gumbel-max sampling (DESIGN.md section 4), the noise every draw of TWICE is
made of.

Token v at position `pos` of turn `t` of an episode is drawn as
    y = argmax_v l_v / T + g_v,  g_v = -log(-log u_v),  u_v = U(turn_key(episode_key, t), pos, v)
with U a counter-based hash (the splitmix64 stream seeded by mix(turn_key, pos), element v+1), so
every row is a pure function of its key: any episode regenerates alone, in any batch, with any left
padding, on any device. It is an exact sample from softmax(l / T), top-k / top-p masks applied
before the noise; T = 0 is greedy.
episode_key = mix(run_seed, step, prompt uid, line), line = the sample's index in its GRPO group.

Twins (DESIGN.md section 5) replace one turn's key by alt_key(episode_key, t, j) and replay the
factual keys after it, same luck, different choice: D_t = U - U',
E[D_t | s_t, y_t] = Q(s_t, y_t) - V(s_t). Every other keyed draw (uncoupled twins, Monte Carlo
continuations, the baselines' branches, the budget rule's branch draws, shuffles) is
mix(key, TAG, ...) with a tag of the one table below, so no two kinds of draw share noise.

`keyed_gumbel_argmax` is the definition, written as its formula. `keyed_draw` is the fast exact draw
the engine uses (and `KeyedGumbelProcessor`, a transformers LogitsProcessor, inside model.generate):
the exponential race, the same tokens (tested), one log per element instead of two, optionally one
torch.compile kernel; top-p without a full-vocabulary sort.

It knows no model, tokenizer, protocol or episode: integer keys in, uniforms and token ids out.

Deviation (DESIGN.md section 13; `# DEVIATION P7:` where it acts):
  P7. Top-p keeps every token tied with the least likely kept one, its mass summed from candidates
      or a bisection rather than a sorted float32 cumulative sum: the float64 definition's set
      (tested), not vLLM's sort order.
"""
import hashlib
import math

import torch
from transformers import LogitsProcessor

# --- keys (DESIGN.md section 4): integer mixing only, never Python's hash(), salted per process ---
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment, 2^64 / golden ratio
# splitmix64 finaliser (Steele et al. 2014)
FMIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None))
# u = (k + 1/2) / 2^23: exactly representable in float32, never 0 or 1, so g is finite (|g| < 17)
U_BITS = 23

# --- key tags: a derived key is mix(key, TAG, ...), TAG a short word's ASCII, tested distinct ---
# "turn": turn t's sampling noise, turn_key(key, t): every sampled token (rollout, engine)
TURN_TAG = 0x7475726E
# "alt": a twin's alternative decision, alt_key(key, t, j) (rollout.run_twins, audit)
ALT_TAG = 0x616C74
# "unc": an uncoupled twin's fresh later turns (rollout.run_twins coupling=False, audit)
UNCOUPLED_TAG = 0x756E63
# "ind": method=independent's alternative and everything after it (rollout.run_twins)
INDEPENDENT_TAG = 0x696E64
# "mcq": Monte Carlo rollouts after y_t, Q(s_t, y_t) (audit oracle, AgentPRM, tinyworld)
MC_Q_TAG = 0x6D6371
# "mcv": Monte Carlo rollouts from s_t, V(s_t) (audit oracle, tinyworld)
MC_V_TAG = 0x6D6376
# "bran": branch_uniform, the budget rule's branch draws (train_twice, audit, ARPO, Tree)
BRANCH_TAG = 0x6272616E
# "vine": VinePPO's rollouts from each turn boundary (baselines, audit)
VINE_TAG = 0x76696E65
# "arpo": ARPO's entropy-triggered branch draws and branches (baselines)
ARPO_TAG = 0x6172706F
TREE_TAG = 0x74726565         # "tree": Tree-GRPO's expansion draws and branches (baselines)
# "est": mini-batch order of a learned estimator's passes, not the actor's (methods/learned.py)
ESTIMATOR_TAG = 0x657374
ORDER_TAG = 0x6F7264          # "ord": the audit's question order (audit)
REROLL_TAG = 0x72726F6C       # "rrol": the audit's re-rolled factual episodes F_r (audit)
GROUP_TAG = 0x67727030        # "grp0": the run seed of the audit's fresh GRPO lines (audit)
METHOD_TAG = 0x6D657468       # "meth": F_r's own key for what a method samples from it (audit)
# "fork": a token fork's draw of k ~ r_t (forks.py) and its re-rolled factual (audit)
FORK_TAG = 0x666F726B
# "line": the text-line reading of keys, line_key(turn key, line) for lines >= 1
LINE_TAG = 0x6C696E65
# "scrp": the memory ledger's scripted agent: its turns' lengths and actions (perf/ledger.py)
SCRIPT_TAG = 0x73637270


def _fmix64(x: int) -> int:
    for shift, mult in FMIX:
        x ^= x >> shift
        if mult:
            x = x * mult & M64
    return x


def mix(*ints: int) -> int:
    """Unsigned 64-bit mix of integers (splitmix64 finaliser after each): order-sensitive,
    stable across runs."""
    h = 0
    for a in ints:
        h = _fmix64(((h ^ (a & M64)) + GOLDEN) & M64)
    return h


def stable_id(s: str) -> int:
    """Prompt uid from a string id (blake2b, 8 bytes): the same in every process, unlike hash()."""
    return int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little")


def episode_key(run_seed: int, step: int, uid: int, line: int) -> int:
    # line = index inside the GRPO group: lines get independent noise
    return mix(run_seed, step, uid, line)


def turn_key(ep_key: int, turn: int) -> int:
    return mix(ep_key, TURN_TAG, turn)


def alt_key(ep_key: int, turn: int, j: int) -> int:
    """Key of the j-th alternative decision at `turn`: independent of the factual turn's keys
    (DESIGN.md 5)."""
    return mix(ep_key, ALT_TAG, turn, j)


def line_key(turn_key_: int, line: int) -> int:
    """Key of text line `line` of a turn under the text-line reading (DESIGN.md section 5,
    `line_keys = "text"`): line 0 is the turn key itself, so a turn without a newline draws as
    under the group reading."""
    return turn_key_ if line == 0 else mix(turn_key_, LINE_TAG, line)


def fresh_key(ep_key: int, tag: int, *idx: int) -> int:
    """Seed of uncoupled noise (independent twins, Monte Carlo rollouts): turns then use
    turn_key(seed, turn)."""
    return mix(ep_key, tag, *idx)


def branch_uniform(*key: int) -> float:
    """Keyed uniform in [0, 1) of a budget-rule branch draw (decision t branches iff u < q_t),
    e.g. key = (run seed, step, uid, line, turn): reproducible, and independent of every sampling
    key."""
    return mix(*key, BRANCH_TAG) / 2.0 ** 64


def _signed(u: int) -> int:
    """uint64 -> the int64 with the same bits (torch has no usable uint64 arithmetic)."""
    u &= M64
    return u - (1 << 64) if u >> 63 else u


# --- keyed uniforms: int64 arithmetic wraps (uint64 bit for bit); shifts are made logical ---
_FMIX_T = tuple((shift, (1 << (64 - shift)) - 1, _signed(mult) if mult else None)
                for shift, mult in FMIX)
_WEYL = {}  # (vocab, device) -> (V,) int64 (v + 1) * GOLDEN


def _fmix64_(x, tmp, rounds=3):
    """splitmix64 finaliser in place on an int64 tensor (tmp: scratch of the same shape, or
    None)."""
    for shift, low, mult in _FMIX_T[:rounds]:
        tmp = torch.bitwise_right_shift(x, shift, out=tmp)
        x.bitwise_xor_(tmp.bitwise_and_(low))  # clear the sign-extended bits: logical shift
        if mult is not None:
            x.mul_(mult)
    return x


def _row_seeds(keys, pos):
    """mix(key, pos) for a (B,) int64 tensor of keys: the seed of the row's noise stream at
    position pos."""
    h = _fmix64_(keys + _signed(GOLDEN), None)
    return _fmix64_((h ^ pos) + _signed(GOLDEN), None)


def line_keys(turn_keys, lines):
    """line_key over (B,) int64 tensors of turn keys and line numbers (no host sync: the decode
    step calls it)."""
    h = _fmix64_(turn_keys + _signed(GOLDEN), None)
    h = _fmix64_((h ^ _signed(LINE_TAG)) + _signed(GOLDEN), None)
    return torch.where(lines == 0, turn_keys, _fmix64_((h ^ lines) + _signed(GOLDEN), None))


def _weyl(vocab: int, device) -> torch.Tensor:
    key = (vocab, str(device))
    if key not in _WEYL:
        _WEYL[key] = torch.arange(1, vocab + 1, dtype=torch.int64,
                                  device=device).mul_(_signed(GOLDEN))
    return _WEYL[key]


def _stream_top_bits(seeds, weyl, x=None, tmp=None):
    """(B, V) signed top U_BITS bits of splitmix64 output v+1 of each row's stream, in
    [-2^22, 2^22).

    The finaliser's last xorshift (>> 31) leaves the top 31 bits unchanged, so two rounds give the
    same top bits.
    """
    x = _fmix64_(torch.add(seeds[:, None], weyl, out=x), tmp, rounds=2)
    # arithmetic shift: the top bits, as a signed int
    return torch.bitwise_right_shift(x, 64 - U_BITS, out=tmp)


def _log_uniform_(k, out=None):
    """log u with u = (k + 2^22 + 1/2) / 2^23 (k from _stream_top_bits): every step exact in
    float32 but the log."""
    u = torch.mul(k, 2.0 ** -U_BITS, out=out) if out is None else out.copy_(k).mul_(2.0 ** -U_BITS)
    return u.add_(0.5 + 2.0 ** -(U_BITS + 1)).log_()


def keyed_uniform(row_keys, pos, vocab: int, device=None) -> torch.Tensor:
    """(B, V) float32 uniforms in (0, 1), a pure function of (row key, pos, v): U of DESIGN.md
    section 4.

    row_keys: B keys (python ints, uint64 values) or an int64 tensor; pos: int or (B,) tensor.
    """
    if not torch.is_tensor(row_keys):
        row_keys = torch.tensor([_signed(k) for k in row_keys], dtype=torch.int64, device=device)
    k = _stream_top_bits(_row_seeds(row_keys, pos), _weyl(vocab, row_keys.device))
    return k.float().mul_(2.0 ** -U_BITS).add_(0.5 + 2.0 ** -(U_BITS + 1))  # (B, V)


def gumbel_noise(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u))


# --- the definition of a keyed draw, and the fast exact draw (the same tokens) ---
def keyed_gumbel_argmax(logits, row_keys, pos, temperature: float = 1.0) -> torch.Tensor:
    """The definition of a keyed draw (DESIGN.md section 4), written as its formula: the reference
    of the fast exponential race below (identical tokens, tested)."""
    return (logits / temperature +
            gumbel_noise(keyed_uniform(row_keys, pos, logits.shape[-1]))).argmax(-1)


def _keyed_race(l, seeds, weyl, e=None, x=None, tmp=None, f=None):
    """Keyed Gumbel-max on scaled, masked logits l (B, V), modified in place ->
    (token, log-prob, entropy), (B,).

    argmax_v l_v + g_v = argmax_v exp(l_v - m) / E_v with E_v = -log u_v ~ Exp(1) (the exponential
    race): the same draw, one log per element instead of two, and exp(l - m) is needed for the
    entropy anyway. Optional e/x/tmp/f are (B, V) scratch buffers (eager CPU: reusing them avoids
    page faults); torch.compile passes none.
    """
    m = l.amax(-1, keepdim=True)  # (B, 1)
    # finite -inf masks keep 0 * log 0 = 0 in the entropy
    l.sub_(m).clamp_(min=torch.finfo(l.dtype).min)
    e = torch.exp(l, out=e)  # (B, V) unnormalised probabilities, max 1
    z = e.sum(-1)  # (B,)
    log_z = z.log()
    entropy = log_z - (e * l).sum(-1) / z
    log_u = _log_uniform_(_stream_top_bits(seeds, weyl, x, tmp), f)  # (B, V), < 0
    token = e.div_(log_u).argmin(-1)  # e / log u = -e / E: its minimum is the race winner
    logprob = l.gather(1, token[:, None]).squeeze(1) - log_z
    return token, logprob, entropy


# "race" -> torch.compile(_keyed_race): one fused kernel over (B, V), compiled on first use
_COMPILED = {}


# top-p on the CPU: the nucleus is read off this many most likely tokens when they hold it
TOP_P_CANDIDATES = 256


def _mask_top_k_top_p(l, top_k: int, top_p: float):
    """Mask to -inf outside top-k, then outside the nucleus, in place (transformers'
    TopK/TopPLogitsWarper order).

    The nucleus keeps token v iff the mass of the tokens strictly more likely than v is below top_p
    (so the most likely token always, and every token tied with the least likely kept one):
    keep l >= _nucleus_floor(l, top_p).
    """
    if top_k > 0 and top_k < l.shape[-1]:
        l.masked_fill_(l < torch.topk(l, top_k).values[..., -1:], -math.inf)
    # DEVIATION P7: ties at the boundary all kept; the mass summed without a sort (_nucleus_floor)
    if top_p < 1.0:
        l.masked_fill_(l < _nucleus_floor(l, top_p), -math.inf)
    return l


def _nucleus_floor(l, top_p: float):
    """(B, 1) the least logit of each row's nucleus, without a full-vocabulary sort.

    CPU: the TOP_P_CANDIDATES most likely tokens give it exactly whenever they hold the nucleus
    (mass >= top_p before the last one); rows where they do not are redone over the whole sorted
    vocabulary. CUDA: a bisection over the floats' own order (no sort, no host sync, fixed shapes,
    so it runs inside a captured decode step). Both give the smallest logit x with
    mass(l > x) < top_p (float32 sums, in different orders)."""
    e = torch.exp(l - l.amax(-1, keepdim=True))  # (B, V) unnormalised probabilities
    z = e.sum(-1, keepdim=True)  # (B, 1)
    if l.is_cuda:
        return _bisect_floor(l, e, z * top_p)
    floor, covered = _candidate_floor(l, z, top_p, min(TOP_P_CANDIDATES, l.shape[-1]))
    if not covered.all():  # a flat distribution: the nucleus reaches past the candidates
        rows = (~covered).nonzero().squeeze(1)
        floor[rows] = _candidate_floor(l[rows], z[rows], top_p, l.shape[-1])[0]
    return floor


def _candidate_floor(l, z, top_p: float, k: int):
    """(floor (B, 1), covered (B,)) from the k most likely tokens: kept ranks are those whose
    strictly-more-likely mass (exclusive cumulative sum) is below top_p; covered: a rank among
    the k is dropped (or k is the vocabulary)."""
    vals = torch.topk(l, k).values  # (B, k), descending
    p = torch.exp(vals - l.amax(-1, keepdim=True)) / z
    above = torch.cumsum(p, -1) - p  # (B, k) mass before each rank
    kept = (above < top_p).sum(-1, keepdim=True).clamp_(min=1)  # (B, 1) a prefix of the ranks
    return vals.gather(1, kept - 1), (kept.squeeze(1) < k) | (k == l.shape[-1])


def _bisect_floor(l, e, target):
    """(B, 1) the smallest logit x with sum(e[l > x]) < target, by 32 halvings over float32 bit
    patterns (ordered as integers): the answer is always one of the row's logits."""
    assert l.dtype == torch.float32, "the draw's logits are float32"
    # (B, 1) int64: the maximum qualifies (nothing above it)
    hi = _ordered(l.amax(-1, keepdim=True))
    lo = torch.full_like(hi, -(1 << 31) - 1)  # below every float32
    for _ in range(32):
        mid = (lo + hi) >> 1
        ok = (e * (l > _float(mid))).sum(-1, keepdim=True) < target
        hi, lo = torch.where(ok, mid, hi), torch.where(ok, lo, mid)
    return _float(hi)


def _ordered(x):
    """float32 -> int64 with the floats' order (x < y iff _ordered(x) < _ordered(y))."""
    i = x.view(torch.int32).long()
    return torch.where(i >= 0, i, i ^ 0x7FFFFFFF)


def _float(k):
    """Inverse of _ordered."""
    return torch.where(k >= 0, k, k ^ 0x7FFFFFFF).int().view(torch.float32)


def _ban_(l, ban):
    """l[b, ban[b]] = -inf where ban[b] >= 0 and another token keeps a finite logit (a ban on the
    only token with mass is lifted): fixed shapes, no host sync."""
    hit = torch.arange(l.shape[-1], device=l.device)[None, :] == ban[:, None]  # (B, V)
    others = (torch.isfinite(l) & ~hit).any(-1, keepdim=True)  # (B, 1)
    return l.masked_fill_(hit & others, -math.inf)


def keyed_draw(l, keys, pos, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               fused: bool = False, scratch=None, ban=None):
    """(token, log-prob, entropy), each (B,), of keyed Gumbel-max draws on float32 logits
    l (B, V), modified in place: the processor's draw as a function (the engine's decode step calls
    it, also inside a captured CUDA graph). keys (B,) int64 turn keys, pos int or (B,) positions in
    the turn; scratch: _keyed_race's optional buffers. ban (B,) token ids or -1: row b draws from
    the sampling law (after top-k / top-p) restricted to v != ban[b] (a token fork), and records
    that restricted law's log-prob and entropy."""
    if temperature == 0:  # greedy: argmax of the logits, statistics of softmax(logits)
        if ban is not None:
            _ban_(l, ban)
        token = l.argmax(-1)
        log_p = torch.log_softmax(l, -1)
        return (token, log_p.gather(1, token[:, None]).squeeze(1),
                -(log_p.exp() * log_p.nan_to_num()).sum(-1))
    if temperature != 1:
        l.div_(temperature)
    _mask_top_k_top_p(l, top_k, top_p)
    if ban is not None:
        _ban_(l, ban)
    seeds, weyl = _row_seeds(keys, pos), _weyl(l.shape[1], l.device)
    if fused:
        race = _COMPILED.setdefault("race", torch.compile(_keyed_race, dynamic=True))
        return race(l, seeds, weyl)
    return _keyed_race(l, seeds, weyl, *(scratch or ()))


class KeyedGumbelProcessor(LogitsProcessor):
    """Keyed Gumbel-max sampling inside `model.generate(do_sample=False)` (DESIGN.md section 4).

    Row b's token at position pos of the turn (pos = generated length, never the padded length) is
    argmax_v l_v / T + g_v with masking (top-k, top-p) applied before the noise: an exact sample
    from softmax of the masked l / T. The processor draws it itself and returns the scores with
    +inf at that token, so greedy search picks it whatever it would do with ties (and no (B, V)
    write). T = 0 is greedy (no noise). It records, per row and step, the token's log-prob under
    the sampling distribution and the entropy of that distribution (at T = 0: those of
    softmax(logits)); finished rows (`rows`, set by TurnStopper) are skipped and record nan.

    keyer (optional, set by the engine): keyer(input_ids, n) -> ((B,) keys, (B,) positions,
    (B,) banned token or -1, or None) of the n-th draw of every row: rows that start inside a turn
    or draw a fork token (rows.TurnStart), and the text-line reading of keys; without it row b
    draws with keys[b] at position n.
    """

    def __init__(self, turn_keys, start_len: int, temperature=1.0, top_k=0, top_p=1.0, fused=False):
        self.keys = turn_keys  # (B,) int64, the turn key of each row
        self.start_len = start_len  # input length of this generate call (prompt + padding)
        self.temperature, self.top_k, self.top_p, self.fused = temperature, top_k, top_p, fused
        self.rows = None  # (b,) indices of rows still generating; None = all
        self.logprobs, self.entropy = [], []  # one (B,) tensor per step
        self.keyer = None
        self._buffers = None

    def __call__(self, input_ids, scores):  # (B, L), (B, V) float32, a copy owned by generate
        pos = input_ids.shape[1] - self.start_len
        keys, ban, rows = self.keys, None, self.rows
        if self.keyer is not None:
            keys, pos, ban = self.keyer(input_ids, pos)
        pick = lambda x: (x if rows is None or not torch.is_tensor(x)  # noqa: E731
                          else x.index_select(0, rows))
        logits = scores if rows is None else scores.index_select(0, rows)  # (b, V)
        token, logprob, entropy = self._draw(logits, pick(keys), pick(pos),
                                             None if ban is None else pick(ban))
        if rows is None:
            rows = torch.arange(scores.shape[0], device=scores.device)
            self.logprobs.append(logprob)
            self.entropy.append(entropy)
        else:
            self.logprobs.append(
                torch.full_like(scores[:, 0], math.nan).index_copy_(0, rows, logprob))
            self.entropy.append(
                torch.full_like(scores[:, 0], math.nan).index_copy_(0, rows, entropy))
        scores[rows, token] = math.inf
        return scores

    def _draw(self, l, keys, pos, ban=None):
        scratch = None if self.fused or self.temperature == 0 else self._scratch(l)
        return keyed_draw(l, keys, pos, self.temperature, self.top_k, self.top_p, self.fused,
                          scratch, ban)

    def _scratch(self, l):
        """(b, V) views of per-call buffers: e, x, tmp, f (allocated once, at the first step's
        full batch)."""
        if self._buffers is None or self._buffers[0].shape[0] < l.shape[0]:
            shape, dev = l.shape, l.device
            self._buffers = (torch.empty(shape, dtype=l.dtype, device=dev),
                             torch.empty(shape, dtype=torch.int64, device=dev),
                             torch.empty(shape, dtype=torch.int64, device=dev), torch.empty_like(l))
        return tuple(buf[: l.shape[0]] for buf in self._buffers)

    def records(self):
        """(B, n) log-probs and entropies on the CPU."""
        if not self.logprobs:
            n = self.keys.shape[0]
            return torch.zeros(n, 0), torch.zeros(n, 0)
        return torch.stack(self.logprobs, 1).cpu(), torch.stack(self.entropy, 1).cpu()

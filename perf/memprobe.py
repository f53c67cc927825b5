"""The memory ledger's probe runs (perf/ledger.py): the real `train_twice.train_step`, driven by a
scripted agent, under memtrack.Tracker, every storage classified by who allocated it and what it
holds.

The scripted agent: a random model's turns are forced to the lengths and actions of a Script
(SCRIPTS: Search-R1-like statistics, stated there), drawn from each turn's key, so the same step has
the same token counts whatever the model: filler words drawn with the keyed noise, then `<search> w
</search>` or `<answer> w </answer>`; a ScriptedRetriever returns documents of the script's
observation length, their ids from the query. Everything else (the engine, the twins, collate, the
log-prob passes, the update) is the training code itself; of the update, one mini-batch a pass
runs (one_mini_batch: each peaks alike).

The engine as on a GPU (as_on_gpu): its slot cache of gen_batch_size slots holds max_context + 1
positions each (kvcache.cache_bytes), as CUDA allocates it, not the CPU's smaller size.

Owners (OWNED): the function on the call stack that allocated a storage names it: the decode batch
(the slot cache and the decoder's state, the prefill's stacked rows and cache layers, a slot's
admission), activations (the model's forward, the decode step and its keyed draw, the log-prob
passes, the backward), the optimizer, the sampling copy; every engine.KVEntry is re-counted as a KV
entry when it is made (owners' tag); anything else is a step tensor ("other": the batch, advantages,
log-prob arrays). Kinds: "kv" ((.., kv heads, tokens, head dim)), "hidden" (last dim the hidden
size), "other". A probe model small enough for a CPU thus measures a large one: keys and values
scale by KV bytes per token, hidden states by hidden size (probe_scale).

It knows nothing of GPUs: its storages are counted, not an allocator's blocks (perf/memtrack.py).
"""
import contextlib
import functools
import math
from dataclasses import dataclass

import torch

from generation import engine
from generation import kvcache
from generation import logprobs
from perf import memtrack
import protocol
import sampler
import train_twice as tt
from infra import config, weights

PROBE = dict(hidden_size=24, intermediate_size=48, num_attention_heads=3, num_key_value_heads=1,
             # kv (b, 1, n, 8), hidden (.., 24): told apart
             tie_word_embeddings=True, max_position_embeddings=8192)
# at most: a cache layer's update holds one layer's old and new tensors at once, so a probe of fewer
# layers than its target overstates that step's extra by (target / probe - 1) / (2 target) of the
# batch (2.8% at 36 layers; none when the probe has the target's layers)
PROBE_LAYERS = 12


def probe_dims(dims) -> dict:
    """The probe for a target model: PROBE with the target's layers, at most PROBE_LAYERS."""
    return {**PROBE, "num_hidden_layers": min(dims["num_hidden_layers"], PROBE_LAYERS)}


# --------------------------------------------------------------------------------------------------------------
# The scripted agent: turn lengths and actions drawn from each turn's key, whatever the model's
# logits

@dataclass(frozen=True)
class Script:
    """Turn statistics of the scripted agent (token counts). A turn searches with probability
    p_search (else it answers; after max_turns searches the final turn executes nothing); its length
    is uniform in `search` or `answer`; a search's observation has `observation` tokens (cut at
    max_obs_tokens)."""
    name: str
    prompt: int
    p_search: float
    search: tuple
    answer: tuple
    observation: int


SCRIPTS = {
    # Search-R1-like: the Qwen2.5 chat prompt with Search-R1's instruction is 154-172 tokens (NQ /
    # HotpotQA questions); GRPO agents search ~1-2 times (mean 1.77 here); a think + query turn
    # 60-180 tokens; 3 wiki-18 passages of 100 words are ~420 tokens with titles and tags (336 at
    # one token a word)
    "search-r1": Script("search-r1", prompt=165, p_search=0.7, search=(60, 180), answer=(30, 90),
                        observation=420),
    # stress: long thinking, nearly always 4 searches, near-full observations: many episodes reach
    # max_context
    "long": Script("long", prompt=165, p_search=0.9, search=(150, 450), answer=(60, 180),
                   observation=480),
}
FILLER = [f"w{i}" for i in range(256)]  # what a scripted turn says before its action
# a forced answer is one of these; the gold answer is FILLER[0]
ANSWERS = FILLER[:4]


TAGS = ["<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>"]


def script_tokenizer(size: int = 0):
    """A word-level tokenizer (one token per word or tag, ChatML template): token counts are word
    counts. size: invented words ("v0", "v1", ...) fill it up to that many tokens, a stand-in of
    that size for a real tokenizer (perf/gpucheck.py, where Qwen's is not installed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = sorted(set(protocol.INSTRUCTION.split() + protocol.INVALID_ACTION_MSG.split() + FILLER +
                       ["Question:", "Doc", "(Title:", ")", "T"]))
    words = ["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"] + words
    words += [f"v{i}" for i in range(size - len(words) - len(set(TAGS) - set(words)))]
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>",
                                  eos_token="<|im_end|>", clean_up_tokenization_spaces=False)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.add_tokens(TAGS)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


class ScriptedRetriever:
    """Three documents per query, ids from the query (a twin's other query gets other documents), so
    long that the observation is `observation` tokens once cut."""

    def __init__(self, tok, script):
        self.words = " ".join(FILLER[i % len(FILLER)] for i in range(script.observation))

    def search(self, queries, topk=3):
        return [[{
            "id": f"{sampler.stable_id(q) % 10_000}-{k}", "contents": f'"T"\n{self.words}',
            "score": 0.0
        } for k in range(topk)] for q in queries]


def script_rows(tok, script, n: int) -> list:
    """n questions whose prompts are script.prompt tokens."""
    # the prompt around a question
    base = len(_ids(tok, protocol.render_prompt(tok, FILLER[0]))) - 1
    words = max(1, script.prompt - base)
    return [{
        "id": f"q{i}", "question": " ".join(FILLER[(i + k) % len(FILLER)]
                                            for k in range(words)), "golden_answers": [ANSWERS[0]]
    } for i in range(n)]


def scripted_draw(tok, script, draw):
    """keyed_draw (sampler.py) following the script: filler words drawn by `draw` (the real keyed
    draw) from the logits restricted to FILLER, then the action's tags, so each turn stops at its
    planned length. Keys are turn keys and positions the token's place in the turn, as the engine
    passes them (group line keys, the presets')."""
    tags = {a: (_ids(tok, f"<{a}>"), _ids(tok, f"</{a}>")) for a in ("search", "answer")}
    allowed = torch.tensor(_ids(tok, " ".join(FILLER)))

    @functools.lru_cache(maxsize=None)
    def plan(key: int) -> tuple:
        u = [sampler.mix(key, sampler.SCRIPT_TAG, i) / 2 ** 64 for i in range(3)]
        action = "search" if u[0] < script.p_search else "answer"
        lo, hi = script.search if action == "search" else script.answer
        word = _ids(tok, (FILLER if action == "search" else ANSWERS)[int(
            u[2] * (256 if action == "search" else 4))])
        tail = tags[action][0] + word + tags[action][1]
        return max(lo + int(u[1] * (hi - lo + 1)), len(tail) + 1), tail

    def scripted(logits, keys, pos, *args, **kwargs):
        masked = torch.full_like(logits, -math.inf)
        masked[:, allowed] = logits[:, allowed]
        token, logprob, entropy = draw(masked, keys, pos, *args, **kwargs)
        steps = pos.tolist() if torch.is_tensor(pos) else [pos] * len(token)
        forced = token.clone()
        for b, (key, k) in enumerate(zip(keys.tolist(), steps)):
            length, tail = plan(key % 2 ** 64)
            # a row past its stop (frozen, still drawing) repeats the last tag
            if k >= length - len(tail):
                forced[b] = tail[min(k - (length - len(tail)), len(tail) - 1)]
        return forced, logprob, entropy
    return scripted


@contextlib.contextmanager
def scripted(tok, script):
    """The scripted agent in every place a token is drawn: the engine's decode step (kvcache), its
    reads off stored hidden states (engine._track) and the generate path's processor (sampler)."""
    draw = scripted_draw(tok, script, sampler.keyed_draw)
    with patched(kvcache, "keyed_draw", draw), patched(engine, "keyed_draw", draw), \
            patched(sampler, "keyed_draw", draw):
        yield


@contextlib.contextmanager
def patched(obj, name, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


# --------------------------------------------------------------------------------------------------------------
# Owners and kinds of storages: which function allocated it, and what it holds

# (object, attribute, owner): what the named function allocates belongs to owner (innermost call
# wins)
OWNED = ((kvcache.SlotCache, "__init__", "decode_batch"), (kvcache.Decoder, "__init__",
                                                           "decode_batch"), (engine, "_stack_rows",
                                                                             "decode_batch"),
         (engine, "_stack_hidden", "decode_batch"), (engine, "_prefill_bucket", "decode_batch"),
         (engine._Slots, "admit",
          "decode_batch"), (engine, "_forward", "activations"), (engine, "_logits", "activations"),
         (kvcache.Decoder, "_step", "activations"), (logprobs, "token_logprobs", "activations"),
         (tt, "ppo_loss", "activations"), (weights, "sampling_copy", "weights"), (torch.optim.AdamW,
                                                                             "step", "optimizer"))


@contextlib.contextmanager
def owners(stack: list, accel=None, tag=None):
    """While the block runs, each function of OWNED (and the prefill cache layers' update and row
    selection: the decode batch; accelerate's backward: activations) pushes its owner on `stack` for
    the duration of its call.
    tag(tensors, owner): with it, every engine.KVEntry made (a prefill's, or a row's copied out of its slot) is
    counted as "kv_entries" from then on, whoever allocated it."""
    from transformers.cache_utils import DynamicLayer

    def owned(f, owner):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            stack.append(owner)
            try:
                return f(*args, **kwargs)
            finally:
                stack.pop()
        return wrapper

    targets = OWNED + ((DynamicLayer, "update", "decode_batch"),
                       (DynamicLayer, "batch_select_indices", "decode_batch"))
    targets += ((accel, "backward", "activations"),) if accel is not None else ()
    entry = engine.KVEntry

    def counted_entry(ids, k, v, hidden):
        tag([t for t in (k, v, hidden) if t is not None], "kv_entries")
        return entry(ids, k, v, hidden)
    with contextlib.ExitStack() as es:
        for obj, name, owner in targets:
            es.enter_context(patched(obj, name, owned(getattr(obj, name), owner)))
        if tag is not None:
            es.enter_context(patched(engine, "KVEntry", counted_entry))
        yield


def kind_of(t, dims) -> str:
    """"kv" (keys or values: (.., kv heads, n, head dim): a layer's (b, H, n, D), an entry's
    (layers, H, n, D), the slot cache's (layers, slots, H, length, D)), "hidden" (last dim = hidden
    size) or "other"."""
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    if t.dim() >= 4 and t.shape[-3] == dims["num_key_value_heads"] and t.shape[-1] == head_dim:
        return "kv"
    return "hidden" if t.dim() >= 1 and t.shape[-1] == dims["hidden_size"] else "other"


def classifier(dims, stack):
    return lambda t: f"{stack[-1] if stack else 'other'}/{kind_of(t, dims)}"


def tagger(tracker, dims):
    """owners()' tag: tensors counted under owner/<their kind> from now on."""
    def tag(tensors, owner):
        for t in tensors:
            tracker.tag([t], f"{owner}/{kind_of(t, dims)}")
    return tag


def cuda_length(model, proto, queue) -> int:
    """engine._cache_length as on CUDA, wherever the probe runs: every slot of the decode cache
    holds max_context + 1 positions (on a CPU the engine allocates only what a call's rows can
    reach)."""
    return proto.max_context + 1


@contextlib.contextmanager
def as_on_gpu(position_bytes=None):
    """The engine sized as on a GPU (cuda_length); the probe's attention (_no_attention) taken for
    sdpa by the engine's check of what its slot cache can drive; with position_bytes (the target
    model's, engine.position_bytes), the live-KV budget counts the positions it would at the
    target (generation/kvbudget.py)."""
    size = engine.position_bytes if position_bytes is None else (lambda model: position_bytes)
    with patched(engine, "_cache_length", cuda_length), patched(engine, "_slots_fit",
                                                                lambda model: True), \
            patched(engine, "position_bytes", size):
        yield


def kv_bytes_per_token(dims, dtype) -> int:
    """Keys and values of one token in every layer."""
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    return 2 * dims["num_hidden_layers"] * dims["num_key_value_heads"] * head_dim * _size(dtype)


def _size(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def probe_scale(probe_dims, probe_dtype, dims, dtype) -> dict:
    """Tracker scale of a probe run for a target model: KV and hidden states by bytes per token,
    width-free step tensors as they are, and 0 for what the ledger takes from elsewhere
    (activations: full-size fake passes; parameters, gradients, optimizer: the parameter count)."""
    f_kv = kv_bytes_per_token(dims, dtype) / kv_bytes_per_token(probe_dims, probe_dtype)
    f_h = dims["hidden_size"] * _size(dtype) / (probe_dims["hidden_size"] * _size(probe_dtype))
    scale = {}
    for owner in ("kv_entries", "decode_batch", "other", "activations", "weights", "reference",
                  "gradients", "optimizer"):
        dynamic = owner in ("kv_entries", "decode_batch", "other")
        scale.update({
            f"{owner}/kv": f_kv if dynamic else 0.0, f"{owner}/hidden": f_h if dynamic else 0.0,
            f"{owner}/other": 1.0 if dynamic else 0.0
        })
    return scale


# --------------------------------------------------------------------------------------------------------------
# The probe run: train_step itself, scripted, under the tracker

@contextlib.contextmanager
def phases(tracker, run, shapes, virtual=None):
    """train_step's phases as tracker phases (the functions it calls, wrapped while the block runs),
    and the shapes of every forward by phase: shapes[phase, "prefill" | "decode"]: (rows, new
    tokens, cache width); shapes[phase, "scored"]: (rows, width, scored positions) of a log-prob
    pass. virtual(kind, rows, new tokens, cache width) -> bytes: held as "activations/virtual" while
    each such forward runs (perf/ledger.py: the activations a full-size model would have there, so
    the phase's peak falls where the full-size one would)."""
    def timed(name, f):
        def wrapper(*args, **kwargs):
            with tracker.phase(name):
                return f(*args, **kwargs)
        return wrapper

    def forward(model, ids, mask, pos, cache):
        b, s = ids.shape
        # the slot cache's decode step: (b, 1, 1, width) over the cached positions + 1
        if isinstance(mask, dict):
            kind, width = "decode", mask["full_attention"].shape[-1] - 1
        else:
            kind, width = "prefill" if s > 1 else "decode", mask.shape[1] - s
        shapes.setdefault((tracker.current, kind), []).append((b, s, width))
        with tracker.hold("activations/virtual", virtual(
                kind, b, s, width)) if virtual else contextlib.nullcontext():
            return saved_forward(model, ids, mask, pos, cache)

    def head(model, hidden):  # rows reading logits off stored hidden states (engine._track)
        shapes.setdefault((tracker.current, "head"), []).append((hidden.shape[0], 1, 0))
        with tracker.hold("activations/virtual", virtual("head", hidden.shape[0], 1, 0)) if virtual else \
                contextlib.nullcontext():
            return saved_logits(model, hidden)

    def token_lp(model, input_ids, attention_mask, temperature, with_entropy=False, positions=None,
                 **kw):
        n = int(positions.sum()) if positions is not None else int(attention_mask[:, 1:].sum())
        shapes.setdefault((tracker.current, "scored"), []).append((*input_ids.shape, n))
        return saved_lp(model, input_ids, attention_mask, temperature, with_entropy, positions,
                        **kw)

    saved_forward, saved_lp, saved_logits = engine._forward, logprobs.token_logprobs, engine._logits
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(run.method, "rollout", timed("rollout", run.method.rollout)))
        stack.enter_context(patched(run.method, "advantages", timed("twins",
                                                                    run.method.advantages)))
        stack.enter_context(
            patched(logprobs, "batch_logprobs", timed("logprobs", logprobs.batch_logprobs)))
        stack.enter_context(patched(tt, "ppo_update", timed("update", tt.ppo_update)))
        stack.enter_context(patched(run.opt, "step", timed("optimizer_step", run.opt.step)))
        stack.enter_context(patched(engine, "_forward", forward))
        stack.enter_context(patched(engine, "_logits", head))
        stack.enter_context(patched(logprobs, "token_logprobs", token_lp))
        yield


@contextlib.contextmanager
def one_mini_batch(shapes):
    """train_twice.ppo_update runs one of its mini-batches per pass: the one holding the micro-batch
    of most rows x width. The micro-batches of the others go into shapes[("update", "scored")] as if
    run: (rows, width, scored positions), as phases() records a pass. Its peak is the whole update's,
    whatever the number of mini-batches: each micro-batch's tensors die before the next is cut
    (ppo_update), gradients die at each optimizer step (zero_grad(set_to_none=True)), AdamW's state
    is made once and kept, and the step's tensors (batch, advantages, log-probs) are held once for
    the whole update; what a micro-batch cuts from them is rows x width (logprobs.trimmed). That
    micro-batch is its mini-batch's last (they are sorted by length), alive during the optimizer
    step, which so peaks there too. Passes and optimizer steps, and so time, scale with the count
    (ledger.update_counts). tests/test_ledger.py checks it against a probe of every mini-batch (on
    its step, probing the first one instead gives 4% less in the update, 3% in the optimizer step)."""
    update, split = tt.ppo_update, tt.mini_batches

    def ppo_update(cfg, run, batch, *args):
        lengths = batch["attention_mask"].cpu().numpy().sum(1)  # numpy: nothing the tracker counts
        loss_mask = batch["loss_mask"].cpu().numpy()

        def shape(micro):  # the pass's (rows, width, scored) as ppo_update cuts and scores it
            width = int(lengths[micro].max())
            return len(micro), width, int(loss_mask[micro, 1:width].sum())

        def probed(cfg, step, epoch, rows):
            batches = split(cfg, step, epoch, rows)
            plans = [[shape(m) for m in logprobs.length_sorted_splits(lengths, mb, run.n_micro)]
                     for mb in batches]
            pick = max(range(len(plans)), key=lambda i: max([r * w for r, w, _ in plans[i]] or [0]))
            shapes.setdefault(("update", "scored"), []).extend(
                s for i, plan in enumerate(plans) if i != pick for s in plan)
            return [batches[pick]]
        with patched(tt, "mini_batches", probed):
            return update(cfg, run, batch, *args)
    with patched(tt, "ppo_update", ppo_update):
        yield


def step_config(preset: str, overrides=()) -> tt.Config:
    """The preset's config at one rank's share (prompts_per_step / 8), every path blank."""
    # prompts: set below, after the checks
    cfg = tt.parse_config([preset, "--prompts_per_step=1", *overrides])
    base = tt.parse_config([preset])
    cfg.prompts_per_step = base.prompts_per_step // 8 if "--prompts_per_step" not in " ".join(overrides) \
        else cfg.prompts_per_step
    cfg.world, cfg.model, cfg.index, cfg.retriever_url, cfg.log_tensorboard = "", "", "", "", False
    return cfg


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """The probe's attention: zeros of the output's shape. What the probe measures (caches, entries,
    step tensors) is built before attention runs, and its turns are scripted: computing attention
    would only cost time."""
    return query.new_zeros(query.shape).transpose(1, 2).contiguous(), None


def make_run(cfg, dims, dtype, tok, rows, retriever, mixed="no", attention="sdpa", device="cpu"):
    """A train_twice.Run on the CPU: a random Qwen2 of `dims` (weights in dtype; mixed = "bf16":
    autocast, as on a GPU without DeepSpeed), its copy as the reference, AdamW, the scripted
    retriever and rows. attention "probe": _no_attention (no mask is built either). device "cuda":
    on the GPU when there is one (perf/gpucheck.py)."""
    import credit
    import forks
    import methods
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import Qwen2Config, Qwen2ForCausalLM
    # a fresh state per run: the probe and measured runs differ in precision
    AcceleratorState._reset_state(True)
    accel = Accelerator(cpu=not torch.cuda.is_available() or device == "cpu", mixed_precision=mixed)
    torch.manual_seed(cfg.seed)
    from transformers.modeling_utils import AttentionInterface
    AttentionInterface.register("probe", _no_attention)
    # a larger vocabulary than the script's may be asked
    shape = Qwen2Config(**{"vocab_size": len(tok), **dims})
    policy = Qwen2ForCausalLM._from_config(shape, dtype=dtype,
                                           attn_implementation=attention).eval()
    ref = Qwen2ForCausalLM._from_config(shape, dtype=torch.bfloat16 if cfg.bf16 else dtype,
                                        attn_implementation=attention).eval()
    ref.load_state_dict(policy.state_dict())
    ref = ref.to(accel.device).requires_grad_(False)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    policy, opt = accel.prepare(policy, opt)
    n_micro = config.micro_batches(cfg)  # as setup(): a batch that does not split is refused
    return tt.Run(accel, policy, ref, tok, retriever, opt, methods.make(cfg),
                  credit.DiscordancePredictor(),
                  credit.DiscordancePredictor(features=forks.TOKEN_FEATURES),
                  credit.RunningScale(cfg.scale_decay, cfg.twin_scale), rows, n_micro,
                  weights.weight_norm(accel, policy))


def run_steps(cfg, dims, dtype, script, steps=1, scale=None, block=1, mixed="no", threads=1,
              attention="sdpa", virtual=None, position_bytes=None, every_mini_batch=False) -> dict:
    """`steps` train_steps of a scripted run under a Tracker; the last step's per-phase peaks
    (scaled totals and their categories), the shapes of its forwards, and the step's counters.
    virtual: see phases; position_bytes: see as_on_gpu. The update runs one mini-batch a pass
    (one_mini_batch); every_mini_batch: all of them."""
    torch.set_num_threads(threads)
    tok = script_tokenizer()
    run = make_run(cfg, dims, dtype, tok, script_rows(tok, script, cfg.prompts_per_step),
                   ScriptedRetriever(tok, script),
                   mixed, attention)
    model, stack = run.accel.unwrap_model(run.policy), []
    tracker = memtrack.Tracker(classifier(dims, stack), block=block, scale=scale)
    tracker.tag(list(model.parameters()) + list(model.buffers()), "weights/other")
    tracker.tag(list(run.ref.parameters()) + list(run.ref.buffers()), "reference/other")
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: tracker.tag([p.grad], "gradients/other"))
    metrics = {}
    with tracker, owners(stack, run.accel, tagger(tracker, dims)), scripted(tok, script), \
            as_on_gpu(position_bytes):
        for step in range(steps):
            tracker.peaks, shapes = {}, {}
            tracker.tag(
                [s for st in run.opt.state.values()
                 for s in st.values() if torch.is_tensor(s)], "optimizer/other")
            with contextlib.nullcontext() if every_mini_batch else one_mini_batch(shapes), \
                    phases(tracker, run, shapes, virtual):
                metrics = tt.train_step(cfg, run, step)
    return {"peaks": tracker.peaks, "shapes": shapes, "metrics": metrics}

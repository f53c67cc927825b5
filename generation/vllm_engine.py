"""vLLM as the rollout engine (Protocol.engine = "vllm"): the same keyed draws, vLLM's batching,
paged KV cache and kernels (DESIGN.md section 11, "The vLLM engine").

A VLLMEngine holds one in-process vllm.LLM per training rank (colocated with the trainer, weights
synced from the policy after each update). generation/engine.generate_turn hands it a turn's rows
(generation/rows.py: context, turn key, budget, TurnStart) and gets back a Generation per row, so
every factual turn, twin, token fork, Monte Carlo continuation and baseline branch of rollout.py
goes through it unchanged.

Exact by construction. Every request is sent with temperature 0 and `extra_args = {"twice": tag}`;
a logits processor finds the tag's Row, brings it up to the request's output tokens (catch_up:
rows.advance's text-line state) and draws the next token with the project's own
sampler.keyed_draw at rows.noise(row) (key, position in the turn, banned token), then leaves that
one token finite (draw), so vLLM's greedy pick is the keyed draw. Positions count within the turn
(each turn its own request), so the noise is the cached engine's whatever the context, batch,
order or cache. vLLM's own seeded sampler keys by absolute position and could not couple twins.
Stops: the processor applies the project's StopRule (generation/stops.py) to each token; a row
whose text completed `</search>` or `</answer>` is made to draw EOS next (a stop token of the
request), which the host drops; EOS and the budget end a request inside vLLM. The host re-applies
the rule to the returned tokens and checks each against the processor's own draw. Log-probs and
entropies are the draw's, recorded by the processor (the trainer recomputes its log-probs as
always).

Two model runners, one core. vLLM 0.32 runs a logits processor through one of two interfaces:
its V1 model runner's (requests by batch index, each with its list of output tokens: the CPU
backend's runner, where the engine is tested against vLLM itself) and Model Runner V2's (requests
by slot; tokens in the runner's slot buffers; vLLM's default on GPUs). KeyedProcessor and
KeyedProcessorV2 differ only in how they find a request's new tokens; catch_up and draw are
shared. The engine asks for the runner of `runner` (VLLM_USE_V2_MODEL_RUNNER), reads the one vLLM
picks for its arguments before anything loads, and hands vLLM that runner's processor; a refusal
stops the start in seconds with a message naming the runner and `--engine=cached`.

It knows nothing of the trainer beyond the policy's weights and the GPU memory free when it
starts (startup_share), and on GPUs it runs on cuda:0 only (first_gpu_only).

Deviations (DESIGN.md section 13; `# DEVIATION V<n>:` where they act):
  V1. A stop string costs one more decode step (the forced EOS, dropped), as vLLM ends a request
      only at a stop token, a stop string or its budget; vLLM's own stop strings would detokenize
      with its copy of the tokenizer, not the project's rule.
  V2. Logits come from vLLM's kernels: equal to the transformers model's up to float rounding, so a
      draw at an exact near-tie could differ from the cached engine (none did in the tests).
  V3. The model runner: the V1 runner by default (its processor is tested against vLLM itself, on
      the CPU backend, which runs V1's code); V2's processor is tested against a faked V2 batch
      built from vLLM's own runner state, not yet on a GPU.
"""
import contextlib
import itertools
import os
import types
from dataclasses import dataclass, field

import torch

from generation.rows import advance, make_rows, noise
from generation.stops import stop_rule
from sampler import _signed, keyed_draw

# tag -> Request: the rows of the generate call in flight, read by the processor (in-process
# engine: the processor runs in this process)
PENDING = {}
_TAGS = itertools.count(1)
RUNNERS = {"v1": "0", "v2": "1"}  # the engine's runner -> VLLM_USE_V2_MODEL_RUNNER


@dataclass
class Request:
    """One row of a turn call as the processor sees it: the Row (ids, text-line state, records),
    the draw's settings, the stop rule, and what the processor drew at each position."""
    row: object
    settings: tuple          # (temperature, top_k, top_p, fused)
    rule: object             # generation/stops.py StopRule
    eos: int                 # the stop token forced after a stop string
    drawn: dict = field(default_factory=dict)   # position in the turn -> token drawn
    forced: int = -1         # position of the forced EOS (-1: none)

    @property
    def held(self) -> int:
        """How many of vLLM's output tokens the row holds (its turn's tokens past the given)."""
        return len(self.row.ids) - self.row.given


def catch_up(req, new):
    """Bring req's row up to its request: append and advance by `new` (vLLM's output tokens past
    req.held), drop records of draws vLLM discarded (a chunked prefill's), and note whether its
    text has just completed a stop string."""
    r = req.row
    for tok in new:
        r.ids.append(tok)
        advance(r, tok)
        if req.rule.reason(r, tok) == "stop" and len(r.ids) < r.budget:
            req.forced = len(r.ids)
    del r.logprobs[len(r.ids):], r.entropy[len(r.ids):]


def draw(logits, picks):
    """Overwrite each picked row of logits (B, V) float32 with its keyed draw: 0 at the drawn
    token, -inf elsewhere. picks: [(logits row, Request)], each caught up."""
    forced = [(i, q) for i, q in picks if q.forced == len(q.row.ids)]
    keyed = [(i, q) for i, q in picks if q.forced != len(q.row.ids)]
    for settings in {q.settings for _, q in keyed}:
        group = [(i, q) for i, q in keyed if q.settings == settings]
        idx = torch.tensor([i for i, _ in group], device=logits.device)
        keys, pos, ban = zip(*(noise(q.row) for _, q in group))
        temperature, top_k, top_p, fused = settings
        token, logprob, entropy = keyed_draw(
            logits.index_select(0, idx).float(),
            torch.tensor([_signed(k) for k in keys], device=logits.device),
            torch.tensor(pos, device=logits.device), temperature, top_k, top_p, fused,
            ban=torch.tensor(ban, device=logits.device) if max(ban) >= 0 else None)
        for (_, q), tok, lp, ent in zip(group, token.tolist(), logprob.tolist(), entropy.tolist()):
            q.drawn[len(q.row.ids)] = tok
            q.row.logprobs.append(lp)
            q.row.entropy.append(ent)
        _one_finite(logits, idx, token)
    if forced:
        # DEVIATION V1: a stop string ends the turn one draw later, at a forced EOS (dropped)
        idx = torch.tensor([i for i, _ in forced], device=logits.device)
        _one_finite(logits, idx, torch.tensor([q.eos for _, q in forced], device=logits.device))
    return logits


def _one_finite(logits, idx, token):
    logits.index_fill_(0, idx, float("-inf"))
    logits[idx, token] = 0.0


_PROCESSORS = {}


def processor_class(runner: str):
    """The keyed processor for vLLM's model runner `runner` ("v1" or "v2"), built on first use
    (vLLM is imported only by runs that ask for it)."""
    if runner not in _PROCESSORS:
        _PROCESSORS[runner] = {"v1": _v1_class, "v2": _v2_class}[runner]()
    return _PROCESSORS[runner]


def _v1_class():
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class KeyedProcessor(LogitsProcessor):
        """Keyed Gumbel-max draws for requests with extra_args["twice"], through the V1 runner's
        interface (vllm/v1/sample/logits_processor/interface.py): requests by batch index, each
        with the list of its output tokens that vLLM keeps growing. Others pass untouched."""

        def __init__(self, vllm_config, device, is_pin_memory):
            self.reqs = {}  # batch index -> (Request, its output token list)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update):
            def claim(params, prompt_ids, out):
                tag = (params.extra_args or {}).get("twice")
                return None if tag is None else (PENDING[tag], out)
            process_dict_updates(self.reqs, batch_update, claim)

        def apply(self, logits):
            if not self.reqs:
                return logits
            for req, out in self.reqs.values():
                catch_up(req, out[req.held:])
            return draw(logits, [(i, req) for i, (req, _) in self.reqs.items()])

    return KeyedProcessor


def _v2_class():
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

    class KeyedProcessorV2(LogitsProcessor):
        """The same draws through Model Runner V2's interface
        (vllm/v1/worker/gpu/sample/logits_processor/interface.py): requests by slot, claimed in
        add_request (slots are reused: each claim replaces the slot's last), their tokens read
        from the runner's slot buffers (new_tokens). Others pass untouched."""

        def __init__(self, vllm_config, req_states):
            self.state = req_states  # LogitsProcRequestState: read only
            self.reqs = {}           # slot -> Request

        def add_request(self, req_idx, sampling_params) -> bool:
            tag = (sampling_params.extra_args or {}).get("twice")
            self.reqs.pop(req_idx, None)
            if tag is not None:
                self.reqs[req_idx] = PENDING[tag]
            return tag is not None

        def apply(self, logits, ctx):
            slots = ctx.idx_mapping_np.tolist()  # batch position -> slot, on the host
            picks = [(i, self.reqs[s]) for i, s in enumerate(slots) if s in self.reqs]
            if not picks:
                return logits
            # speculative decoding gives a request a row per draft token; the engine sets none
            assert logits.shape[0] == len(slots), \
                f"KeyedProcessorV2: {logits.shape[0]} logits rows for {len(slots)} requests"
            ours = [slots[i] for i, _ in picks]
            for (_, req), new in zip(picks, new_tokens(self.state, ours, [q for _, q in picks])):
                catch_up(req, new)
            return draw(logits, picks)

    return KeyedProcessorV2


def new_tokens(state, slots, reqs) -> list:
    """Model Runner V2: each slot's output tokens past its Request's `held`. The runner keeps a
    request's prompt, then its committed outputs, in all_token_ids[slot] up to total_len[slot]
    (vllm/v1/worker/gpu/states.py; post_update appends each sampled token); prompt_len is on the
    host. One gather and two read-backs for the whole batch."""
    dev = state.total_len.gpu.device
    ends = state.total_len.gpu[torch.tensor(slots, device=dev)].tolist()
    starts = [int(state.prompt_len.np[s]) + q.held for s, q in zip(slots, reqs)]
    for s, a, b, q in zip(slots, starts, ends, reqs):
        assert a <= b, f"turn key {q.row.key}: slot {s} holds {b} tokens, the row {a}"
    rows = [s for s, a, b in zip(slots, starts, ends) for _ in range(a, b)]
    cols = [c for a, b in zip(starts, ends) for c in range(a, b)]
    flat = state.all_token_ids.gpu[torch.tensor(rows, dtype=torch.long, device=dev),
                                   torch.tensor(cols, dtype=torch.long, device=dev)].tolist()
    cuts = list(itertools.accumulate([0] + [b - a for a, b in zip(starts, ends)]))
    return [flat[i:j] for i, j in zip(cuts, cuts[1:])]


def finish(req, out, reason):
    """The Generation fields (ids, logprobs, entropy, stop) of a finished request from vLLM's
    output tokens: the forced EOS dropped, every token checked against the processor's draw and
    the stop rule re-applied on the host."""
    r = req.row
    out = list(out)
    if req.forced >= 0:
        assert req.forced == r.given + len(out) - 1 and out[-1] == req.eos, \
            f"turn key {r.key}: vLLM went on past a forced stop"
        out = out[:-1]
    ids, stop = r.ids[:r.given] + out, None
    for k in range(r.given, len(ids)):
        assert req.drawn.get(k) == ids[k], \
            f"turn key {r.key}: vLLM returned token {ids[k]} at {k}, the keyed draw was " \
            f"{req.drawn.get(k)}"
        stop = req.rule.reason(types.SimpleNamespace(ids=ids[:k + 1], budget=r.budget), ids[k])
        if stop is not None:
            assert k == len(ids) - 1, f"turn key {r.key}: the stop rule ends the turn at {k}, " \
                                      f"vLLM at {len(ids) - 1}"
    if stop is None:
        raise RuntimeError(f"turn key {r.key}: vLLM ended a turn ({reason}) that the stop rule "
                           f"does not end")
    n = len(ids)
    return ids, r.logprobs[:n], r.entropy[:n], stop


class VLLMEngine:
    """An in-process vllm.LLM over the policy's weights: generate_turn for
    generation/engine.generate_turn, ready(policy) before each rollout (wake on CUDA, the policy's
    current weights copied in), sleep() after it. `config` and `generation_config` are the
    policy's (methods read its vocab size, the engine its EOS).

    path: the policy's HF folder (config and first weights; ready() overwrites the weights).
    kv_gib: the KV pool (vLLM's kv_cache_memory_bytes; the memory ledger's `vllm_kv`, perf/ledger.py).
    max_num_seqs: rows decoded at once. batch_invariant: VLLM_BATCH_INVARIANT=1 (beta; process-wide
    kernel and NCCL settings), so a row's logits do not depend on its batch. runner: the model
    runner to ask vLLM for, "v1" or "v2" (`self.runner`: the one it runs)."""

    def __init__(self, path: str, model, max_context: int, kv_gib: float = 1.0,
                 max_num_seqs: int = 64, batch_invariant: bool = False, dtype=None,
                 runner: str = "v1"):
        assert runner in RUNNERS, f"vllm_runner={runner!r}: one of {', '.join(RUNNERS)}"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the processor reads PENDING
        # DEVIATION V3: V1 unless asked; vLLM may override the variable (start() reads its pick)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = RUNNERS[runner]
        if batch_invariant:
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        self.config, self.generation_config = model.config, model.generation_config
        device = next(model.parameters()).device
        self.cuda = device.type == "cuda"
        dtype = dtype or next(model.parameters()).dtype  # LoRA: its base's (the first parameter)
        args = dict(model=path, skip_tokenizer_init=True, dtype=str(dtype).split(".")[-1],
                    max_model_len=max_context, enable_prefix_caching=True, async_scheduling=False,
                    kv_cache_memory_bytes=int(kv_gib * 2 ** 30), max_num_seqs=max_num_seqs,
                    enable_sleep_mode=self.cuda, seed=0)
        if self.cuda:
            first_gpu_only(device)
            args["gpu_memory_utilization"] = startup_share(*torch.cuda.mem_get_info(device))
        with _hidden("llvmlite"):
            self.llm, self.runner = start(args, runner)
        self.vocab, self.asleep = self.config.vocab_size, False

    def generate_turn(self, tokenizer, episodes, proto) -> list:
        """generation/engine.generate_turn's contract: a Generation per episode."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from generation.engine import Generation, _special_ids, _fused
        eos, _ = _special_ids(self, tokenizer)
        rule = stop_rule(tokenizer, eos, self.vocab, "cpu")
        settings = (proto.temperature, proto.top_k, proto.top_p,
                    _fused(proto, torch.device("cuda" if self.cuda else "cpu")))
        rows = make_rows(episodes, tokenizer, proto)
        reqs = {next(_TAGS): Request(r, settings, rule, eos[0]) for r in rows}
        params = [SamplingParams(temperature=0.0, max_tokens=q.row.budget - q.row.given,
                                 stop_token_ids=eos, detokenize=False, extra_args={"twice": tag})
                  for tag, q in reqs.items()]
        PENDING.update(reqs)
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=r.ctx) for r in rows], params,
                                     use_tqdm=False)
        finally:
            for tag in reqs:
                PENDING.pop(tag, None)
        gens = []
        for q, o in zip(reqs.values(), outs):
            ids, lps, ents, stop = finish(q, o.outputs[0].token_ids, o.outputs[0].finish_reason)
            gens.append(Generation(ids, lps, ents, stop, q.row.key, q.row.given))
        return gens

    def ready(self, model):
        """The engine to sample this step's episodes from: awake, with the policy's weights."""
        self.wake()
        self.load(model)
        return self

    def load(self, model):
        """Copy the policy's weights in (LoRA: W + (alpha / r) B A merged) and drop the prefix
        cache (its KV came from the old weights)."""
        dtype = self.llm.llm_engine.vllm_config.model_config.dtype
        # cast one tensor at a time as vLLM reads it: no second copy of every weight at once
        weights = ((k, v.to(dtype)) for k, v in _plain_state(model).items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def sleep(self):
        """Free the weights' and KV pool's GPU memory for the update (CUDA sleep mode, level 1: the
        weights wait in host memory; a no-op elsewhere)."""
        if self.cuda and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self):
        """Shut the engine down while the run's process group still exists (its own groups are
        destroyed with it; at interpreter exit they would outlive accelerate's)."""
        self.llm.llm_engine.engine_core.shutdown()


def start(args: dict, runner: str):
    """(vllm.LLM over args, the runner it runs) with the keyed processor of the model runner vLLM
    picks for args: VllmConfig.use_v2_model_runner (vllm/config/vllm.py), read off the config
    that args make before anything loads. VLLM_USE_V2_MODEL_RUNNER decides it unless a feature
    forces V2 (HiSparse, watermarking; the engine sets neither). A refusal by vLLM (V2 without
    Triton, as on a CPU; too little free memory) stops the start in seconds, with the fallback."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    picked = runner
    try:
        picked = "v2" if EngineArgs(**args).create_engine_config().use_v2_model_runner else "v1"
        if picked != runner:
            print(f"engine=vllm: vLLM picked Model Runner {picked.upper()} (vllm_runner={runner} "
                  f"asked); the engine follows it", flush=True)
        llm = LLM(**args, logits_processors=[processor_class(picked)])
    except ValueError as e:  # vLLM's refusals (pydantic's ValidationError is a ValueError)
        raise RuntimeError(refusal(picked, runner, str(e))) from e
    live = "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
    if live != picked:
        llm.llm_engine.engine_core.shutdown()
        raise RuntimeError(refusal(live, runner, f"its arguments resolved to Model Runner "
                                                 f"{picked.upper()}, whose processor it holds"))
    return llm, picked


def refusal(picked: str, asked: str, why: str) -> str:
    """The message of a start that cannot go on: the runner, why, and the ways around it."""
    other = "v1" if picked == "v2" else "v2"
    return (f"engine=vllm: vLLM 0.32 stopped at start-up on Model Runner {picked.upper()} "
            f"(vllm_runner={asked} asked): {why}\nRun with --engine=cached (the same keyed "
            f"draws), or try --vllm_runner={other}.")


def startup_share(free: int, total: int) -> float:
    """gpu_memory_utilization for vLLM's start-up check, nine tenths of the device's free share.
    vLLM 0.32 refuses to start when less than gpu_memory_utilization x total is free
    (vllm/v1/worker/utils.py request_memory), kv_cache_memory_bytes set or not; colocated with the
    trainer, its default 0.92 is not free. With the pool's bytes given, nothing else reads it."""
    return 0.9 * free / total


def first_gpu_only(device):
    """Stop if the policy is not on cuda:0. vLLM 0.32's in-process engine takes device
    torch.device("cuda") (vllm/config/device.py), so local rank 0 (uniproc_executor.py), cuda:0,
    and makes it the process's current device: on rank r > 0 it would share GPU 0."""
    if device.index not in (None, 0):
        raise RuntimeError(f"engine=vllm: the policy is on {device}, and vLLM 0.32's in-process "
                           f"engine would start on cuda:0 beside rank 0's. On several GPUs run "
                           f"with --engine=cached (the same keyed draws).")


@contextlib.contextmanager
def _hidden(prefix):
    """Modules named prefix* out of sys.modules meanwhile: vLLM 0.32's start-up scans every loaded
    module's objects (triton_utils/dispatcher.py) and fails on llvmlite's FFI library object
    (`vars(lib)` is not a dict), which bm25s loads through numba."""
    import sys
    held = {k: sys.modules.pop(k) for k in list(sys.modules)
            if k == prefix or k.startswith(prefix + ".")}
    try:
        yield
    finally:
        sys.modules.update(held)


def _plain_state(model) -> dict:
    """The policy's weights as a plain transformers state dict (LoRA merged)."""
    if hasattr(model, "peft_config"):
        from infra import lora
        return lora.merged_state_dict(model)
    return {k: v.detach() for k, v in model.state_dict().items()}

"""vLLM as the rollout engine (Protocol.engine = "vllm"): the same keyed draws, vLLM's batching,
paged KV cache and kernels (DESIGN.md section 11, "The vLLM engine").

A VLLMEngine holds one in-process vllm.LLM per training rank (colocated with the trainer, weights
synced from the policy after each update). generation/engine.generate_turn hands it a turn's rows
(generation/rows.py: context, turn key, budget, TurnStart) and gets back a Generation per row, so
every factual turn, twin, token fork, Monte Carlo continuation and baseline branch of rollout.py
goes through it unchanged.

Exact by construction. Every request is sent with temperature 0 and `extra_args = {"twice": tag}`;
a logits processor (KeyedProcessor, vLLM's V1 interface) finds the tag's Row, brings it up to the
request's output tokens (rows.advance: text-line state) and draws the next token with the project's
own sampler.keyed_draw at rows.noise(row) (key, position in the turn, banned token), then leaves
that one token finite, so vLLM's greedy pick is the keyed draw. Positions count within the turn
(each turn its own request), so the noise is the cached engine's whatever the context, batch,
order or cache. vLLM's own seeded sampler keys by absolute position and could not couple twins.
Stops: the processor applies the project's StopRule (generation/stops.py) to each token; a row
whose text completed `</search>` or `</answer>` is made to draw EOS next (a stop token of the
request), which the host drops; EOS and the budget end a request inside vLLM. The host re-applies
the rule to the returned tokens and checks each against the processor's own draw. Log-probs and
entropies are the draw's, recorded by the processor (the trainer recomputes its log-probs as
always).

Deviations (DESIGN.md section 13; `# DEVIATION V<n>:` where they act):
  V1. A stop string costs one more decode step (the forced EOS, dropped), as vLLM ends a request
      only at a stop token, a stop string or its budget; vLLM's own stop strings would detokenize
      with its copy of the tokenizer, not the project's rule.
  V2. Logits come from vLLM's kernels: equal to the transformers model's up to float rounding, so a
      draw at an exact near-tie could differ from the cached engine (none did in the tests).
  V3. The V1 model runner: the processor is written to the interface vLLM runs on a CPU, where it
      is tested; on GPUs vLLM 0.32 defaults to Model Runner V2, whose processor interface differs,
      so the engine sets VLLM_USE_V2_MODEL_RUNNER=0 and refuses to start on V2.
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


def catch_up(req, out):
    """Bring req's row up to the request's output tokens `out` (a list vLLM keeps growing): append
    and advance by the new ones, drop records of draws vLLM discarded (a chunked prefill's), and
    note whether its text has just completed a stop string."""
    r = req.row
    new = list(out[len(r.ids) - r.given:])
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


_PROCESSOR = []


def processor_class():
    """KeyedProcessor, a vLLM V1 logits processor over PENDING's requests (built on first use:
    vLLM is imported only by runs that ask for it)."""
    if _PROCESSOR:
        return _PROCESSOR[0]
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class KeyedProcessor(LogitsProcessor):
        """Keyed Gumbel-max draws for requests with extra_args["twice"]; others pass untouched."""

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
                catch_up(req, out)
            return draw(logits, [(i, req) for i, (req, _) in self.reqs.items()])

    _PROCESSOR.append(KeyedProcessor)
    return KeyedProcessor


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
    kernel and NCCL settings), so a row's logits do not depend on its batch."""

    def __init__(self, path: str, model, max_context: int, kv_gib: float = 1.0,
                 max_num_seqs: int = 64, batch_invariant: bool = False, dtype=None):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the processor reads PENDING
        # DEVIATION V3: the V1 model runner, the one the processor is written and tested for
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        if batch_invariant:
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        from vllm import LLM
        self.config, self.generation_config = model.config, model.generation_config
        self.cuda = next(model.parameters()).is_cuda
        dtype = dtype or next(model.parameters()).dtype  # LoRA: its base's (the first parameter)
        with _hidden("llvmlite"):
            self.llm = LLM(model=path, skip_tokenizer_init=True, dtype=str(dtype).split(".")[-1],
                           max_model_len=max_context, enable_prefix_caching=True,
                           async_scheduling=False, kv_cache_memory_bytes=int(kv_gib * 2 ** 30),
                           max_num_seqs=max_num_seqs, logits_processors=[processor_class()],
                           enable_sleep_mode=self.cuda, seed=0)
        if self.llm.llm_engine.vllm_config.use_v2_model_runner:
            raise RuntimeError("vLLM chose Model Runner V2, whose logits processors differ from "
                               "the V1 interface KeyedProcessor implements")
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

"""The decode cache: one preallocated KV cache whose slots the decode rows own, written in place,
and the decode step over it with fixed shapes, so a GPU can replay it as a CUDA graph
(DESIGN.md section 11).

SlotCache holds keys and values (layers, slots, kv heads, length, head dim) in one dtype and, for
models whose logits are the LM head of the final norm, the final hidden state at every position
(slots, length, hidden). Slot s holds one row's sequence at positions 0..pos[s] - 1
(position = index), so a step writes one position per row in place and attends through a mask
(key j visible iff j <= pos): nothing is concatenated, and rows join, fork, move or leave by
copying their own positions only. cache_bytes is its size, for the memory ledger.

Decoder is the device half of the decode loop: per-slot state (next token, position, turn key,
position in the turn, budget, live flag, stop-automaton state), the step (forward, keyed draw, stop
decision as table look-ups) and a ring of the last steps' records that the host reads back every
few steps, not every token. On CUDA with graphs=True each (rows, width) shape is run once eagerly,
then captured and replayed.

It knows no tokenizer, episode or stop string: generation/engine.py builds the tables, chooses
which row lives in which slot and reads the records.

Deviation (DESIGN.md section 13; `# DEVIATION P8:` where it acts):
  P8. On CUDA in bf16 a row's logits depend, at rounding level, on the step's shape (graph or eager,
      rows, width): a near-tie can go another way than in the generate path; on the CPU in float32
      every test gives equal tokens.
"""
import torch

from sampler import keyed_draw, line_keys


def _kv_shape(config):
    """(layers, kv heads, head dim) of a transformers decoder config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def cache_bytes(slots: int, length: int, config, dtype, hidden: bool = True) -> int:
    """Bytes of a SlotCache: keys and values of `slots` rows of `length` positions for a model
    `config` in `dtype`, plus the final hidden states when hidden (rows that read logits off stored
    states need them). The engine allocates length = max_context + 1 (a stopped row writes its
    unused next position). At Qwen2.5-3B, 128 slots, 4097 positions, bf16: 19.3 GB of
    keys/values + 2.1 GB of hidden states."""
    layers, kv_heads, head_dim = _kv_shape(config)
    size = torch.empty((), dtype=dtype).element_size()
    per_position = 2 * layers * kv_heads * head_dim + (config.hidden_size if hidden else 0)
    return slots * length * per_position * size


class SlotCache:
    """Preallocated keys/values (and hidden states); as a transformers cache (`update`) it writes
    the new position of rows [0, n) in place at their own positions and returns the first `width`
    positions of those slots (views)."""

    def __init__(self, config, slots: int, length: int, dtype, device, hidden: bool):
        layers, kv_heads, head_dim = _kv_shape(config)
        self.k = torch.zeros((layers, slots, kv_heads, length, head_dim), dtype=dtype,
                             device=device)
        self.v = torch.zeros_like(self.k)
        self.hid = (torch.zeros((slots, length, config.hidden_size), dtype=dtype, device=device)
                    if hidden else None)
        # no `dtype` attribute: accelerate's mixed-precision forward wrapper casts every output with
        # one (the cache is returned among the model's outputs) as if it were a tensor
        self.slots, self.length, self.kv_dtype = slots, length, dtype
        # the current forward's rows, set by Decoder
        self.n, self.width, self.pos, self.rows = 0, 0, None, None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.hid)
                   if t is not None)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """(n, H, 1, D) new keys/values -> all `width` cached ones of the n rows,
        (n, H, width, D) views."""
        k, v = self.k[layer_idx, :self.n], self.v[layer_idx, :self.n]
        k[self.rows, :, self.pos] = key_states[:, :, 0].to(self.kv_dtype)
        v[self.rows, :, self.pos] = value_states[:, :, 0].to(self.kv_dtype)
        return k[:, :, :self.width], v[:, :, :self.width]

    def copy(self, dst: int, src, n: int):
        """Slot dst's first n positions from src: a slot index, or a KVEntry
        (k, v (layers, H, >= n, D), hidden)."""
        if isinstance(src, int):
            k, v, hid = (self.k[:, src, :, :n], self.v[:, src, :, :n],
                         None if self.hid is None else self.hid[src, :n])
        else:
            k, v, hid = (src.k[:, :, :n], src.v[:, :, :n],
                         None if src.hidden is None else src.hidden[:n])
        self.k[:, dst, :, :n].copy_(k)
        self.v[:, dst, :, :n].copy_(v)
        if self.hid is not None and hid is not None:
            self.hid[dst, :n].copy_(hid)
        return n * self.position_bytes()

    def position_bytes(self) -> int:
        """Bytes of one position of one slot (keys and values of every layer, and the hidden
        state)."""
        per = self.k[:, 0, :, 0].numel() * 2 + (0 if self.hid is None else self.hid.shape[-1])
        return per * self.k.element_size()


def attention_mask(pos, width: int, impl: str, dtype):
    """(n, 1, 1, width) mask of rows whose next position is pos (n,): key j visible iff j <= pos.
    sdpa takes a boolean mask, eager attention an additive one."""
    visible = torch.arange(width, device=pos.device)[None, :] <= pos[:, None]
    if impl == "sdpa":
        return visible[:, None, None, :]
    return torch.zeros(visible.shape, dtype=dtype, device=pos.device).masked_fill_(
        ~visible, torch.finfo(dtype).min)[:, None, None, :]


class Decoder:
    """Per-slot decode state on the device, the fixed-shape step, and the ring of per-step records.

    Slot state: tok (next input token), pos (its position = cached positions), key and npos (the
    noise key and position of its next draw), turn (the key of its later draws: its turn key), step
    (the turn's tokens so far), budget, live (drawing), sstate (stop-automaton state), src (the slot
    whose logits it draws from: itself, or the slot it shares a first step with), ban (a token its
    next draw may not take, -1 none: a token fork's first draw) and line (its text line, with
    `newline` given: the text-line reading of keys, where a token holding a newline moves the row to
    line_key(turn, line + 1) at position 0). Keys and positions are per row, so a row may start at
    any position or draw its first token with a key of its own. A row stops when its token completes
    a stop string per the automaton tables (next_state, hit: (Q * V,)), is EOS (is_eos (V,)) or
    reaches its budget: it freezes (draws no more, keeps writing its unused next position) until the
    host reads the records back and frees the slot.
    """

    def __init__(self, cache: SlotCache, slots: int, forward, tables, sample: dict, ring: int,
                 graphs: bool, impl: str, newline=None):
        (self.cache, self.slots, self.forward,
         self.sample, self.ring) = cache, slots, forward, sample, ring
        # newline: (V,) bool on the device, or None (the group reading)
        self.impl, self.newline = impl, newline
        self.next_state, self.hit, self.is_eos = tables
        self.vocab = self.is_eos.shape[0]
        dev, s = cache.k.device, slots
        zeros = lambda dtype=torch.long: torch.zeros(s, dtype=dtype, device=dev)  # noqa: E731
        (self.tok, self.pos, self.key, self.npos, self.turn, self.step, self.budget, self.sstate,
         self.line) = (zeros() for _ in range(9))
        self.ban = zeros() - 1
        # some slot's next draw has a ban: the step masks it (a step of its own shape)
        self.banning = False
        self.live = zeros(torch.bool)
        self.src = torch.arange(s, device=dev)
        # token, log-prob, entropy, live, stop
        self.rec = torch.zeros((ring, 5, s), dtype=torch.float64, device=dev)
        self.t = torch.zeros((), dtype=torch.long, device=dev)  # ring index of the next step
        # rows stopped since the last read-back
        self.stopped = torch.zeros((), dtype=torch.long, device=dev)
        self.ar = torch.arange(s, device=dev)
        self.graphs = graphs and dev.type == "cuda"
        self._graphs, self._warm, self._pool = {}, set(), None
        self._scratch, self._mail, self._seen = None, [], 0
        # per step: the stop count, copied to the host without waiting (stopped_so_far)
        if dev.type == "cuda":
            self._boxes = torch.zeros(ring, dtype=torch.long, pin_memory=True)
            self._events = [torch.cuda.Event() for _ in range(ring)]

    def set(self, slots: list, **values):
        """Host writes of slot state: values name -> list (one per slot), one host-to-device
        copy each."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.tok.device)
        for name, vals in values.items():
            buf = getattr(self, name)
            buf.index_copy_(0, idx,
                            torch.tensor(vals, dtype=buf.dtype).to(buf.device, non_blocking=True))
        self.banning |= max(values.get("ban", [-1])) >= 0

    def run(self, n_fwd: int, n_rows: int, width: int):
        """One step: rows [0, n_rows) draw; the model runs on rows [0, n_fwd) (the others read a
        leader's logits). With graphs each shape is captured on its second use (its first, eager,
        warms it up) and replayed after."""
        self._replay(n_fwd, n_rows, width)
        self.banning = False
        if self.tok.device.type == "cuda":
            i = len(self._mail)
            self._boxes[i].copy_(self.stopped, non_blocking=True)
            self._events[i].record()
            self._mail.append(i)

    def _replay(self, n_fwd: int, n_rows: int, width: int):
        if not self.graphs:
            return self._step(n_fwd, n_rows, width)
        shape = (n_rows, width, self.banning)
        if shape not in self._graphs:
            # warm-up on a side stream (torch.cuda.graph's requirement), a real step
            if shape not in self._warm:
                self._warm.add(shape)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._step(n_rows, n_rows, width)
                torch.cuda.current_stream().wait_stream(side)
                return
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(n_rows, n_rows, width)
            self._graphs[shape] = graph
        self._graphs[shape].replay()

    def _step(self, n_fwd: int, n: int, width: int):
        # DEVIATION P8: on CUDA in bf16 the logits depend at rounding level on (n, width) and the
        # kernels they pick, so a near-tie can go another way than in another step shape or the
        # generate path (DESIGN.md section 11).
        cache = self.cache
        cache.n, cache.width, cache.pos = n_fwd, width, self.pos[:n_fwd]
        cache.rows = self.ar[:n_fwd]
        mask = attention_mask(cache.pos, width, self.impl, cache.kv_dtype)
        # logits (n_fwd, V) float32, hidden (n_fwd, 1, hidden) or None
        logits, hidden = self.forward(self.tok[:n_fwd, None], mask, cache.pos[:, None], cache)
        if hidden is not None and cache.hid is not None:
            cache.hid[cache.rows, cache.pos] = hidden[:, 0].to(cache.kv_dtype)
        live = self.live[:n]
        logits = logits.index_select(0, self.src[:n])
        token, logprob, entropy = keyed_draw(
            logits, self.key[:n], self.npos[:n], scratch=self._buffers(logits),
            ban=self.ban[:n] if self.banning else None, **self.sample)
        cell = self.sstate[:n] * self.vocab + token
        stop = live & (self.hit[cell] | self.is_eos[token] | (self.step[:n] + 1 >= self.budget[:n]))
        record = torch.stack([token.double(), logprob.double(), entropy.double(), live.double(),
                              stop.double()])
        self.rec[:, :, :n].index_copy_(0, self.t.view(1), record[None])
        self.t.add_(1)
        self.stopped.add_(stop.sum())
        self.sstate[:n] = torch.where(live, self.next_state[cell], self.sstate[:n])
        self.tok[:n] = torch.where(live, token, self.tok[:n])
        self.pos[:n] += live
        self.step[:n] += live
        if self.newline is None:
            # a row's next draws: its turn key, in order
            self.key[:n] = torch.where(live, self.turn[:n], self.key[:n])
            self.npos[:n] += live
        else:  # text-line keys: a token holding a newline starts the next line, at position 0
            ends = live & self.newline[token]
            self.line[:n] += ends
            self.key[:n] = torch.where(live, line_keys(self.turn[:n], self.line[:n]), self.key[:n])
            self.npos[:n] = torch.where(ends, 0, self.npos[:n] + live)
        # a ban is its row's first draw's only (run() lowers the flag, outside any graph)
        if self.banning:
            self.ban[:n] = torch.where(live, -1, self.ban[:n])
        self.live[:n] = live & ~stop

    def _buffers(self, logits):
        """Eager CPU: reused (n, V) scratch for the race (page faults otherwise); graphs and
        compiled draws: none."""
        if self.graphs or self.sample.get("fused") or self.sample.get("temperature") == 0:
            return None
        if self._scratch is None or self._scratch[0].shape[0] < logits.shape[0]:
            shape, dev = (self.cache.slots, logits.shape[1]), logits.device
            self._scratch = (torch.empty(shape, device=dev),
                             torch.empty(shape, dtype=torch.long, device=dev),
                             torch.empty(shape, dtype=torch.long, device=dev),
                             torch.empty(shape, device=dev))
        return tuple(buf[:logits.shape[0]] for buf in self._scratch)

    def move(self, dst: list, src: list):
        """Slots dst take the state of slots src (the host copies their cache positions)."""
        dst, src = (torch.tensor(x, dtype=torch.long, device=self.tok.device) for x in (dst, src))
        for buf in (self.tok, self.pos, self.key, self.npos, self.turn, self.step, self.budget,
                    self.sstate, self.live, self.ban, self.line):
            buf.index_copy_(0, dst, buf.index_select(0, src))
        self.src.index_copy_(0, dst, dst)

    def stopped_so_far(self) -> int:
        """Rows stopped since the last read-back, as far as the host can know without waiting:
        exact on the CPU; on CUDA the count as of the newest step the device has finished (copied
        asynchronously after each step)."""
        if self.tok.device.type != "cuda":
            return int(self.stopped)
        done = [i for i in self._mail if self._events[i].query()]
        if done:
            self._seen = int(self._boxes[done[-1]])
        return self._seen

    def read(self, steps: int, n: int):
        """(steps, 5, n) float64 records of the last `steps` steps of slots [0, n), on the host
        (the one sync), and a fresh ring."""
        out = self.rec[:steps, :, :n].cpu()
        self.t.zero_()
        self.stopped.zero_()
        self._mail, self._seen = [], 0
        return out

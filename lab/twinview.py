"""One page per training step: every factual line of the step's batch, its twins beside it, each token coloured by
the advantage training gave it (`python rollout.py replay --run DIR --step N --html FILE`; lab/replay.py replays the
step and calls `page`).

What the page shows, per prompt and line: the turns (think, query or answer, the retrieved documents folded when
long), the reward U and A_traj; each sampled token coloured by its final advantage (A_traj plus the twin term, or the
oracle's clip(A* / sigma_hat)), its value on hover; observation tokens grey (the loss masks them). Per branched
decision: q_t, the Horvitz-Thompson credit A_hat_t and the term it adds, and each twin: y', its continuation beside
the factual one turn by turn, the first token where the two part marked (the same position `replay` prints), U', D
and its kind (rollout, self-twin, same-evidence shortcut). With the oracle, A* and its SE per turn. Filters work
from the file alone: only discordant twins, only failed lines, one prompt; a link can set them (FILE#uid=U&disc&open:
one prompt, its discordant twins, open).

The file is self-contained: inline CSS and JS, no font, image or script from anywhere else; it opens from disk. It
knows no model or run folder: episodes, advantages and twins in, HTML out.
"""
import html
import os

import numpy as np

import credit

METHODS = ("grpo", "twice", "independent", "oracle")  # the credit the page can show
FOLD = 40  # observation tokens shown inline; longer observations fold
BINS = 8  # colour steps per sign


def divergence(ep, tw):
    """The first response position at which a twin's tokens part from its factual episode's, from the turn it
    changed on (None: they never part, as a self-twin's)."""
    start, mine, theirs = ep.turns[tw.turn].start, ep.ids, tw.twin.ids
    for p in range(start, min(len(mine), len(theirs))):
        if mine[p] != theirs[p]:
            return p
    return None if len(mine) == len(theirs) else min(len(mine), len(theirs))


def check_writable(path: str):
    """ValueError naming what to do when the page could not be written there (checked before the replay)."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise ValueError(f"--html {path}: a folder; give a file name, e.g. {os.path.join(path, 'step.html')}")
    if not os.path.isdir(folder):
        raise ValueError(f"--html {path}: the folder {folder} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK) or os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"--html {path}: not writable here; give a path you can write, e.g. /tmp/step.html")


def write(path: str, text: str) -> int:
    """The page written atomically (a temporary file beside it, then renamed); returns its size in bytes."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return os.path.getsize(path)


# --- the tokens ---

def colour(a: float, vmax: float) -> str:
    """The class of an advantage: n1..nBINS below zero, p1..pBINS above, z at zero (vmax: the darkest)."""
    if a == 0 or not np.isfinite(a):
        return "z"
    k = min(BINS, 1 + int(abs(a) / vmax * BINS)) if vmax > 0 else BINS
    return f"{'p' if a > 0 else 'n'}{k}"


def tokens(tok, ids, lo: int, hi: int, adv=None, vmax: float = 1.0, mark=None) -> str:
    """Sampled tokens ids[lo:hi], one <t> each, in runs of one colour (adv[p]: the advantage of position p; None:
    not trained, as a twin's); `mark`: the position where a twin parts from its factual line."""
    out, run, key = [], [], None
    for p in range(lo, hi):
        a = None if adv is None else float(adv[p])
        k = "u" if a is None else colour(a, vmax)
        if (k, a) != key and run:
            out.append(span(key, run))
            run = []
        key = (k, a)
        cls = ' class="d"' if p == mark else ""
        run.append(f'<t data-p="{p}"{cls}>{text(tok.decode([ids[p]]))}</t>')
    if run:
        out.append(span(key, run))
    return "".join(out)


def text(s: str) -> str:
    """Escaped for HTML; a carriage return as a character reference (a parser turns a raw one into a newline)."""
    return html.escape(s).replace("\r", "&#13;")


def span(key, run) -> str:
    k, a = key
    title = "not trained (a twin's token)" if a is None else f"A = {a:+.4f}"
    return f'<span class="{k}" title="{title}">{"".join(run)}</span>'


def observation(tok, ep, turn) -> str:
    """A turn's observation, grey; folded when longer than FOLD tokens."""
    n = turn.obs_end - turn.obs_start
    if n <= 0:
        return ""
    body = text(tok.decode(ep.ids[turn.obs_start:turn.obs_end]))
    docs = f" (documents {', '.join(map(html.escape, turn.doc_ids))})" if turn.doc_ids else ""
    if n <= FOLD:
        return f'<span class="o" title="observation: no loss{docs}">{body}</span>'
    return f'<details class="o"><summary>observation, {n} tokens{docs}</summary><span class="o">{body}</span></details>'


def turn_block(tok, ep, t: int, adv=None, vmax=1.0, mark=None, note="") -> str:
    turn = ep.turns[t]
    act = f"{turn.action} {html.escape(repr(turn.content))}" if turn.action else "invalid"
    return (f'<div class="turn" data-t="{t}"><div class="th">turn {t} · {act}{note}</div>'
            f'<div class="tk">{tokens(tok, ep.ids, turn.start, turn.end, adv, vmax, mark)}'
            f'{observation(tok, ep, turn)}</div></div>')


# --- the page ---

def page(cfg, run_dir: str, step: int, policy: str, batches: list, tok) -> str:
    """The step's page from every rank's replayed batch (lab/replay.rank_batch's: episodes, adv, stats,
    estimates)."""
    vmax = max([float(np.quantile(np.abs(b.adv[b.adv != 0]), 0.98)) for b in batches
                if b.adv is not None and np.any(b.adv != 0)] + [1e-6])
    body, prompts, counts = [], [], {"episodes": 0, "twins": 0, "discordant": 0, "failed": 0}
    for b in batches:
        b.a_traj = credit.grpo_advantages([ep.reward for ep in b.episodes],
                                          np.arange(len(b.episodes)) // cfg.group_size, cfg.adv_eps)
        twins = b.stats.get("twins", [])
        terms = decision_credit(b.stats.get("credit"), cfg)
        a_star = oracle_turns(b.episodes, b.estimates)
        rows = twin_rows(b, twins)
        for g in range(0, len(b.episodes), cfg.group_size):
            group = b.episodes[g:g + cfg.group_size]
            prompts.append((group[0].uid, group[0].question))
            lines = [line_block(tok, cfg, ep, g + n, b, twins, terms, a_star, rows, vmax)
                     for n, ep in enumerate(group)]
            body.append(f'<section class="prompt" data-uid="{group[0].uid}"><h2>uid {group[0].uid}: '
                        f'{html.escape(group[0].question)}</h2><p class="gold">gold: '
                        f'{html.escape(" | ".join(map(str, group[0].golden_answers)))}</p>{"".join(lines)}</section>')
        counts["episodes"] += len(b.episodes)
        counts["failed"] += sum(ep.reward < 1 for ep in b.episodes)
        counts["twins"] += len(twins)
        counts["discordant"] += sum(tw.diff != 0 for tw in twins)
    return head(cfg, run_dir, step, policy, counts, vmax, prompts) + "".join(body) + f"<script>{SCRIPT}</script>" \
        "</body></html>\n"


def decision_credit(table, cfg) -> dict:
    """{(episode index, turn): (q_t, A_hat_t, the twin term omega clip(A_hat_t / sigma_hat, +-cap))}."""
    if not table:
        return {}
    term = cfg.omega * np.clip(table["a_hat"] / table["sigma"], -cfg.twin_cap, cfg.twin_cap) if cfg.twin_cap > 0 \
        else cfg.omega * table["a_hat"] / table["sigma"]
    return {tuple(d): (float(q), float(a), float(x)) for d, q, a, x in
            zip(table["index"], table["q"], table["a_hat"], term)}


def oracle_turns(episodes, est) -> dict:
    """{(episode index, turn): (A*, SE)} of the oracle's estimates, decision-major as oracle_credit makes them."""
    if est is None:
        return {}
    decisions = [(i, t) for i, ep in enumerate(episodes) for t in range(len(ep.turns))]
    return {d: (float(a), float(s)) for d, a, s in zip(decisions, est["a"], est["se"])}


def twin_rows(b, twins) -> dict:
    """{twin index: its row's advantages} when the twins were trained on as rows (twin_data: they follow the factual
    rows of the batch, in the twins' order)."""
    if b.adv is None or b.adv.shape[0] == len(b.episodes):
        return {}
    return {k: b.adv[len(b.episodes) + k] for k in range(len(twins))}


def line_block(tok, cfg, ep, i: int, b, twins, terms, a_star, rows, vmax) -> str:
    mine = [(k, tw) for k, tw in enumerate(twins) if (tw.twin.uid, tw.twin.line) == (ep.uid, ep.line)]
    adv = None if b.adv is None else b.adv[i, len(ep.prompt_ids):]
    turns = []
    for t in range(len(ep.turns)):
        note = ""
        if (i, t) in a_star:
            note = f" · A* {a_star[i, t][0]:+.3f} ± {a_star[i, t][1]:.3f}"
        if (i, t) in terms and terms[i, t][1] != 0:
            note += f" · twin term {terms[i, t][2]:+.3f}"
        turns.append(turn_block(tok, ep, t, adv, vmax, note=note))
    twin_html = "".join(twin_block(tok, cfg, ep, i, k, tw, terms, adv, rows.get(k), vmax) for k, tw in mine)
    disc = int(any(tw.diff != 0 for _, tw in mine))
    used = "" if traj_used(cfg) else " (not in A)"
    return (f'<div class="line" data-uid="{ep.uid}" data-line="{ep.line}" data-fail="{int(ep.reward < 1)}" '
            f'data-disc="{disc}"><h3>line {ep.line} · U {ep.reward:g} · answer {html.escape(repr(ep.answer))}'
            f' · A_traj {b.a_traj[i]:+.3f}{used} · {len(ep.turns)} turns · {len(mine)} twins</h3>'
            f'{"".join(turns)}{twin_html}</div>')


def traj_used(cfg) -> bool:
    """Whether A_traj is part of the tokens' advantage: GRPO's, TWICE's by default, the oracle's with oracle_traj."""
    return cfg.oracle_traj if cfg.method == "oracle" else cfg.traj_term or cfg.method == "grpo"


def twin_block(tok, cfg, ep, i: int, k: int, tw, terms, adv, row_adv, vmax) -> str:
    """One twin: its decision's q_t and credit, y', U', D, kind; the factual line and the twin turn by turn from
    the changed turn on, the token where they part marked in both."""
    q, a_hat, term = terms.get((i, tw.turn), (float("nan"), 0.0, 0.0))
    part = divergence(ep, tw)
    alt = tw.twin.turns[tw.turn] if tw.turn < len(tw.twin.turns) else None
    y = f"{alt.action} {html.escape(repr(alt.content))}" if alt is not None and alt.action else "invalid"
    kind = {"self": "self-twin: y' = y_t, D = 0 without a rollout",
            "same_evidence": "same-evidence shortcut: D = 0 without a rollout"}.get(tw.kind, "rolled out")
    fork = "" if tw.k is None else f" (token fork at token {tw.k} of the turn)"
    radv = None if row_adv is None else row_adv[len(ep.prompt_ids):]
    cols = []
    for who, rec, a in (("factual", ep, adv), ("twin", tw.twin, radv)):
        blocks = [turn_block(tok, rec, u, a, vmax, part) for u in range(tw.turn, len(rec.turns))]
        reward = f"U {ep.reward:g}" if who == "factual" else f"U' {tw.outcome:g}"
        cols.append(f'<div class="col"><h4>{who} · {reward}</h4>{"".join(blocks)}</div>')
    return (f'<details class="twin" data-turn="{tw.turn}" data-j="{tw.j}" data-d="{tw.diff:g}" data-q="{q!r}" '
            f'data-kind="{tw.kind}" data-div="{"" if part is None else part}"><summary>twin j={tw.j} at turn '
            f'{tw.turn}{fork} · y\' = {y} · q_t {q:.3f} · U\' {tw.outcome:g} · <b>D = {tw.diff:+g}</b> · A_hat '
            f'{a_hat:+.3f} (term {term:+.3f}) · {kind} · '
            f'{"never parts" if part is None else f"parts at token {part}"} · {tw.tokens} tokens</summary>'
            f'<div class="pair">{"".join(cols)}</div></details>')


def head(cfg, run_dir, step, policy, counts, vmax, prompts) -> str:
    knobs = f"method {cfg.method} · G {cfg.group_size} · {cfg.prompts_per_step} prompts"
    if cfg.method in ("twice", "independent"):
        knobs += (f" · omega {cfg.omega:g} · budget {cfg.twin_budget:g} ({cfg.budget_rule}) · K "
                  f"{cfg.twins_per_decision} · cap {cfg.twin_cap:g} · A_traj {'on' if cfg.traj_term else 'off'}")
    if cfg.method == "oracle":
        knobs += f" · M {cfg.oracle_rollouts} · A_traj {'on' if cfg.oracle_traj else 'off'}"
    legend = "".join(f'<span class="{c}">{lab}</span>' for c, lab in
                     [(f"n{k}", f"-{k * vmax / BINS:.2f}" if k in (BINS, 1) else "") for k in range(BINS, 0, -1)] +
                     [("z", "0")] + [(f"p{k}", f"+{k * vmax / BINS:.2f}" if k in (1, BINS) else "")
                                     for k in range(1, BINS + 1)])
    options = "".join(f'<option value="{u}">{u}: {html.escape(q[:60])}</option>' for u, q in prompts)
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>step {step} of {html.escape(run_dir)}</title>'
            f'<style>{STYLE}</style></head><body><header><h1>step {step} · {html.escape(run_dir)}</h1>'
            f'<p class="meta">{knobs} · policy {html.escape(policy)} · {counts["episodes"]} episodes '
            f'({counts["failed"]} failed) · {counts["twins"]} twins ({counts["discordant"]} discordant)</p>'
            f'<p class="legend">advantage of each sampled token: {legend} <span class="o">observation (no loss)</span>'
            f' <span class="u">twin token (not trained)</span> <t class="d">first token where a twin parts</t></p>'
            f'<p class="filters"><label><input type="checkbox" id="f-disc"> only discordant twins</label> '
            f'<label><input type="checkbox" id="f-fail"> only failed lines</label> <select id="f-prompt">'
            f'<option value="">every prompt</option>{options}</select> '
            f'<button id="f-open">open every twin</button></p></header>')


def _styles() -> str:
    shades = "".join(f".n{k}{{background:rgba(214,39,40,{k / BINS * 0.75:.3f})}}"
                     f".p{k}{{background:rgba(44,160,44,{k / BINS * 0.75:.3f})}}" for k in range(1, BINS + 1))
    return ("body{font:13px/1.45 system-ui,sans-serif;margin:0 1.2em;color:#222}header{position:sticky;top:0;"
            "background:#fff;border-bottom:1px solid #ccc;padding:.3em 0;z-index:1}h1{font-size:16px;margin:.2em 0}"
            "h2{font-size:14px;margin:1em 0 .2em}h3{font-size:12.5px;margin:.6em 0 .2em;color:#333}"
            "h4{font-size:12px;margin:.2em 0}.meta,.gold{color:#555;margin:.2em 0}.legend span,.legend t{padding:0 3px}"
            ".line{border-left:3px solid #ddd;padding-left:.6em;margin:.4em 0}.line[data-fail='0']{border-color:#2ca02c}"
            ".turn{margin:.15em 0}.th{font-size:11px;color:#666}.tk{white-space:pre-wrap;font-family:ui-monospace,"
            "monospace;font-size:12px}t{white-space:pre-wrap}.o,.o summary{color:#999}details.o{display:inline}"
            ".u{background:#eef}.z{background:#f4f4f4}t.d{outline:2px solid #d62728;background:#ffd}"
            "details.twin{margin:.3em 0 .3em 1.2em;border:1px solid #ddd;padding:.2em .4em}"
            "details.twin[data-d='0']{border-style:dashed}details.twin>summary{cursor:pointer;font-size:12px}"
            ".pair{display:grid;grid-template-columns:1fr 1fr;gap:.8em}[hidden]{display:none!important}" + shades)


STYLE = _styles()
SCRIPT = ("function apply(){const d=document.getElementById('f-disc').checked,f=document.getElementById('f-fail')"
          ".checked,p=document.getElementById('f-prompt').value;document.querySelectorAll('section.prompt')"
          ".forEach(s=>{s.hidden=p!==''&&s.dataset.uid!==p});document.querySelectorAll('div.line').forEach(l=>"
          "{l.hidden=(f&&l.dataset.fail!=='1')||(d&&l.dataset.disc!=='1')});document.querySelectorAll("
          "'details.twin').forEach(t=>{t.hidden=d&&t.dataset.d==='0'})}"
          "['f-disc','f-fail','f-prompt'].forEach(i=>document.getElementById(i).addEventListener('change',apply));"
          "function openAll(){document.querySelectorAll('details.twin:not([hidden])').forEach(t=>t.open=true)}"
          "document.getElementById('f-open').addEventListener('click',openAll);"
          # a link to a view: #disc, #fail, #uid=U, #open, joined by & (e.g. page.html#uid=123&disc&open)
          "location.hash.slice(1).split('&').forEach(h=>{if(h==='disc'||h==='fail')document.getElementById("
          "'f-'+h).checked=true;if(h.startsWith('uid='))document.getElementById('f-prompt').value=h.slice(4)});"
          "apply();if(location.hash.includes('open'))openAll();")

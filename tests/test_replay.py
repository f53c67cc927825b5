"""lab/replay.py (`python rollout.py replay`): a logged training episode and its twins come back token for token from
the checkpoint that rolled them out; a step without its checkpoint is refused naming those that exist; episodes.jsonl
is cut back on resume like metrics.jsonl."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from lab import replay
import train_twice as tt
from test_train import ROOT, tiny_cfg


def episodes(out, name="episodes.jsonl"):
    return [json.loads(line) for line in open(os.path.join(out, name))]


def test_replay_regenerates_the_logged_episodes_and_twins_token_for_token(tiny_world, tmp_path, capsys):
    out = str(tmp_path / "run")
    tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", "--save_every=1", "--log_episodes=2"))
    rows = episodes(out)
    assert [r["step"] for r in rows] == [0, 0, 1, 1] and any(r["twins"] for r in rows)
    first = next((r for r in rows if r["step"] == 0 and r["twins"]), rows[0])  # from the initial model (cfg.model)
    assert replay.replay(replay.Replay(run=out, step=0, uid=str(first["uid"]), line=first["line"], twins=True)) == 0
    text = capsys.readouterr().out
    assert "tokens identical to episodes.jsonl" in text and f"uid {first['uid']} line {first['line']}" in text
    assert text.count("=== twin at turn") == len(first["twins"]) and text.count("--- turn") == len(first["turns"])
    r = next(r for r in rows if r["step"] == 1 and r["twins"])  # from step_000001: after step 0's update
    t = r["twins"][0]["turn"]
    assert replay.replay(replay.Replay(run=out, step=1, uid=str(r["uid"]), line=r["line"], twin=t)) == 0
    text = capsys.readouterr().out
    assert "tokens identical to episodes.jsonl" in text and text.count("=== twin at turn") == 1
    assert f"=== twin at turn {t} (j=0)" in text and "D = U - U' = " in text

    tampered = dict(r, ids=r["ids"][:-1] + [r["ids"][-1] + 1])  # the check can fail: one logged token changed
    with open(os.path.join(out, "episodes.jsonl"), "w") as f:
        f.writelines(json.dumps(x if x is not r else tampered) + "\n" for x in rows)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "rollout.py"), "replay", "--run", out, "--step", "1",
                           "--uid", str(r["uid"]), "--line", str(r["line"])], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1 and "tokens DIFFER from episodes.jsonl" in proc.stdout, proc.stderr[-2000:]

    state_file = os.path.join(out, "step_000001", "run.json")
    state = json.load(open(state_file))
    state["config"]["method"] = "arpo"
    json.dump(state, open(state_file, "w"))
    with pytest.raises(ValueError, match="method arpo samples its own trees"):  # not the factual loop: refused
        replay.replay(replay.Replay(run=out, step=1, uid=str(r["uid"]), line=r["line"]))
    shutil.rmtree(os.path.join(out, "step_000001"))
    with pytest.raises(ValueError, match=r"step 1 has no checkpoint step_000001 .*checkpoints exist for steps 2;"):
        replay.replay(replay.Replay(run=out, step=1, uid=str(r["uid"]), line=r["line"]))
    with pytest.raises(ValueError, match="step 2 was not trained in this run"):  # step_000002 rolled out nothing
        replay.replay(replay.Replay(run=out, step=2, uid=str(r["uid"]), line=r["line"]))


def test_episodes_jsonl_is_cut_back_on_resume(tiny_world, tmp_path):
    out = str(tmp_path / "run")
    tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", "--save_every=1", "--log_episodes=1"))
    before = episodes(out)
    tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", "--save_every=1", "--log_episodes=1",
                     f"--resume={out}/step_000001"))
    assert [r["step"] for r in episodes(out)] == [0, 1] and episodes(out) == before  # step 1 again, identical
    assert [r["step"] for r in episodes(out, "episodes.jsonl.orphaned")] == [1]


def test_replay_regenerates_token_fork_twins_token_for_token(tiny_world, tmp_path, capsys):
    """twin_unit = token: the logged twins are forks (their token k logged), and replay brings each back token for
    token (its given first tokens, the forked token, the rest on the factual keys), through twin_credit's fork law."""
    out = str(tmp_path / "forks")
    tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", "--save_every=1", "--log_episodes=3",
                     "--twin_unit=token", "--log_tensorboard=false"))
    rows = [r for r in episodes(out) if r["twins"]]
    assert rows and all(isinstance(tw["k"], int) for r in rows for tw in r["twins"])
    for r in rows[:2]:
        assert replay.replay(replay.Replay(run=out, step=r["step"], uid=str(r["uid"]), line=r["line"],
                                           twins=True)) == 0
        text = capsys.readouterr().out
        assert "tokens identical to episodes.jsonl" in text and text.count(" token ") >= len(r["twins"])
    r = rows[0]
    tampered = dict(r, twins=[dict(r["twins"][0], ids=r["twins"][0]["ids"][:-1] + [r["twins"][0]["ids"][-1] + 1])] +
                    r["twins"][1:])  # one token of one logged twin changed: the check fails
    lines = episodes(out)
    with open(os.path.join(out, "episodes.jsonl"), "w") as f:
        f.writelines(json.dumps(tampered if x == r else x) + "\n" for x in lines)
    t = r["twins"][0]["turn"]
    assert replay.replay(replay.Replay(run=out, step=r["step"], uid=str(r["uid"]), line=r["line"], twin=t)) == 1

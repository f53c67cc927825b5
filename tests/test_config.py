"""infra/config.py: a value that would mislead or fail later is refused when it is read, naming the field."""
import pytest

import train_twice as tt


@pytest.mark.parametrize("argv,message", [
    (["--entropy_coef=nan"], "entropy_coef: expected a finite number, got 'nan'"),
    (["--kl_coef=1e400"], "kl_coef: expected a finite number, got '1e400'"),
    (["--lr=-inf"], "lr: expected a finite number"),
    (["--out_dir", "--steps=4"], "out_dir: the value '--steps=4' looks like a flag"),
    (["--out_dir=--steps=4"], "out_dir: the value '--steps=4' looks like a flag"),
    (["--weight_decay=-0.1"], r"weight_decay=-0.1 \(must be >= 0\)"),
    (["--temperature=1e-300"], r"temperature=1e-300 \(must be >= 0.001"),
])
def test_non_finite_flag_like_and_out_of_range_values_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        tt.parse_config(argv)


def test_a_preset_file_value_is_checked_the_same_way(tmp_path):
    preset = tmp_path / "p.cfg"
    preset.write_text("lr = 1e-4\nclip = nan\n")
    with pytest.raises(ValueError, match=rf"{preset}:2: clip: expected a finite number"):
        tt.parse_config([str(preset)])


def test_ordinary_values_still_parse():
    cfg = tt.parse_config(["--out_dir=runs/x", "--temperature=0.7", "--weight_decay=0", "--entropy_coef=1e-3"])
    assert (cfg.out_dir, cfg.temperature, cfg.weight_decay, cfg.entropy_coef) == ("runs/x", 0.7, 0.0, 1e-3)


def test_an_unknown_key_gets_the_closest_match_and_every_valid_key(tmp_path):
    with pytest.raises(ValueError, match=r"command line: unknown config key 'omgea' \(did you mean "
                                         r"'omega'\?\); valid keys: world, model, .*, tree_m, "):
        tt.parse_config(["--omgea=1"])
    with pytest.raises(ValueError, match=r"unknown config key 'group-size' \(did you mean "
                                         r"'group_size'\?\)"):
        tt.parse_config(["--group-size", "3"])
    preset = tmp_path / "p.cfg"
    preset.write_text("lr = 1e-4\nstpes = 3\n")
    with pytest.raises(ValueError, match=rf"{preset}:2: unknown config key 'stpes' \(did you mean "
                                         r"'steps'\?\)"):
        tt.parse_config([str(preset)])
    with pytest.raises(ValueError, match=rf"{tmp_path}/none.cfg: no such preset file"):
        tt.parse_config([str(tmp_path / "none.cfg")])

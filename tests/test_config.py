"""Config presets hold the analysis's numbers, and nonsense is refused naming the field."""
from __future__ import annotations

import dataclasses

import pytest

from nblib import config
from nblib.atomic import sha256_json
from nblib.errors import ConfigError, NblibError


def test_seed_t4_preset_holds_the_streaming_analysis_numbers():
    cfg = config.preset("seed_t4")
    m, r = cfg.model, cfg.run
    assert (m.image_size, m.patch, m.dim, m.layers, m.H_cycles, m.L_cycles) == (224, 16, 768, 2, 2, 3)
    assert (m.capsules, m.children, m.checksum_dim, m.tokens) == (12, 4, 32, 196)
    assert (r.batch_size, r.n_samples, r.workers) == (192, 1_907_747, 2)
    assert (r.consolidate_every, r.checkpoint_every) == (50, 200)


def test_t4_preset_keeps_the_seed_model_with_fewer_samples():
    seed, t4 = config.preset("seed_t4"), config.preset("t4")
    assert t4.model == seed.model
    assert t4.run.n_samples < seed.run.n_samples


def test_profiles_map_to_presets():
    assert config.for_profile("smoke").name == "smoke"
    assert config.for_profile("t4").name == "t4"
    assert config.for_profile("full").name == "seed_t4"


def test_unknown_preset_and_profile_are_refused_with_the_choices():
    with pytest.raises(ConfigError, match="seed_t4"):
        config.preset("huge")
    with pytest.raises(ConfigError, match="smoke, t4, full"):
        config.for_profile("laptop")


def test_configs_are_frozen():
    cfg = config.preset("smoke")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.batch_size = 3


@pytest.mark.parametrize("change, field, words", [
    ({"batch_size": 0}, "run.batch_size", ">= 1"),
    ({"batch_size": -4}, "run.batch_size", ">= 1"),
    ({"batch_size": 2.5}, "run.batch_size", "integer"),
    ({"batch_size": True}, "run.batch_size", "integer"),
    ({"n_samples": "100"}, "run.n_samples", "integer"),
    ({"capsules": 17}, "model.capsules", "1..16"),
    ({"image_size": 70}, "model.image_size", "multiple of the patch"),
    ({"heads": 3}, "model.dim", "heads"),
    ({"out_dtype": "bfloat16"}, "run.out_dtype", "float16"),
    ({"outputs": ("sketches", "logits")}, "run.outputs", "sketches"),
    ({"outputs": ()}, "run.outputs", "one or more"),
    ({"checkpoint_every": 5}, "run.checkpoint_every", "multiple"),
    ({"codec": "jpeg"}, "run.codec", "raw"),
    ({"workers": -1}, "run.workers", ">= 0"),
])
def test_nonsense_is_refused_naming_the_field_and_range(change, field, words):
    with pytest.raises(ConfigError) as err:
        config.preset("smoke").replace(**change)
    assert field in str(err.value) and words in str(err.value)
    assert isinstance(err.value, NblibError)


def test_unknown_field_is_refused():
    with pytest.raises(ConfigError, match="unknown config field 'batch'"):
        config.preset("smoke").replace(batch=3)


def test_replace_routes_knobs_to_model_and_run():
    cfg = config.preset("smoke").replace(batch_size=8, H_cycles=1, outputs=["sketches"])
    assert (cfg.run.batch_size, cfg.model.H_cycles, cfg.run.outputs) == (8, 1, ("sketches",))


def _fingerprint(cfg, *, model_only: bool = False) -> str:
    """sha256 of the config's fields (the name excluded): equal configs give equal prints."""
    d = cfg.to_dict()
    return sha256_json(d["model"] if model_only else {"model": d["model"], "run": d["run"]})


def test_fingerprint_changes_with_any_knob_but_not_the_name():
    cfg = config.preset("smoke")
    assert _fingerprint(cfg) == _fingerprint(cfg.replace(name="renamed"))
    assert _fingerprint(cfg) != _fingerprint(cfg.replace(batch_size=16))
    assert _fingerprint(cfg, model_only=True) == _fingerprint(cfg.replace(batch_size=16), model_only=True)


def test_dict_round_trip_gives_the_same_config():
    cfg = config.preset("t4")
    assert config.PipelineConfig.from_dict(cfg.to_dict()) == cfg


def test_table_lists_every_preset_side_by_side():
    text = config.table()
    assert "seed_t4" in text.splitlines()[0] and "smoke" in text.splitlines()[0]
    assert "1,907,747" in text


def test_a_seed_past_2_to_the_64_is_refused_with_the_range():
    """torch.manual_seed and numpy's SeedSequence take no seed >= 2**64: refuse it at the config, as the CLI does."""
    assert config.preset("smoke").replace(seed=2 ** 64 - 1).run.seed == 2 ** 64 - 1
    with pytest.raises(ConfigError, match=r"run.seed=18446744073709551616 is out of range.*2\*\*64 - 1"):
        config.preset("smoke").replace(seed=2 ** 64)

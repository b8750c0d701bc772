"""The model contract (nblib.models): specs, seeded builds, weights, named outputs, preprocessing, identity.

transformers models are built from small configs the tests write (hf:CLASS:config.json), so each
builds in well under a second; timm is faked in sys.modules (it does not import beside the CPU
torch pin here), which tests nblib's side of timm's API, not timm.
"""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from torch import nn

from nblib.errors import ConfigError, MissingDependency, ModelOutputError, ModelSpecError, WeightsError
from nblib.models import (
    Preprocessing,
    describe_changes,
    identity_changes,
    load_model,
    named_outputs,
    preprocessing_from_timm,
    save_weights,
    weights_sha256,
)

transformers = pytest.importorskip("transformers")

VIT_SMALL = {"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64, "image_size": 32, "patch_size": 8}
RESNET_SMALL = {"model_type": "resnet", "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1],
                "layer_type": "basic"}


def write_json(path, data):
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def vit_spec(tmp_path):
    return f"hf:ViTModel:{write_json(tmp_path / 'vit.json', VIT_SMALL)}"


def images(n=2, size=32, seed=0):
    return torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# -- transformers ----------------------------------------------------------------------------------------

def test_hf_vit_from_a_config_file_gives_named_outputs_and_the_processor_preprocessing(vit_spec):
    model = load_model(vit_spec)
    assert model.kind == "hf" and type(model.module).__name__ == "ViTModel"
    assert model.preprocessing.size == (32, 32)                     # config.image_size
    assert model.preprocessing.mean == (0.5, 0.5, 0.5) == model.preprocessing.std   # ViTImageProcessor defaults
    assert "ViTImageProcessor" in model.preprocessing.source
    with torch.no_grad():
        out = model(images())
    assert list(out) == ["last_hidden_state", "pooler_output"]
    assert out["last_hidden_state"].shape == (2, 17, 32) and out["pooler_output"].shape == (2, 32)
    assert model.config["hidden_size"] == 32 and "transformers_version" not in model.config
    assert model.output_shapes(32) == {"last_hidden_state": (17, 32), "pooler_output": (32,)}


def test_hf_resnet_takes_its_size_from_the_image_processor_when_the_config_has_none(tmp_path):
    model = load_model(f"hf:ResNetModel:{write_json(tmp_path / 'r.json', RESNET_SMALL)}")
    pre = model.preprocessing
    assert pre.size == (384, 384) and pre.interpolation == "bicubic"    # ConvNextImageProcessor defaults
    assert "shortest_edge" in pre.source
    with torch.no_grad():
        out = model(images(size=40))                                      # resized to 384 by the preprocessing
    assert out["last_hidden_state"].shape == (2, 16, 48, 48)     # 384 / 8: the input was resized
    assert out["pooler_output"].shape == (2, 16, 1, 1)


def test_the_same_seed_builds_the_same_weights_and_the_callers_rng_is_untouched(vit_spec):
    before = torch.random.get_rng_state()
    a, b, c = load_model(vit_spec), load_model(vit_spec), load_model(vit_spec, seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert weights_sha256(a.module) == weights_sha256(b.module) != weights_sha256(c.module)


def test_the_default_model_is_the_trm_and_gives_the_encoders_bytes():
    from nblib.config import preset
    from nblib.trm import TRMVisionEncoder

    cfg = preset("smoke")
    model = load_model(config=cfg)
    assert model.kind == "trm" and model.spec == "trm" and model.preprocessing.layout == "uint8_nhwc"
    x = images(size=cfg.model.image_size)
    with torch.no_grad():
        ours = model(x)
        theirs = TRMVisionEncoder(cfg, seed=cfg.run.seed).eval()(x)
    assert list(ours) == ["sketches", "checksums", "children"]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert load_model("trm:smoke").identity()["weights_sha256"] == model.identity()["weights_sha256"]


# -- factories -----------------------------------------------------------------------------------------------

FACTORY_SOURCE = '''
import torch
from torch import nn

class Tiny(nn.Module):
    preprocessing = {"size": (8, 8), "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}

    def __init__(self, as_dict=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.as_dict = as_dict

    def forward(self, x):
        y = self.conv(x)
        return {"features": y, "mean": y.mean(dim=(2, 3)), "unused": None} if self.as_dict else y

def build():
    return Tiny()

def build_dict():
    return Tiny(as_dict=True)

def not_a_module():
    return "a string"

NOT_CALLABLE = 3
'''


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    name = f"user_models_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(FACTORY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_factory_spec_builds_the_users_module_with_its_declared_preprocessing(factory_module):
    model = load_model(f"{factory_module}:build")
    assert model.kind == "factory" and model.preprocessing.size == (8, 8) and model.preprocessing.std[0] == 0.25
    with torch.no_grad():
        out = model(images(size=20))
    assert list(out) == ["output"] and out["output"].shape == (2, 4, 6, 6)
    with torch.no_grad():
        named = load_model(f"{factory_module}:build_dict")(images(size=8))
    assert list(named) == ["features", "mean"]


@pytest.mark.parametrize("attr, words", [("not_a_module", "returned a str, not a torch.nn.Module"),
                                         ("NOT_CALLABLE", "is a int, not a callable"),
                                         ("missing", "has no 'missing'")])
def test_a_bad_factory_is_refused_naming_what_is_wrong(factory_module, attr, words):
    with pytest.raises(ModelSpecError, match=words):
        load_model(f"{factory_module}:{attr}")


def test_a_factory_whose_module_does_not_import_names_the_module():
    with pytest.raises(ModelSpecError, match="module 'no_such_pkg.models' does not import.*PYTHONPATH"):
        load_model("no_such_pkg.models:build")


# -- weights ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_weights_round_trip_through_safetensors_and_torch(vit_spec, tmp_path, suffix):
    source = load_model(vit_spec, seed=7)
    path = save_weights(source.module, tmp_path / f"w{suffix}")
    loaded = load_model(vit_spec, weights=path)                      # seed 0 weights, then the file's
    assert weights_sha256(loaded.module) == weights_sha256(source.module)
    assert loaded.weights == str(path)
    x = images()
    with torch.no_grad():
        assert torch.equal(loaded(x)["pooler_output"], source(x)["pooler_output"])


def test_trm_weights_from_save_weights_load_and_another_shapes_are_refused(tmp_path):
    from nblib.config import preset

    trm = load_model("trm:smoke")
    trm.module.save_weights(tmp_path / "trm.pt")
    assert load_model("trm:smoke", weights=tmp_path / "trm.pt").identity() == trm.identity()
    other = preset("smoke")
    other = other.replace(H_cycles=other.model.H_cycles + 1)
    with pytest.raises(WeightsError, match="are for TRM"):
        load_model(config=other, weights=tmp_path / "trm.pt")


def test_weights_of_another_model_name_the_missing_unexpected_and_misshapen_keys(vit_spec, tmp_path):
    state = load_model(vit_spec).module.state_dict()
    state.pop("pooler.dense.bias")
    state["extra.weight"] = torch.zeros(2)
    state["layernorm.weight"] = torch.zeros(5)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(WeightsError) as err:
        load_model(vit_spec, weights=tmp_path / "bad.pt")
    text = str(err.value)
    assert "1 missing: pooler.dense.bias" in text and "1 unexpected: extra.weight" in text
    assert "layernorm.weight [5] (model: [32])" in text


@pytest.mark.parametrize("content, words", [(b"not a weights file at all", "neither a safetensors file nor"),
                                            (None, "does not exist"), ("dir", "is a folder")])
def test_a_weights_path_that_is_no_weights_file_is_refused(vit_spec, tmp_path, content, words):
    path = tmp_path / "w.bin"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(WeightsError, match=words):
        load_model(vit_spec, weights=path)


def test_a_torch_file_without_a_state_dict_of_tensors_is_refused(vit_spec, tmp_path):
    torch.save({"lr": 0.1, "step": 3}, tmp_path / "opt.pt")
    with pytest.raises(WeightsError, match="non-tensor entries"):
        load_model(vit_spec, weights=tmp_path / "opt.pt")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(WeightsError, match="holds list"):
        load_model(vit_spec, weights=tmp_path / "list.pt")


# -- outputs ------------------------------------------------------------------------------------------------

def test_named_outputs_of_a_tensor_a_dict_and_a_model_output():
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    t = torch.zeros(2, 3)
    assert list(named_outputs(t)) == ["output"]
    assert list(named_outputs({"b": t, "a": t, "skip": None})) == ["b", "a"]
    out = BaseModelOutputWithPooling(last_hidden_state=t, pooler_output=t[:, 0], hidden_states=(t, t))
    assert list(named_outputs(out)) == ["last_hidden_state", "pooler_output", "hidden_states.0", "hidden_states.1"]
    assert list(named_outputs((t, t))) == ["output.0", "output.1"]


@pytest.mark.parametrize("result, words", [("text", "returned str"), ({"x": 3}, "output 'x' is a int"),
                                           ({"x": None}, "no tensor")])
def test_named_outputs_refuse_what_is_no_tensor(result, words):
    with pytest.raises(ModelOutputError, match=words):
        named_outputs(result)


# -- preprocessing --------------------------------------------------------------------------------------------

def test_preprocessing_scales_normalizes_resizes_and_puts_channels_first():
    pre = Preprocessing(size=(4, 6), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    white = torch.full((1, 8, 8, 3), 255, dtype=torch.uint8)
    out = pre.apply(white)
    assert out.shape == (1, 3, 4, 6) and out.dtype == torch.float32
    assert torch.allclose(out, torch.ones_like(out))


def test_the_fingerprint_covers_what_changes_the_input_and_not_where_it_came_from():
    a = Preprocessing(size=224, source="one")
    assert a.fingerprint() == Preprocessing(size=(224, 224), source="two").fingerprint()
    assert a.fingerprint() != Preprocessing(size=224, mean=(0.1, 0.0, 0.0)).fingerprint()
    assert a.fingerprint() != Preprocessing(size=224, interpolation="bicubic").fingerprint()


def test_timms_data_config_becomes_the_preprocessing():
    pre = preprocessing_from_timm({"input_size": (3, 256, 192), "interpolation": "bicubic",
                                   "mean": (0.4, 0.4, 0.4), "std": (0.2, 0.2, 0.2), "crop_pct": 0.9})
    assert pre.size == (256, 192) and pre.interpolation == "bicubic" and pre.mean == (0.4, 0.4, 0.4)
    with pytest.raises(ConfigError, match="lacks input_size"):
        preprocessing_from_timm({"mean": (0, 0, 0)})


@pytest.mark.parametrize("kwargs, words", [({"layout": "nhwc"}, "layout"), ({"interpolation": "area"}, "interpolation"),
                                           ({"std": (1, 0, 1)}, "std > 0"), ({"size": (0, 4)}, "positive")])
def test_a_bad_preprocessing_is_refused(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        Preprocessing(**kwargs)


def test_uint8_input_of_the_wrong_size_and_an_unknown_override_field_are_refused(vit_spec):
    trm = load_model("trm:smoke")
    with pytest.raises(ConfigError, match="re-render the cache"):
        trm(images(size=32))
    with pytest.raises(ConfigError, match=r"fields \['scal'\] are unknown"):
        load_model(vit_spec, preprocessing={"scal": 1.0})


# -- identity -------------------------------------------------------------------------------------------------

def test_identity_changes_name_the_weights_config_preprocessing_and_class(vit_spec, tmp_path):
    base = load_model(vit_spec).identity()
    assert identity_changes(base, load_model(vit_spec).identity()) == []
    assert identity_changes(base, load_model(vit_spec, seed=1).identity())[0].startswith("weights: sha256")
    wider = write_json(tmp_path / "wide.json", {**VIT_SMALL, "intermediate_size": 96})
    changes = identity_changes(base, load_model(f"hf:ViTModel:{wider}").identity())
    assert "config.intermediate_size: 64 -> 96" in changes and any(c.startswith("weights") for c in changes)
    mean = identity_changes(base, load_model(vit_spec, preprocessing={"size": 32, "mean": (0, 0, 0)}).identity())
    assert mean == ["preprocessing.mean: [0.5, 0.5, 0.5] -> [0.0, 0.0, 0.0]",
                    "preprocessing.std: [0.5, 0.5, 0.5] -> [1.0, 1.0, 1.0]"]
    trm = load_model("trm:smoke").identity()
    vit_class = "transformers.models.vit.modeling_vit.ViTModel"
    assert identity_changes(base, trm)[0] == f"class: {vit_class} -> nblib.trm.TRMVisionEncoder"
    assert "differs from the one the run started with" in describe_changes(base, trm)


# -- specs and missing packages ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, words", [
    ("resnet50", "is not one nblib knows"), ("hf:", "names no class"), ("timm:", "names no model"),
    ("hf:ViTModle", "no class 'ViTModle'; close: ViTModel"), ("hf:ViTConfig", "is not a model class"),
    ("a-b:c", "is not one nblib knows")])
def test_a_bad_spec_is_refused_naming_the_forms(spec, words):
    with pytest.raises(ModelSpecError, match=words):
        load_model(spec)


def test_a_config_file_that_is_missing_not_json_or_for_another_model_is_refused(tmp_path):
    with pytest.raises(ModelSpecError, match="does not exist"):
        load_model(f"hf:ViTModel:{tmp_path / 'none.json'}")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelSpecError, match="is not JSON"):
        load_model(f"hf:ViTModel:{tmp_path / 'bad.json'}")
    with pytest.raises(ModelSpecError, match="model_type 'resnet'; ViTModel takes 'vit'"):
        load_model(f"hf:ViTModel:{write_json(tmp_path / 'r.json', RESNET_SMALL)}")


def test_missing_transformers_and_an_unloadable_timm_name_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependency, match="pip install transformers=="):
        load_model("hf:ViTModel")
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(MissingDependency, match="torchvision built for the installed torch"):
        load_model("timm:resnet18")


def test_a_timm_model_is_built_unpretrained_with_timms_data_config(monkeypatch):
    calls = []

    def create_model(name, pretrained):
        calls.append((name, pretrained))
        if name != "tiny":
            raise RuntimeError(f"Unknown model ({name})")
        return nn.Conv2d(3, 2, 1)

    timm = types.ModuleType("timm")
    timm.__version__ = "fake"
    timm.create_model = create_model
    timm.data = types.ModuleType("timm.data")
    timm.data.resolve_data_config = lambda args, model: {"input_size": (3, 16, 16), "interpolation": "bilinear",
                                                          "mean": (0.5,) * 3, "std": (0.5,) * 3}
    monkeypatch.setitem(sys.modules, "timm", timm)
    monkeypatch.setitem(sys.modules, "timm.data", timm.data)
    model = load_model("timm:tiny")
    assert calls == [("tiny", False)] and model.kind == "timm" and model.preprocessing.size == (16, 16)
    assert model.preprocessing.source.startswith("timm data config")
    with pytest.raises(ModelSpecError, match="timm has no model 'nope'"):
        load_model("timm:nope")


def test_importing_nblib_models_imports_neither_torch_nor_transformers():
    import subprocess

    code = "import sys, nblib.models; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False False"


@pytest.mark.slow
def test_hf_vit_model_from_its_default_config_is_vit_b16():
    model = load_model("hf:ViTModel")
    assert sum(p.numel() for p in model.module.parameters()) == 86_389_248
    assert model.preprocessing.size == (224, 224) and model.preprocessing.mean == (0.5, 0.5, 0.5)
    assert model.output_shapes(224) == {"last_hidden_state": (197, 768), "pooler_output": (768,)}

"""The TRM vision encoder: output shapes, seeded weights, weight files, CPU inference."""
from __future__ import annotations

import hashlib
import shutil

import numpy as np
import pytest
import torch

from nblib.config import preset
from nblib.errors import ConfigError, WeightsError
from nblib.models.weights import weights_sha256
from nblib.trm import TRMVisionEncoder

SMOKE = preset("smoke")


def load_trm_weights(encoder: TRMVisionEncoder, path) -> TRMVisionEncoder:
    """Load weights saved by `save_weights`; refuse weights of another model shape, naming both configs."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("config") != encoder.config.__dict__:
        raise WeightsError(f"weights in {path} are for model {payload.get('config')}, this encoder is "
                           f"{encoder.config.__dict__}; build the encoder with the config the weights came from")
    encoder.load_state_dict(payload["state_dict"])
    return encoder


def _images(n: int, size: int = 64, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8))


def test_outputs_have_the_documented_shapes():
    m = SMOKE.model
    out = TRMVisionEncoder(SMOKE).encode(_images(3))
    assert out["sketches"].shape == (3, m.capsules, m.dim)
    assert out["checksums"].shape == (3, m.capsules, m.checksum_dim)
    assert out["children"].shape == (3, m.capsules, m.children, m.dim)


def test_same_seed_gives_same_weights_and_other_seed_differs():
    a, b, c = TRMVisionEncoder(SMOKE, seed=7), TRMVisionEncoder(SMOKE, seed=7), TRMVisionEncoder(SMOKE, seed=8)
    assert weights_sha256(a) == weights_sha256(b)
    assert weights_sha256(a) != weights_sha256(c)
    images = _images(2)
    assert torch.equal(a.encode(images)["sketches"], b.encode(images)["sketches"])


def test_checksums_are_the_fixed_projection_of_the_sketches():
    enc = TRMVisionEncoder(SMOKE, seed=3)
    out = enc.encode(_images(2))
    assert torch.allclose(out["checksums"], out["sketches"] @ enc.checksum_proj, atol=1e-5)
    assert torch.equal(enc.checksum_proj, TRMVisionEncoder(SMOKE, seed=4).checksum_proj)


def test_saved_weights_load_back_bit_exact(tmp_path):
    trained = TRMVisionEncoder(SMOKE, seed=1)
    path = trained.save_weights(tmp_path / "w.pt")
    fresh = load_trm_weights(TRMVisionEncoder(SMOKE, seed=2), path)
    assert weights_sha256(fresh) == weights_sha256(trained)
    images = _images(2)
    assert torch.equal(fresh.encode(images)["children"], trained.encode(images)["children"])


def test_weights_of_another_model_shape_are_refused(tmp_path):
    path = TRMVisionEncoder(SMOKE.replace(dim=32, heads=4)).save_weights(tmp_path / "w.pt")
    with pytest.raises(WeightsError, match="dim"):
        load_trm_weights(TRMVisionEncoder(SMOKE), path)


def test_images_of_the_wrong_size_are_refused_with_the_sizes():
    with pytest.raises(ConfigError, match="32x32x3.*64x64x3"):
        TRMVisionEncoder(SMOKE).encode(_images(1, size=32))


def test_cpu_inference_is_fp32_without_autograd():
    out = TRMVisionEncoder(SMOKE).encode(_images(1))
    assert all(t.dtype == torch.float32 and not t.requires_grad for t in out.values())
    assert all(t.is_inference() for t in out.values())


def test_parameter_count_matches_the_budget_prediction():
    from nblib import budget

    for cfg in (SMOKE, preset("seed_t4"), SMOKE.replace(layers=3, mlp_ratio=2, children=5)):
        assert sum(p.numel() for p in TRMVisionEncoder(cfg).parameters()) == budget.param_count(cfg.model)


def test_default_inference_options_run_the_plain_forward_byte_for_byte():
    enc = TRMVisionEncoder(SMOKE, seed=5)
    images = _images(3)
    with torch.inference_mode():
        plain = enc(images)
    for out in (enc.encode(images), enc.set_inference().encode(images)):
        assert all(torch.equal(out[k], plain[k]) for k in plain)


def test_the_trms_run_fingerprint_is_the_hash_old_run_manifests_record():
    # encode manifests record the TRM's weights as sha256 over each name and its bytes (no dtype or shape):
    # a resume of a run started before the model contract compares against this very value
    enc = TRMVisionEncoder(SMOKE, seed=5)
    h = hashlib.sha256()
    for name, tensor in sorted(enc.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    assert weights_sha256(enc, typed=False) == h.hexdigest() != weights_sha256(enc)


def test_inference_options_leave_the_weights_alone():
    enc = TRMVisionEncoder(SMOKE, seed=5)
    before = weights_sha256(enc)
    enc.set_inference(precision="bf16", sdpa_backend="math", channels_last_patch_embed=True)
    assert weights_sha256(enc) == before
    assert set(enc.state_dict()) == set(TRMVisionEncoder(SMOKE).state_dict())


def test_forcing_the_backend_pytorch_picks_on_cpu_changes_nothing():
    enc = TRMVisionEncoder(SMOKE, seed=2)
    images = _images(2)
    default = enc.encode(images)
    flash = enc.set_inference(sdpa_backend="flash").encode(images)
    assert all(torch.equal(default[k], flash[k]) for k in default)


def test_other_kernels_agree_with_the_default_within_rounding():
    enc = TRMVisionEncoder(SMOKE, seed=2)
    images = _images(4)
    ref = enc.encode(images)["sketches"]
    for opts in ({"sdpa_backend": "math"}, {"channels_last_patch_embed": True}):
        got = enc.set_inference(**opts).encode(images)["sketches"]
        assert got.dtype == torch.float32
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5), opts
    enc.set_inference(sdpa_backend=None, channels_last_patch_embed=False, precision="bf16")
    low = enc.encode(images)["sketches"]
    assert low.dtype == torch.bfloat16
    assert (low.float() - ref).norm() / ref.norm() < 0.05


def _compiled(backend: str, images, config=SMOKE):
    """A fresh seed-1 encoder compiled with `backend`; (encoder, its outputs, graphs dynamo captured)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    enc = TRMVisionEncoder(config, seed=1).set_inference(compile_mode="default", compile_backend=backend)
    out = enc.encode(images)
    return enc, out, counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def aot_eager():
    """The smoke encoder compiled once with aot_eager (a real dynamo + AOTAutograd compile, no C compiler):
    (encoder, its outputs, graphs captured, the images), for the tests that read it.
    """
    images = _images(2)
    return (*_compiled("aot_eager", images), images)


def test_compiled_encoder_matches_eager_exactly(aot_eager):
    # aot_eager really captures the graph (dynamo) and traces it through AOTAutograd, then runs the
    # traced aten ops: a real compile that needs no C compiler, and bit-exact against eager here
    enc, compiled, graphs, images = aot_eager
    eager = TRMVisionEncoder(SMOKE, seed=1).encode(images)
    assert graphs >= 1                                  # dynamo traced the forward: not a silent eager run
    assert all(torch.equal(eager[k], compiled[k]) for k in eager)
    again = enc.encode(images)                          # the compiled twin is reused, same bytes
    assert all(torch.equal(eager[k], again[k]) for k in eager)


def test_a_compiled_encoder_is_still_a_usable_module(aot_eager):
    # issue 18 bug 1: torch.compile kept the compiled twin as a submodule, so .eval(), state_dict()
    # and the weights hash recursed forever
    fresh = TRMVisionEncoder(SMOKE, seed=1)
    keys, fingerprint = list(fresh.state_dict()), weights_sha256(fresh)
    enc, compiled, _, images = aot_eager
    assert enc.eval() is enc and not enc.training
    assert list(enc.state_dict()) == keys               # no second copy of the weights under the twin
    assert weights_sha256(enc) == fingerprint
    assert all(torch.equal(compiled[k], v) for k, v in enc.encode(images).items())


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="inductor needs a C compiler")
def test_inductor_compiled_encoder_matches_eager_to_float_rounding():
    # inductor generates and compiles C++ kernels (the T4 path uses its Triton side): fused loops
    # reorder float sums, so agreement is to rounding (measured here: max abs diff < 2e-7), not bitwise.
    # One block and one cycle of each kind: every kind of kernel (patch embedding, attention, MLP, the z_L and
    # z_H updates, pooling, both heads) in an eighth of the smoke encoder's graph (a cold compile is minutes)
    tiny = SMOKE.replace(layers=1, H_cycles=1, L_cycles=1)
    images = _images(2)
    eager = TRMVisionEncoder(tiny, seed=1).encode(images)
    _enc, compiled, graphs = _compiled("inductor", images, tiny)
    assert graphs >= 1
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-4, atol=1e-5)


def test_unknown_inference_options_are_refused_with_the_choices():
    enc = TRMVisionEncoder(SMOKE)
    with pytest.raises(ConfigError, match="precision='int8'.*fp16"):
        enc.set_inference(precision="int8")
    with pytest.raises(ConfigError, match="sdpa_backend='fast'.*cudnn"):
        enc.set_inference(sdpa_backend="fast")
    with pytest.raises(ConfigError, match="unknown inference option.*channels_last_patch_embed"):
        enc.set_inference(channels_last=True)
    assert enc.inference.precision == "auto"

"""The registry of model sources (issue 50): a new source is one entry of `nblib.models.SOURCES` (parser,
builder, help line), and every `--model` help text and every refusal of a spec lists the forms from it.
"""
from __future__ import annotations

import pytest
from cli_runner import run_nblib

from nblib.errors import ModelSpecError
from nblib.models import SOURCES, ModelSource, load_model, parse_spec, spec_forms
from nblib.models.load import LoadedModel
from nblib.models.preprocessing import Preprocessing

VERBS = ("encode", "budget", "train")


def _help_text(verb: str) -> str:
    result = run_nblib(verb, "--help")
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split())          # argparse wraps help lines: compare words


@pytest.mark.parametrize("verb", VERBS)
def test_every_model_help_lists_every_source_form(verb):
    text = _help_text(verb)
    for source in SOURCES:
        for form in source.forms:
            assert form in text, (verb, form)


def test_a_spec_no_source_takes_is_refused_listing_every_form():
    with pytest.raises(ModelSpecError) as refused:
        parse_spec("resnet50")
    assert all(form in str(refused.value) for source in SOURCES for form in source.forms)


def _toy_source() -> ModelSource:
    def build(spec, rest, *, config, seed, inputs) -> LoadedModel:
        import torch

        torch.manual_seed(seed)
        return LoadedModel(torch.nn.Linear(int(rest), 2), spec, "toy", Preprocessing(), {"width": int(rest)})

    def parse(spec):
        head, _, rest = spec.partition(":")
        return rest if head == "toy" and rest.isdigit() else None

    return ModelSource("toy", ("toy:WIDTH",), "a linear map of WIDTH inputs", parse, build)


def test_a_new_source_is_one_entry_it_builds_and_every_help_and_refusal_names_it(monkeypatch):
    monkeypatch.setattr("nblib.models.load.SOURCES", [*SOURCES, _toy_source()])
    loaded = load_model("toy:3")
    assert loaded.kind == "toy" and loaded.module.in_features == 3
    assert "toy:WIDTH" in spec_forms()
    with pytest.raises(ModelSpecError, match="toy:WIDTH"):
        parse_spec("nothing-known")
    for verb in VERBS:                                  # in-process: the help is built from the patched registry
        assert "toy:WIDTH" in _help_text(verb), verb


def test_the_sources_parse_the_forms_they_list():
    examples = {"trm": "trm:smoke", "hf": "hf:ViTModel", "timm": "timm:resnet18", "factory": "my_pkg.models:build"}
    assert [source.kind for source in SOURCES] == list(examples)
    for kind, spec in examples.items():
        assert parse_spec(spec)[0] == kind


def test_only_a_blank_spec_or_trm_names_the_trm():
    from nblib.models import names_trm

    specs = (None, "", "trm", "trm:seed_t4", ":seed_t4", ":x", "hf:BertModel")
    assert [names_trm(s) for s in specs] == [True, True, True, True, False, False, False]

"""One meaning per weight option (criterions/method.py, criterions/base.py): ``--kd-weight`` is the word-level KD weight in
every criterion, the papers' names for it are aliases that fairseq-train's parser and the dataclass
both accept, the temperature lives in the base config, and the base refuses any negative weight."""
import dataclasses

import pytest
from fairseq.dataclass.utils import gen_parser_from_dataclass

from conftest import build_tiny_student, kd_criterions
from fairseq_kd.criterions.base import KDCriterionConfig
from hidden_kd_support import build_criterion

FOUR_HEADS = {"encoder_attention_heads": 4, "decoder_attention_heads": 4}
#: criterion -> (the paper's name for --kd-weight, its flag), from each config's kd_weight_alias field
ALIASES = {name: (cls.kd_weight_alias(), "--" + cls.kd_weight_alias().replace("_", "-"))
           for name, cls in kd_criterions().items() if cls.kd_weight_alias()}


def test_every_criterion_has_kd_weight_and_temperature_from_the_base_config():
    for name, cls in kd_criterions().items():
        config_class = getattr(cls, "__dataclass")
        assert issubclass(config_class, KDCriterionConfig), name
        fields = {f.name: f for f in dataclasses.fields(config_class)}
        assert "kd_weight" in fields and "kd_temperature" in fields, name
        # the temperature is declared once, in the base, with its default
        assert fields["kd_temperature"].default == 1.0, name


@pytest.mark.parametrize("criterion", sorted(ALIASES))
def test_paper_alias_sets_the_word_kd_weight(kd_task, criterion):
    build_tiny_student(kd_task, **FOUR_HEADS)
    cls = kd_criterions()[criterion]
    alias, flag = ALIASES[criterion]
    default = build_criterion(cls, kd_task)
    assert default.loss_weights()["word_kd"] == 1.0  # the papers' default, unchanged
    by_alias = build_criterion(cls, kd_task, **{alias: 0.25})
    by_kd_weight = build_criterion(cls, kd_task, kd_weight=0.25)
    assert by_alias.loss_weights() == by_kd_weight.loss_weights()
    assert by_alias.loss_weights()["word_kd"] == 0.25
    # fairseq-train's parser knows both flags
    import argparse

    parser = argparse.ArgumentParser()
    gen_parser_from_dataclass(parser, getattr(cls, "__dataclass")())
    args = parser.parse_args([flag, "0.25"])
    assert getattr(args, alias) == 0.25 and args.kd_weight == 1.0
    with pytest.raises(ValueError, match=flag + r" \(alias of --kd-weight\) must be >= 0"):
        build_criterion(cls, kd_task, **{alias: -1.0})


@pytest.mark.parametrize("criterion, overrides, flag", [
    ("word_kd", {"kd_weight": -0.1}, "--kd-weight"),
    ("minilm", {"kd_weight": -0.1}, "--kd-weight"),
    ("tinybert", {"tinybert_hidden_weight": -0.1}, "--tinybert-hidden-weight"),
    ("internal_kd", {"hard_label_weight": -0.1}, "--hard-label-weight"),
    ("word_kd", {"kd_temperature": 0.0}, "--kd-temperature must be > 0"),
    ("tinybert", {"kd_temperature": -1.0}, "--kd-temperature must be > 0"),
])
def test_the_base_refuses_negative_weights_and_temperatures(kd_task, criterion, overrides, flag):
    build_tiny_student(kd_task, **FOUR_HEADS)
    with pytest.raises(ValueError, match=flag):
        build_criterion(kd_criterions()[criterion], kd_task, **overrides)

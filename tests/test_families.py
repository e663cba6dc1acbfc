"""The three family tables (layout/family.py, convert/family.py, runtime/models/families.py) name the same families,
and each release the synthetic models stand in for is one of them."""

from __future__ import annotations

from dsfp4.convert.family import SOURCE_FAMILIES
from dsfp4.layout.family import FAMILIES
from dsfp4.runtime.models.families import MODEL_FAMILIES
from dsfp4.synthetic.bench_model import model_args
from dsfp4.synthetic.releases import RELEASES


def test_every_family_has_an_entry_in_each_table():
    assert list(FAMILIES) == list(SOURCE_FAMILIES) == list(MODEL_FAMILIES)


def test_every_release_is_of_a_known_family():
    for name in RELEASES:
        assert model_args(2, 0, family=name)[1].family in FAMILIES

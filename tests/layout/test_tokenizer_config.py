"""tokenizer_config.json that is not what its readers take: convert refuses it before converting, the runtime when it
opens the tokenizer, each in one line naming the file and the key."""

from __future__ import annotations

import json
import shutil

import pytest

from dsfp4.errors import ManifestError
from dsfp4.layout.manifest import MANIFEST_NAME
from dsfp4.layout.tokenizer_config import config_problem
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from tests.fixtures.cli import assert_one_line_error, run_cli

BAD = {  # contents -> what the error says
    "[1, 2]": "expected a JSON object, found a list",
    '"text"': "expected a JSON object, found a string",
    "null": "expected a JSON object, found null",
    '{"bos_token": 5}': "bos_token must be text",
    '{"eos_token": {"content": 1}}': "eos_token must be text",
    '{"add_bos_token": "yes"}': "add_bos_token must be true or false",
    '{"chat_template": 5}': "chat_template must be text or a list",
    '{"chat_template": [{"name": "default"}]}': "chat_template must be text or a list",
}


@pytest.mark.parametrize("text", sorted(BAD))
def test_a_tokenizer_config_of_another_shape_is_named(text):
    assert BAD[text] in config_problem(json.loads(text))


def test_the_shapes_transformers_writes_pass():
    good = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True, "chat_template": "{{ x }}"}
    assert config_problem(good) is None
    assert config_problem({"chat_template": [{"name": "default", "template": "t"}]}) is None


def test_the_tokenizer_refuses_a_list_in_one_line(converted, tmp_path):
    model = shutil.copytree(converted, tmp_path / "model")
    (model / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ManifestError, match="tokenizer_config.json: expected a JSON object, found a list"):
        ChatTokenizer(model)


def test_convert_refuses_a_list_before_converting(checkpoints, tmp_path):
    src = shutil.copytree(checkpoints["fp8"], tmp_path / "src")
    (src / "tokenizer_config.json").write_text("[1, 2]")
    result = run_cli("convert", "--fp4", src, tmp_path / "out", "-q")
    assert result.exit_code == 1 and "tokenizer_config.json: expected a JSON object" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out" / MANIFEST_NAME).exists()
    assert not (tmp_path / "out" / "experts").exists()


def test_run_refuses_a_damaged_tokenizer_config_in_one_line(converted, tmp_path):
    model = shutil.copytree(converted, tmp_path / "model")
    (model / "tokenizer_config.json").write_text('{"add_bos_token": "yes"}')
    r = run_cli("run", model, "--prompt", "hi", "--device", "cpu", "-q")
    assert_one_line_error(r, "tokenizer_config.json", "add_bos_token must be true or false")

"""The ``[train]`` keys of real hardware, read from a rollout file: each wrong value is refused with
an error that names its key, and ``auto`` resolves to what this machine has."""

from __future__ import annotations

import pytest

from stepmill.errors import ConfigError
from stepmill.train.config import TOLERANCES, LoraConfig, load_train


def write(tmp_path, body: str):
    (tmp_path / "model").mkdir(exist_ok=True)
    path = tmp_path / "rollout.toml"
    path.write_text(f'[train]\nmodel = "model"\n{body}\n')
    return path


@pytest.mark.parametrize("body,key", [
    ('device = "tpu"', "device"), ('device = "cuda:x"', "device"), ('dtype = "float16"', "dtype"),
    ('attention = "flash"', "attention"), ('attention = "flex"\nlayout = "steps"', "attention"),
    ('gradient_checkpointing = "yes"', "gradient_checkpointing"), ("micro_batch_tokens = -1", "micro_batch_tokens"),
    ("micro_batch_tokens = 1.5", "micro_batch_tokens")])
def test_a_wrong_hardware_key_is_refused_by_name(tmp_path, body, key):
    with pytest.raises(ConfigError, match=rf"\[train\]:? {key}|\[train\] {key}"):
        load_train(write(tmp_path, body))


def test_the_keys_are_read_and_auto_is_this_machines(tmp_path):
    torch = pytest.importorskip("torch")
    train = load_train(write(tmp_path, 'layout = "tree"\ngradient_checkpointing = true\nmicro_batch_tokens = 4096'))
    assert (train.gradient_checkpointing, train.micro_batch_tokens) == (True, 4096)
    gpu = torch.cuda.is_available()
    assert train.torch_device() == ("cuda" if gpu else "cpu")
    assert train.torch_dtype() == ("bfloat16" if gpu else "float32")
    assert train.attention_implementation() == ("flex_attention" if gpu else "sdpa")
    assert train.probe_tolerance() == TOLERANCES[train.torch_dtype()]
    bf16 = load_train(write(tmp_path, 'dtype = "bfloat16"\nattention = "eager"'))
    assert (bf16.torch_dtype(), bf16.attention_implementation(), bf16.probe_tolerance()) == ("bfloat16", "eager", 0.1)
    assert load_train(write(tmp_path, 'dtype = "bfloat16"\ntolerance = 0.5')).probe_tolerance() == 0.5
    if not gpu:
        with pytest.raises(ConfigError, match="flex.*CUDA"):
            load_train(write(tmp_path, 'layout = "tree"\nattention = "flex"')).attention_implementation()
        with pytest.raises(ConfigError, match="no CUDA device"):
            load_train(write(tmp_path, 'device = "cuda:0"')).torch_device()


# -- [train.lora] ----------------------------------------------------------------------------------------
def test_a_lora_table_is_read_with_its_defaults(tmp_path):
    train = load_train(write(tmp_path, '[train.lora]\nrank = 4\nalpha = 8\ntarget_modules = ["q_proj", "o_proj"]'))
    assert (train.lora.rank, train.lora.alpha, train.lora.target_modules) == (4, 8, ("q_proj", "o_proj"))
    defaults = load_train(write(tmp_path, "[train.lora]"))
    assert (defaults.lora.rank, defaults.lora.alpha, defaults.lora.target_modules) == (8, 16, ("q_proj", "v_proj"))
    assert load_train(write(tmp_path, "")).lora is None  # no table: the full weights are trained
    assert LoraConfig.served_name("tiny", "train") == "tiny-train" != "tiny"


@pytest.mark.parametrize("body,says", [
    ("[train.lora]\nrank = 0", "rank must be a positive integer"),
    ("[train.lora]\nrank = 2.5", "rank must be a positive integer"),
    ("[train.lora]\nrank = true", "rank must be a positive integer"),
    ("[train.lora]\nalpha = 0", "alpha must be a positive number"),
    ('[train.lora]\nalpha = "16"', "alpha must be a positive number"),
    ("[train.lora]\ntarget_modules = []", "target_modules must be a non-empty list"),
    ('[train.lora]\ntarget_modules = "q_proj"', "target_modules must be a non-empty list"),
    ('[train.lora]\ntarget_modules = ["q_proj", "model.layers/0"]', "target_modules must be a non-empty list"),
    ("[train.lora]\nranks = 8", "ranks: unknown key; expected some of rank, alpha, target_modules"),
    ("lora = 8", "must be a table"),
    ("lora = true", "must be a table")])
def test_a_wrong_lora_table_is_refused_by_name(tmp_path, body, says):
    with pytest.raises(ConfigError, match=rf"\[train\] lora: {says}"):
        load_train(write(tmp_path, body))

"""Fixtures of the connector tiers (tier 2: vLLM's real Scheduler, no engine)."""
from __future__ import annotations

import json

import pytest

EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 2048, "torch_dtype": "float32",
              "eos_token_id": EOS}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)

"""An hf: config transformers would build wrong or refuse with a traceback is one line naming config.json (#53)."""
import json

import pytest

from autofit.errors import UserError
from autofit.spec import load_spec

transformers = pytest.importorskip("transformers")


def test_a_config_of_no_layers_or_of_heads_that_do_not_divide_the_width_is_one_line(tmp_path):
    llama = tmp_path / "llama"
    transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=32, architectures=["LlamaForCausalLM"]).save_pretrained(llama)
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "num_hidden_layers": -1}))
    with pytest.raises(UserError, match="config.json's num_hidden_layers -1 must be a whole number of at least 1 layer"):
        load_spec(f"hf:{llama}", task="causal-lm", seq_len=8)
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_embd=30, n_head=4, n_layer=1, vocab_size=32, architectures=["GPT2LMHeadModel"]).save_pretrained(gpt2)
    spec = load_spec(f"hf:{gpt2}", task="causal-lm", seq_len=8)
    with pytest.raises(UserError, match=r"transformers cannot build a model from config.json \(.*divisible.*\); fix config.json"):
        spec.build_model()

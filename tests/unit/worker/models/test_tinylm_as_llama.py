"""tinylm is one more config of the Llama family: its weights, renamed to Hugging Face's names beside a
LlamaForCausalLM config.json, load as a LlamaFamilyLM that computes tinylm's logits and greedy tokens.
(What moving tinylm onto the family module would rest on; tinylm itself is unchanged.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.worker.models.llama_weights import load_llama_family
from services.worker.models.transformer import DecoderLM
from services.worker.repository.loader import LoadedModel

# tinylm's parameter names → Hugging Face Llama's ({i}: layer index).
_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.w_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.w_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.w_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def save_as_llama(lm: DecoderLM, directory: Path, max_seq_len: int) -> None:
    c = lm.config
    patterns = {tiny.format(i=i): hf.format(i=i) for tiny, hf in _NAMES.items() for i in range(c.num_layers)}
    tensors = {patterns[name]: tensor.detach().contiguous() for name, tensor in lm.state_dict().items()}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size, "hidden_size": c.d_model,
        "intermediate_size": c.d_ff, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "max_position_embeddings": max_seq_len, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": None, "tie_word_embeddings": False, "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))


def test_tinylm_weights_load_as_a_llama_family_model(tinylm: LoadedModel, tmp_path: Path) -> None:
    generator = tinylm.generator
    assert isinstance(generator.lm, DecoderLM)
    save_as_llama(generator.lm, tmp_path, generator.max_seq_len)
    llama = load_llama_family(tmp_path)

    ids = torch.tensor([list(b"\x01The value of a variable is the value it holds, and ")])
    with torch.inference_mode():
        torch.testing.assert_close(llama(ids), generator.lm(ids), rtol=0.0, atol=2e-4)

    prompt = list(b"def main():\n    ")
    as_llama = type(generator)(llama, max_seq_len=generator.max_seq_len, eos_token_id=generator.eos_token_id,
                               bos_token_id=generator.bos_token_id)
    expected = generator.greedy_paged(prompt, 32, block_size=8)
    top2 = generator.dense_logits(prompt + expected)[len(prompt) - 1:-1].topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) >= 4e-4, "a near-tie in tinylm's greedy path: pick another prompt"
    assert as_llama.greedy_paged(prompt, 32, block_size=8) == expected

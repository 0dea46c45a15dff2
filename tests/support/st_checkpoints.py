"""Tiny sentence-transformers style embedding checkpoints (tests only; nothing is downloaded).

`save_embedding_directory(dir, pooling="mean")` writes what a user brings for Qwen3-Embedding, gte-Qwen2 or
e5-mistral: a tiny random decoder with its tokenizer (hf_checkpoints.save_model_directory), saved as the
*ForCausalLM or, with `base_model`, as the base model without an LM head (Qwen3Model: tensors without the
`model.` prefix), plus modules.json, 1_Pooling/config.json and a 2_Normalize module. `reference_embeddings`
is what sentence-transformers computes from them: transformers' AutoModel last_hidden_state, pooled and
normalized here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from tests.support.hf_checkpoints import save_model_directory

_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def save_embedding_directory(directory: str | Path, *, family: str = "qwen3", pooling: str = "last",
                             normalize: bool = True, base_model: bool = False, matryoshka: bool = False,
                             seed: int = 0) -> Path:
    directory = Path(directory)
    model = save_model_directory(directory, family, seed=seed, **({"is_matryoshka": True} if matryoshka else {}))
    if base_model:
        for stale in directory.glob("model*.safetensors*"):
            stale.unlink()
        model.model.save_pretrained(directory)  # config.json now says Qwen3Model; no lm_head
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": model.config.hidden_size, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "include_prompt": True, **{mode: name == pooling for name, mode in _MODES.items()}}))
    return directory


def reference_embeddings(directory: str | Path, prompts: Sequence[Sequence[int]], *, pooling: str,
                         normalize: bool) -> list[np.ndarray]:
    """Each prompt's embedding by transformers (one prompt at a time: no padding), float64."""
    import transformers

    model = transformers.AutoModel.from_pretrained(directory, torch_dtype=torch.float32).eval()
    vectors = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model(torch.tensor([list(prompt)])).last_hidden_state[0].double()
            pooled = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=0)
            vectors.append(pooled.numpy())
    return vectors

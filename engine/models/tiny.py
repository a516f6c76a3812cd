"""Tiny Llama-style models generated locally, for tests and smoke runs.

No hub is reachable, so tests build their own family: a byte-level BPE
tokenizer trained here on a synthetic corpus, a target model, and drafts
whose agreement with the target is known by construction:

* ``copy``   -- the target's weights: every draft token is accepted;
* ``indep``  -- a different random model: almost nothing is accepted;
* ``noised`` -- the target's weights plus Gaussian noise: in between.

head_dim is 32 because vLLM's CPU attention backend supports it; weights are
fp32 so that greedy speculative output can be compared exactly with plain
decoding.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the a of to and in is it for on with as by at from that this be are was not "
    "model token draft target speculative decode verify accept reject batch class "
    "policy tuner engine record latency def return import print if else for while "
    "summary answer question code list value result error cache step rate"
).split()

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

# name -> (seed, noise std).  noise 0.006: greedy agreement ~0.6, sum min(p, q) ~0.8.
FAMILY = {"target": (1, 0.0), "copy": (1, 0.0), "indep": (2, 0.0), "noised": (1, 0.006)}


def _corpus(lines: int = 3000):
    rng = random.Random(0)
    for _ in range(lines):
        yield " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


def make_tokenizer(out: Path, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, tokenizer, seed: int, noise: float = 0.0, base_seed: int | None = None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.15,  # wider than default: less repetitive greedy text
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if noise:
        gen = torch.Generator().manual_seed(seed + 1000)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(noise * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return model


def make_family(root: str | Path, names: tuple[str, ...] = tuple(FAMILY)) -> dict[str, Path]:
    """Create (idempotently) the tiny model family under ``root``; return paths."""
    root = Path(root)
    paths = {name: root / name for name in names}
    spec = json.dumps({name: FAMILY[name] for name in names}, sort_keys=True)
    stamp = root / "family.json"
    if stamp.exists() and stamp.read_text() == spec and all((p / "model.safetensors").exists() for p in paths.values()):
        return paths
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(root / "tokenizer")
    for name, path in paths.items():
        seed, noise = FAMILY[name]
        make_model(path, tokenizer, seed=seed, noise=noise)
    stamp.write_text(spec)
    return paths

"""Build a tiny random-weight Llama and an offline-trained tokenizer (run with the vLLM venv's python).

Why not a real model: the e2e checks pdserve's wiring around vLLM (KV transfer, DP ranks, error
paths), not the model's quality, and must run without downloading anything. The shape is the
smallest the CPU attention backend takes (head_dim 32; 16 is not supported). Weights come from a
fixed seed, so the same directory is built every time.

    python make_model.py OUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 2048
MAX_POSITIONS = 2048
SEED = 1234
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def corpus(words: int = 6000) -> list[str]:
    """A few KB of pseudo-English from fixed syllables: enough for a 2k BPE vocabulary."""
    rng = random.Random(SEED)
    onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee"]
    codas = ["", "", "n", "r", "s", "t", "l", "ng", "ck"]
    common = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on"]
    lines, line = [], []
    for _ in range(words):
        if rng.random() < 0.35:
            word = rng.choice(common)
        else:
            word = "".join(
                rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3))
            )
        line.append(word)
        if len(line) >= rng.randint(8, 16):
            lines.append(" ".join(line) + rng.choice([".", ",", "?", "!"]))
            line = []
    return lines


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "pdserve-tiny-model.json").write_text(
        json.dumps({"seed": SEED, "vocab": len(fast), "built_by": "tests/e2e_vllm/make_model.py"}) + "\n"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_model.py OUT_DIR")
    build(Path(sys.argv[1]))

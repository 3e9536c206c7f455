#!/usr/bin/env python3
"""Writes a tiny Llama-architecture model with random weights, and a tokenizer, to a folder.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a few built-in
sentences (byte-level, so every text encodes, with no unknown token), saved as a
PreTrainedTokenizerFast; the model is LlamaForCausalLM(LlamaConfig(...)) with a fixed seed, so
the same arguments give the same weights. vLLM loads the folder as a local model path.

    python make_tiny_llama.py OUT_DIR [--layers N] [--seed S]
"""

import argparse
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A transfer engine moves the key and value cache from a prefill server to a decode server.",
    "Every request owns a room; a room ends succeeded, failed or aborted, and is then cleared.",
    "Pages of the cache are registered once and read many times by remote engines.",
    "Once upon a time there was a small model that only knew random numbers.",
    "def main():\n    print('hello, world')\n",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "She sells sea shells by the sea shore, and the shells she sells are sea shells.",
]
SPECIAL = ["<unk>", "<s>", "</s>"]


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=4096,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size at most")
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tokenizer = build_tokenizer(args.vocab)
    config = LlamaConfig(
        # The model's vocabulary is the tokenizer's, so every sampled id decodes.
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    # Random weights at the usual 0.02 scale give nearly flat logits; a wider embedding and
    # head make greedy choices clear-cut, so a wrong KV cache changes the tokens.
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 0.5)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(json.dumps({"out": args.out, "vocab": len(tokenizer), "layers": args.layers,
                      "params": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()

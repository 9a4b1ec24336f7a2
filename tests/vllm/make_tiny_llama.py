"""Builds a tiny random Llama (2 layers, head_dim 64) with a word-level tokenizer, no download.
With ``--hybrid``: a tiny Gemma2 instead, whose first layer attends through a 64-token sliding
window and whose second attends to everything, so vLLM gives it two KV-cache groups (hybrid
allocator).

initializer_range 0.1 so that corrupted KV visibly moves the log-probabilities (see
shared/reference/engines.md)."""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def main(out: str, hybrid: bool = False) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(1000)}
    vocab["<unk>"] = 1000
    vocab["<s>"] = 1001
    vocab["</s>"] = 1002
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out_dir)
    torch.manual_seed(0)
    if hybrid:
        from transformers import Gemma2Config, Gemma2ForCausalLM

        cfg = Gemma2Config(vocab_size=1003, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                           head_dim=64, sliding_window=64,
                           layer_types=["sliding_attention", "full_attention"],
                           max_position_embeddings=4096, initializer_range=0.1,
                           bos_token_id=1001, eos_token_id=1002, pad_token_id=0,
                           torch_dtype="float32")
        Gemma2ForCausalLM(cfg).save_pretrained(out_dir)
        print(json.dumps({"model": str(out_dir)}))
        return
    cfg = LlamaConfig(vocab_size=1003, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=4096, initializer_range=0.1,
                      bos_token_id=1001, eos_token_id=1002, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out_dir)
    print(json.dumps({"model": str(out_dir)}))


if __name__ == "__main__":
    main(sys.argv[1], hybrid="--hybrid" in sys.argv[2:])

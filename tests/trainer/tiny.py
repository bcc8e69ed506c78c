"""Tiny model configs shared by the trainer tests (hidden 64, 2 layers, 8 experts, seq 16), one per MoE family."""
from __future__ import annotations

from typing import Any

from megaloom.train.config import Config, merge, validate
from megaloom.models.plan import max_rel_err  # noqa: F401  (the parity metric, re-exported for the tests)

QWEN3_MOE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                 num_experts_per_tok=2, max_position_embeddings=64)

DEEPSEEK_V3 = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=2, first_k_dense_replace=1, q_lora_rank=None,
                   kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                   max_position_embeddings=64)

QWEN2_MOE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)

MIXTRAL = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64)

OLMOE = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)

# group-limited routing as DeepSeek-V3 has it (8 groups, 4 picked), scaled down: 4 groups of 2, 2 picked
DEEPSEEK_V3_GROUPED = {**DEEPSEEK_V3, "n_group": 4, "topk_group": 2}

FAMILIES = {"qwen3_moe": QWEN3_MOE, "qwen2_moe": QWEN2_MOE, "deepseek_v3": DEEPSEEK_V3_GROUPED, "mixtral": MIXTRAL,
            "olmoe": OLMOE}

# more families, every layer an MoE block of 4 experts: swapped since the swap takes a Linear-subclass router
# (PhiMoE, without jitter) and a correction bias on the block (MiniMax-M2, HY-V3, LFM2-MoE) ...
_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
WIDENED = {
    "phimoe": {**_BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "input_jitter_noise": 0.0},
    "minimax_m2": {**_BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "bos_token_id": 1,
                   "eos_token_id": 2},
    "hy_v3": {**_BASE, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "moe_intermediate_size": 32,
              "mlp_layer_types": ["sparse", "sparse"]},
    "lfm2_moe": {**_BASE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "num_dense_layers": 0, "layer_types": ["full_attention", "conv"]},
}
# ... and families trained as they are (their blocks refused, with the part named)
UNSWAPPED = {
    "gpt_oss": {**_BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
    "llama4_text": {**_BASE, "num_local_experts": 4, "num_experts_per_tok": 1, "head_dim": 16,
                    "intermediate_size_mlp": 64, "moe_layers": [0, 1]},
    "dbrx": {"vocab_size": 128, "d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 64,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}},
    "hunyuan_v1_moe": {**_BASE, "num_experts": 4, "moe_topk": 2, "head_dim": 16},
    "afmoe": {**_BASE, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "moe_intermediate_size": 32,
              "num_dense_layers": 0},
    "jetmoe": {**_BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "kv_channels": 16},
}
ALL = {**FAMILIES, "deepseek_v3": DEEPSEEK_V3, **WIDENED, **UNSWAPPED}


def available(kinds) -> list[str]:
    """The model types of ``kinds`` the installed transformers has."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return [k for k in kinds if k in CONFIG_MAPPING]


def tiny_raw(out_dir: str, kind: str = "qwen3_moe", steps: int = 6, **sections: dict[str, Any]) -> dict[str, Any]:
    """A raw (unvalidated) config of a tiny run writing under ``out_dir``."""
    raw = {
        "run": {"seed": 0, "out_dir": str(out_dir), "progress": False},
        "model": {"kind": kind, "config": ALL[kind]},
        "data": {"seq_len": 16, "batch_size": 4},
        "optimizer": {"lr": 3e-3},
        "schedule": {"steps": steps, "warmup_steps": 2, "decay": "cosine"},
    }
    return merge(raw, sections)


def tiny_config(out_dir: str, kind: str = "qwen3_moe", steps: int = 6, **sections: dict[str, Any]) -> Config:
    return validate(tiny_raw(out_dir, kind, steps, **sections))


WORDS = "the quick brown fox jumps over a lazy dog while seven red birds sing in tall green trees".split()


def write_corpus(folder, docs: int = 40, seed: int = 0) -> tuple[str, str]:
    """A jsonl corpus of ``docs`` seeded word documents (1 to 30 words) and a byte-level BPE tokenizer
    trained on it offline with ``tokenizers`` (vocab 128, ``<eos>`` its EOS), saved as a transformers
    tokenizer directory. Returns (jsonl path, tokenizer directory)."""
    import json
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(docs)]
    path = f"{folder}/corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=128, special_tokens=["<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(f"{folder}/tokenizer")
    return path, f"{folder}/tokenizer"

"""generation_config.json shapes real checkpoints ship, their token ids moved into the tiny models' vocabulary
(6,400 tokens): the export and the import must take each (model/generation_defaults.py's rules refuse what
transformers' generate fails on, not these)."""

from __future__ import annotations

from transformers import GenerationConfig

# Qwen3's and Llama 3.1 Instruct's (the fields of their published files), a transformers 4 full dump (every default
# written out, as older checkpoints carry) and a transformers 5 full dump (to_dict(): null for every unset field,
# do_sample too)
ACCEPTED_GENERATION_CONFIGS = [
    ("qwen3", {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 1], "pad_token_id": 1, "temperature": 0.6,
               "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}),
    ("llama3", {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3, 4], "temperature": 0.6, "top_p": 0.9,
                "transformers_version": "4.42.3"}),
    ("transformers4_full", {"max_length": 20, "min_length": 0, "do_sample": False, "early_stopping": False,
                            "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "temperature": 1.0,
                            "top_k": 50, "top_p": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                            "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "length_penalty": 1.0,
                            "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None,
                            "num_return_sequences": 1, "output_scores": False, "return_dict_in_generate": False,
                            "forced_bos_token_id": None, "forced_eos_token_id": None, "remove_invalid_values": False,
                            "exponential_decay_length_penalty": None, "suppress_tokens": None,
                            "begin_suppress_tokens": None, "guidance_scale": None, "sequence_bias": None,
                            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                            "transformers_version": "4.36.0"}),
    ("transformers5_full", GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).to_dict()),
]

"""Other projects' formats: a run's weights to and from Hugging Face (hf.py), the Llama mapping (llama.py) and
OLMoE's mixture of experts (olmoe.py). Pretokenized readers stay in data/."""

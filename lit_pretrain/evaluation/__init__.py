"""Downstream evaluation through EleutherAI's lm-evaluation-harness (the optional `eval` extra).

lm.py wraps our GPT and tokenizer as lm-eval's `LM`; harness.py finds tasks and runs them; command.py is
`lit-pretrain evaluate`. Nothing here is imported by training unless `callbacks.downstream_eval` is enabled.
"""

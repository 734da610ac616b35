"""The GPT as plain `nn.Module`s: no Lightning, no torch.distributed. Its shape (`GPTConfig` and the architecture
table, config.py), the network (gpt.py), the mixture of experts and its kernels (moe.py, moe_kernels.py), the
initialization (init.py), the language-model loss (losses.py), and the counts and shapes the planners sum from
the table (shapes.py: parameters, FLOPs per token, a shape near a parameter count).

`from lit_pretrain.model import GPT, GPTConfig` is the public face. GPT is handed on at first use: the config
(`lit-pretrain show`, `--help`) reads GPTConfig without importing torch."""

from lit_pretrain.model.config import GPTConfig

__all__ = ["GPT", "GPTConfig"]


def __getattr__(name):
    if name == "GPT":
        from lit_pretrain.model.gpt import GPT

        return GPT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""lit-pretrain: a Lightning codebase for pretraining language models from random initialization."""

__version__ = "0.1.0"

"""How work is split across devices: config → Lightning strategy. Wraps the plain model from outside."""

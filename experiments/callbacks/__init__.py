"""Example user callbacks, loaded by a config as `experiments.callbacks.<module>:<Class>`."""

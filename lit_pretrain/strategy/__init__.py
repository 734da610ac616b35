"""The Lightning glue of a parallel plan: which Lightning strategy a plan runs under, and the mesh strategy that
sets up the process groups of tensor, pipeline and context parallelism and saves and loads their checkpoints. The
transforms it applies to the model stand below it, in parallel/."""

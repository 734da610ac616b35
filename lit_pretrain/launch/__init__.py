"""Starting and ending processes: the torchrun and SLURM commands of a run, the bounded start-up rendezvous, the
world size a launcher gives against the config's, Lightning's local-rank launcher, the peer watchdog that ends a job
when a rank dies or hangs, and the supervisor that restarts a failed run from its newest verified checkpoint."""
